"""Upcycling a dense Llama into a Qwen3-MoE (exl3_jax.quant.upcycle).

References: the dense source model (identical experts + routing weights summing to 1 must give the
dense function), a NumPy softmax-top-k MoE over the stored expert tensors (perturbed experts), and
the source checkpoint's tensors (copies must be bit-exact)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.format import Exl3Checkpoint, TensorStore
from exl3_jax.generate import Generator
from exl3_jax.models import ModelConfig, load_model
from exl3_jax.nn import Exl3Experts, MoEBlock, PlainExperts
from exl3_jax.quant.upcycle import (UpcycleError, router_weight, upcycle_exl3, upcycle_hf)
from helpers_models import RECOMPUTE_SHAPE, cached_models, write_models

jax.config.update("jax_default_matmul_precision", "highest")

E, TOP_K = 4, 2
MLP = ("gate_proj", "up_proj", "down_proj")


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    return cached_models("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def upcycled(llama_dirs, tmp_path_factory):
    """(dense EXL3 dir, upcycled EXL3 dir, router seed)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"router seed: {seed}")
    out = upcycle_exl3(llama_dirs[0], tmp_path_factory.mktemp("up") / "moe", num_experts=E,
                       top_k=TOP_K, seed=seed)
    return llama_dirs[0], out, seed


def softmax_topk(logits):
    """NumPy router: logits [T, E] -> (ids [T, k] best first, weights [T, k] summing to 1)."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :TOP_K]
    w = np.take_along_axis(p, top, -1)
    return top, w / w.sum(-1, keepdims=True)


def softmax_topk_moe(x, router, experts):
    """NumPy reference: x float64 [T, H], router [E, H], experts [(gate [I, H], up [I, H],
    down [H, I])] (HF [out, in]) -> ([T, H], ids [T, k])."""
    top, w = softmax_topk(x @ router.T)                                      # [T, k] each
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            g, u, d = experts[top[t, j]]
            a = x[t] @ g.T
            out[t] += w[t, j] * ((a / (1 + np.exp(-a)) * (x[t] @ u.T)) @ d.T)
    return out, top


# -- EXL3 source ----------------------------------------------------------------------------------

def test_upcycled_exl3_logits_equal_dense(upcycled, rng):
    dense_dir, moe_dir, _ = upcycled
    tokens = rng.integers(0, 300, size=RECOMPUTE_SHAPE)
    dense = np.asarray(Generator(load_model(dense_dir, dtype="float32",
                                            cache_dequantized=True)).logits(tokens))
    moe_model = load_model(moe_dir, dtype="float32", cache_dequantized=True)
    for layer in moe_model.layers:
        assert isinstance(layer.mlp, MoEBlock) and isinstance(layer.mlp.experts, Exl3Experts)
        assert layer.mlp.experts.num_experts == E and layer.mlp.top_k == TOP_K
        assert layer.mlp.renormalize and layer.mlp.router_kind == "softmax"
        assert layer.self_attn.q_norm is None and layer.self_attn.k_norm is None
    moe = np.asarray(Generator(moe_model).logits(tokens))
    assert np.all(np.isfinite(moe))
    # identical experts, weights summing to 1: only fp32 rounding in the weighted sum differs
    # (measured ~1e-7; weights not renormalised to 1 would give ~3e-2)
    err = rel_l2(moe, dense)
    assert err < 2e-6, err
    np.testing.assert_allclose(moe, dense, rtol=0, atol=2e-6 * np.abs(dense).max())


def test_upcycled_exl3_routes_tokens_over_experts(upcycled, rng):
    """The MoE block really routes: ids/weights match a NumPy softmax top-k of the stored router
    on random hidden states, several experts get tokens, and the output equals the dense MLP."""
    dense_dir, moe_dir, _ = upcycled
    moe_model = load_model(moe_dir, dtype="float32", cache_dequantized=True)
    dense_model = load_model(dense_dir, dtype="float32", cache_dequantized=True)
    block, mlp = moe_model.layers[1].mlp, dense_model.layers[1].mlp
    x = rng.standard_normal((64, 192)).astype(np.float32)
    ids, w = (np.asarray(a) for a in block.route(jnp.asarray(x)))
    router = np.asarray(Exl3Checkpoint(moe_dir).read_tensor("model.layers.1.mlp.gate.weight"),
                        np.float64)
    expect_ids, expect_w = softmax_topk(x.astype(np.float64) @ router.T)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_allclose(w, expect_w, rtol=1e-5)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert len(np.unique(ids)) >= 3, "a random router should spread 64 tokens over >= 3 experts"
    got, ref = np.asarray(block(jnp.asarray(x))), np.asarray(mlp(jnp.asarray(x)))
    assert rel_l2(got, ref) < 1e-5


def test_upcycled_exl3_layout_and_tensors(upcycled):
    dense_dir, moe_dir, seed = upcycled
    src, out = Exl3Checkpoint(dense_dir), Exl3Checkpoint(moe_dir)
    cfg = out.config
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (E, TOP_K)
    assert cfg["moe_intermediate_size"] == src.config["intermediate_size"]
    assert cfg["norm_topk_prob"] is True and cfg["use_qk_norm"] is False
    assert cfg["head_dim"] == src.config["head_dim"] and "mlp_bias" not in cfg
    parsed = ModelConfig.from_hf(cfg)
    assert parsed.moe.moe_layers == (True, True) and not parsed.qk_norm
    assert parsed.rope == ModelConfig.from_hf(src.config).rope

    L = src.config["num_hidden_layers"]
    dense_mlp = {f"model.layers.{i}.mlp.{p}" for i in range(L) for p in MLP}
    experts = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(L) for e in range(E)
               for p in MLP}
    assert set(out.linears) == (set(src.linears) - dense_mlp) | experts
    for key in out.linears:
        origin = re.sub(r"\.experts\.\d+\.", ".", key)     # expert e <- the dense MLP
        a, b = out.read_linear(key), src.read_linear(origin)
        assert out.linears[key].codebook == src.linears[origin].codebook
        assert out.linears[key].K == src.linears[origin].K
        for part in ("trellis", "suh", "svh"):
            np.testing.assert_array_equal(a[part], b[part], err_msg=f"{key}.{part}")
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(L)}
    assert set(out.plain) == set(src.plain) | routers
    for name in src.plain:
        np.testing.assert_array_equal(out.read_tensor(name), src.read_tensor(name))
    for i in range(L):
        r = out.read_tensor(f"model.layers.{i}.mlp.gate.weight")
        assert r.dtype == np.float16 and r.shape == (E, 192)
        np.testing.assert_array_equal(r, router_weight(seed, i, E, 192).astype(np.float16))
    assert not np.array_equal(out.read_tensor("model.layers.0.mlp.gate.weight"),
                              out.read_tensor("model.layers.1.mlp.gate.weight"))
    assert out.quantization_config["bits"] == src.quantization_config["bits"]
    assert out.quantization_config["upcycle"]["num_experts"] == E


def test_qwen3_configs_make_qk_norm_optional():
    from exl3_jax.models import ConfigFieldError
    from helpers_models import CONFIGS

    for arch in ("qwen3", "qwen3_moe"):
        assert ModelConfig.from_hf(CONFIGS[arch]).qk_norm, "q/k norm stays the default"
        assert not ModelConfig.from_hf(dict(CONFIGS[arch], use_qk_norm=False)).qk_norm
        with pytest.raises(ConfigFieldError, match="use_qk_norm"):
            ModelConfig.from_hf(dict(CONFIGS[arch], use_qk_norm="no"))


# -- HF source ------------------------------------------------------------------------------------

def test_upcycled_hf_noise_zero_equals_dense_and_noise_perturbs(llama_dirs, tmp_path, rng):
    hf_dir = llama_dirs[1]
    tokens = rng.integers(0, 300, size=RECOMPUTE_SHAPE)
    dense = np.asarray(Generator(load_model(hf_dir, dtype="float32")).logits(tokens))
    exact = upcycle_hf(hf_dir, tmp_path / "exact", num_experts=E, top_k=TOP_K, noise=0.0)
    moe = np.asarray(Generator(load_model(exact, dtype="float32")).logits(tokens))
    assert rel_l2(moe, dense) < 1e-5

    noise = 0.05
    noisy = upcycle_hf(hf_dir, tmp_path / "noisy", num_experts=E, top_k=TOP_K, noise=noise,
                       seed=3)
    src, out = TensorStore(hf_dir), TensorStore(noisy)
    w = src.read("model.layers.0.mlp.up_proj.weight")
    copies = [out.read(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in range(E)]
    for c in copies:
        assert c.dtype == w.dtype and c.shape == w.shape
        assert abs(np.std(c - w) / np.std(w) / noise - 1) < 0.05   # ~30k samples: +-1% std
    assert not np.array_equal(copies[0], copies[1])
    assert json.loads((noisy / "config.json").read_text())["upcycle"]["noise"] == noise


def test_upcycled_hf_moe_block_matches_numpy_moe(llama_dirs, tmp_path, rng):
    """Perturbed (distinct) experts: the model's MoE block equals a NumPy softmax-top-k MoE over
    the stored tensors, and differs from the dense MLP (so routing decides the output)."""
    hf_dir = llama_dirs[1]
    out = upcycle_hf(hf_dir, tmp_path / "moe", num_experts=E, top_k=TOP_K, noise=0.3,
                     seed=int(rng.integers(1 << 31)))
    model = load_model(out, dtype="float32")
    block = model.layers[0].mlp
    assert isinstance(block, MoEBlock) and isinstance(block.experts, PlainExperts)
    store = TensorStore(out)
    p = "model.layers.0.mlp"
    experts = [tuple(np.asarray(store.read(f"{p}.experts.{e}.{n}.weight"), np.float64)
                     for n in MLP) for e in range(E)]
    x = rng.standard_normal((48, 192))
    ref, top = softmax_topk_moe(x, np.asarray(store.read(f"{p}.gate.weight"), np.float64),
                                experts)
    got = np.asarray(block(jnp.asarray(x, jnp.float32)))
    assert rel_l2(got, ref) < 1e-5
    assert len(np.unique(top)) >= 3
    dense = np.asarray(load_model(hf_dir, dtype="float32").layers[0].mlp(
        jnp.asarray(x, jnp.float32)))
    assert rel_l2(got, dense) > 0.05


@pytest.mark.slow
def test_upcycled_hf_quantized_through_convert_hf(tmp_path, rng):
    """noise > 0 then convert_hf: distinct EXL3 experts that load as Exl3Experts and track the
    unquantized MoE (one layer, 2 experts, K=3 fast: ~2.5k tiles, minutes on 2 cores)."""
    _, hf_dir = write_models("llama", tmp_path / "src", rng,
                             config_overrides={"num_hidden_layers": 1})
    kw = dict(num_experts=2, top_k=1, noise=0.1, seed=int(rng.integers(1 << 31)))
    plain = upcycle_hf(hf_dir, tmp_path / "plain", **kw)
    quant = upcycle_hf(hf_dir, tmp_path / "quant", bits=3, head_bits=16, mode="fast", **kw)
    ckpt = Exl3Checkpoint(quant)
    assert ckpt.config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ckpt.quantization_config["bits"] == 3
    experts = [ckpt.read_linear(f"model.layers.0.mlp.experts.{e}.up_proj") for e in range(2)]
    assert not np.array_equal(experts[0]["trellis"], experts[1]["trellis"])
    assert "model.layers.0.mlp.gate.weight" in ckpt.plain
    model = load_model(quant, dtype="float32", cache_dequantized=True)
    assert isinstance(model.layers[0].mlp.experts, Exl3Experts)
    tokens = rng.integers(0, 300, size=RECOMPUTE_SHAPE)
    ref = np.asarray(Generator(load_model(plain, dtype="float32")).logits(tokens))
    got = np.asarray(Generator(model).logits(tokens))
    assert rel_l2(got, ref) < 0.1          # 3-bit quantization error (measured ~0.05)


# -- bad inputs -----------------------------------------------------------------------------------

def test_bad_inputs_give_clear_errors(llama_dirs, tmp_path_factory, tmp_path):
    exl3_dir, hf_dir = llama_dirs
    qwen3_exl3, qwen3_hf = cached_models("qwen3", tmp_path_factory)
    with pytest.raises(UpcycleError, match="LlamaForCausalLM.*'Qwen3ForCausalLM'"):
        upcycle_exl3(qwen3_exl3, tmp_path / "a")
    with pytest.raises(UpcycleError, match="LlamaForCausalLM.*'Qwen3ForCausalLM'"):
        upcycle_hf(qwen3_hf, tmp_path / "a")
    with pytest.raises(UpcycleError, match=r"top_k .*\[1, num_experts=4\].* 5"):
        upcycle_exl3(exl3_dir, tmp_path / "a", num_experts=4, top_k=5)
    with pytest.raises(UpcycleError, match="num_experts must be a positive integer"):
        upcycle_exl3(exl3_dir, tmp_path / "a", num_experts=0, top_k=1)
    with pytest.raises(UpcycleError, match="noise must be >= 0"):
        upcycle_hf(hf_dir, tmp_path / "a", noise=-0.1)
    with pytest.raises(UpcycleError, match="is quantized; use upcycle_exl3"):
        upcycle_hf(exl3_dir, tmp_path / "a")
    with pytest.raises(Exception, match="not an EXL3 checkpoint"):
        upcycle_exl3(hf_dir, tmp_path / "a")
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        upcycle_exl3(exl3_dir, tmp_path / "exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"], "no partial output left"


# -- the default model ----------------------------------------------------------------------------

@pytest.mark.slow
def test_upcycled_default_model_answers_paris(default_model, tmp_path):
    from exl3_jax.tokenizer import Tokenizer

    moe_dir = upcycle_exl3(default_model, tmp_path / "smollm2-moe", num_experts=8, top_k=2)
    model = load_model(moe_dir, dtype="float32", cache_dequantized=True)
    assert all(isinstance(layer.mlp, MoEBlock) for layer in model.layers)
    tok = Tokenizer.from_dir(moe_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content":
                                       "What is the capital of France?"}])
    ids = tok.encode(prompt, add_bos=False)
    stop = sorted(set(model.config.eos_token_ids) | {tok.eos_token_id} - {None})
    out = Generator(model).generate([ids], max_new_tokens=24, stop_tokens=stop)
    answer = tok.decode(out.tokens[0])
    print(answer)
    assert "Paris" in answer, answer
