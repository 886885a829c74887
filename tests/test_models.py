"""Model graphs on synthetic random-trellis checkpoints, one per architecture: the EXL3 forward vs
the forward of the dequantized fp32 HF twin, and bad model directories."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.format import Exl3FormatError, MissingTensorError, TensorShapeError
from exl3_jax.generate import Generator
from exl3_jax.models import (ConfigFieldError, UnsupportedArchitectureError, load_model)
from exl3_jax.nn import Exl3Experts, Exl3Linear, Linear, MoEBlock, TieredExl3Experts
from helpers_models import ARCHS, RECOMPUTE_SHAPE, cached_models, write_models

jax.config.update("jax_default_matmul_precision", "highest")


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=ARCHS)
def arch_dirs(request, tmp_path_factory):
    return request.param, *cached_models(request.param, tmp_path_factory)


def test_exl3_forward_matches_dequantized_fp32_and_bf16(arch_dirs, rng):
    arch, exl3_dir, hf_dir = arch_dirs
    tokens = rng.integers(0, 300, size=RECOMPUTE_SHAPE)   # shape shared with test_generate
    ref = np.asarray(Generator(load_model(hf_dir, dtype="float32")).logits(tokens))
    assert ref.shape == (*RECOMPUTE_SHAPE, 300) and np.all(np.isfinite(ref))
    exl3 = load_model(exl3_dir, dtype="float32")
    got = np.asarray(Generator(exl3).logits(tokens))
    assert rel_l2(got, ref) < 1e-5, arch
    bf16 = np.asarray(Generator(load_model(exl3_dir)).logits(tokens))
    # A top-k router is discontinuous: when the k-th and (k+1)-th expert scores of a token are
    # within bf16 rounding, bf16 may legitimately pick the other expert and that token's logits
    # move a lot. MoE models may therefore leave out up to 3% of positions (the worst ones).
    per_pos = np.linalg.norm(bf16 - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    keep = np.ones(per_pos.shape, bool)
    if arch in ("qwen3_moe", "mixtral", "glm4_moe"):
        worst = np.argsort(per_pos, axis=None)[::-1][:max(1, per_pos.size * 3 // 100)]
        keep[np.unravel_index(worst, per_pos.shape)] = False
    err = rel_l2(bf16[keep], ref[keep])
    assert err < 2e-2, (arch, err, np.sort(per_pos, axis=None)[-5:])
    assert err > 1e-6, "bf16 mode should differ from fp32 (is it really bf16?)"


def test_graph_structure(arch_dirs):
    arch, exl3_dir, hf_dir = arch_dirs
    m = load_model(exl3_dir, dtype="float32")
    c = m.config
    assert isinstance(m.lm_head, Exl3Linear), "EXL3 lm_head must be used, never re-tied"
    assert m.lm_head.weight.out_features == c.vocab_size and m.lm_head.weight.n == 384
    kinds = [type(layer.mlp).__name__ for layer in m.layers]
    expect = {"llama": ["GatedMLP"] * 2, "qwen3": ["GatedMLP"],
              "qwen3_moe": ["GatedMLP", "MoEBlock"], "mixtral": ["MoEBlock"],
              "glm4_moe": ["GatedMLP", "MoEBlock"]}[arch]
    assert kinds == expect
    for layer in m.layers:
        if isinstance(layer.mlp, MoEBlock):
            assert isinstance(layer.mlp.experts, Exl3Experts)
            assert layer.mlp.experts.gate.stack_shape == (4,)
            assert (layer.mlp.router_kind == "sigmoid") == (arch == "glm4_moe")
            router = layer.mlp.router.weight                     # [E, H] as stored
            assert router.dtype == jnp.float16 and router.shape == (4, c.hidden_size)
            assert (layer.mlp.shared is not None) == (arch == "glm4_moe")
    assert (m.layers[0].self_attn.q_norm is not None) == (arch in ("qwen3", "qwen3_moe",
                                                                     "glm4_moe"))
    hf = load_model(hf_dir, dtype="float32")
    assert isinstance(hf.lm_head, Linear)


def test_hf_tied_head_without_lm_head(tmp_path):
    """An unquantized directory with tie_word_embeddings and no lm_head uses the embedding."""
    _, hf = write_models("llama", tmp_path, np.random.default_rng(0))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    m = load_model(hf, dtype="float32")
    assert m.lm_head is None
    tokens = np.array([[5, 6, 7]])
    logits = np.asarray(Generator(m).logits(tokens))
    assert logits.shape == (1, 3, 300)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_model(hf)


# -- bad model directories ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_exl3(tmp_path_factory):
    return cached_models("llama", tmp_path_factory)[0]


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture(llama_exl3, tmp_path):
    d = _edited(llama_exl3, tmp_path / "m", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FooForCausalLM.*LlamaForCausalLM"):
        load_model(d)


def test_missing_config_field(llama_exl3, tmp_path):
    d = _edited(llama_exl3, tmp_path / "m", hidden_size=None)
    with pytest.raises(ConfigFieldError, match="hidden_size"):
        load_model(d)


def test_missing_layer_tensors(llama_exl3, tmp_path):
    d = _edited(llama_exl3, tmp_path / "m", num_hidden_layers=3)
    with pytest.raises(MissingTensorError, match="model.layers.2"):
        load_model(d)


def test_embedding_shape_mismatch(llama_exl3, tmp_path):
    d = _edited(llama_exl3, tmp_path / "m", vocab_size=310)
    with pytest.raises(TensorShapeError, match="embed_tokens"):
        load_model(d)


def test_exl3_linear_shape_mismatch(llama_exl3, tmp_path):
    d = _edited(llama_exl3, tmp_path / "m", intermediate_size=512)
    with pytest.raises(TensorShapeError, match=r"gate_proj.*|384.*512"):
        load_model(d)


def test_missing_exl3_lm_head_is_not_retied(tmp_path):
    exl3, _ = write_models("llama", tmp_path, np.random.default_rng(1), drop=("lm_head",))
    with pytest.raises(MissingTensorError, match="never re-tied"):
        load_model(exl3)


def test_missing_expert(tmp_path):
    exl3, _ = write_models("mixtral", tmp_path, np.random.default_rng(2),
                           drop=("model.layers.0.block_sparse_moe.experts.3.w2",))
    with pytest.raises(MissingTensorError, match="experts.3.w2"):
        load_model(exl3)


def test_mixed_expert_K_loads_as_tiers(tmp_path):
    """An expert with another K makes a second tier (ordered by K) instead of a load error."""
    exl3, _ = write_models("qwen3_moe", tmp_path, np.random.default_rng(3),
                           expert_K={"model.layers.1.mlp.experts.2.up_proj": 3})
    experts = load_model(exl3).layers[1].mlp.experts
    assert isinstance(experts, TieredExl3Experts)
    assert np.asarray(experts.expert_tier).tolist() == [1, 1, 0, 1]
    assert np.asarray(experts.expert_slot).tolist() == [0, 1, 0, 2]


def test_not_a_model_directory(tmp_path):
    with pytest.raises(Exl3FormatError, match="config.json"):
        load_model(tmp_path)


def test_config_parsing_variants():
    """rope_parameters (transformers 5), eos lists, GLM defaults, Qwen3-MoE sparse layout."""
    from exl3_jax.models import ModelConfig
    from helpers_models import CONFIGS
    cfg = dict(CONFIGS["llama"], eos_token_id=[2, 7], rope_scaling=None,
               rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=32.0,
                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192))
    c = ModelConfig.from_hf(cfg)
    assert c.eos_token_ids == (2, 7)
    assert (c.rope.rope_type, c.rope.theta, c.rope.factor) == ("llama3", 5e5, 32.0)
    g = ModelConfig.from_hf({k: v for k, v in CONFIGS["glm4_moe"].items()
                             if k != "partial_rotary_factor"})
    assert g.rope.rotary_dim == 32 and g.moe.shared_intermediate_size == 96
    assert g.moe.moe_layers == (False, True) and g.moe.router_kind == "sigmoid"
    q = ModelConfig.from_hf(dict(CONFIGS["qwen3_moe"], num_hidden_layers=4, decoder_sparse_step=2,
                                 mlp_only_layers=[3]))
    assert q.moe.moe_layers == (False, True, False, False)
    with pytest.raises(ConfigFieldError, match="num_key_value_heads"):
        ModelConfig.from_hf(dict(CONFIGS["qwen3"], num_key_value_heads=3))
    with pytest.raises(NotImplementedError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf(dict(CONFIGS["qwen3"], rope_scaling={"rope_type": "yarn",
                                                                 "factor": 4.0}))
