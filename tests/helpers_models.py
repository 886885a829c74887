"""Synthetic test models: random-trellis EXL3 checkpoints and their dequantized HF twins.

``write_models(arch, root, rng)`` writes ``root/exl3`` (EXL3, via Exl3Writer) and ``root/hf``
(unquantized fp32 safetensors in HF layout whose linears are the dequantized EXL3 weights, W.T),
so the HF model is an independent fp32 reference for the EXL3 forward. Shapes exercise padding
(hidden 192 -> k 256, vocab 300 -> n 384, ...). Random int16 trellis is always a valid encoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from exl3_jax.format import Exl3Writer
from exl3_jax.trellis import dequantize

CODEBOOKS = ("mcg", "mul1", "3inst")

_BASE = dict(vocab_size=300, hidden_size=192, num_hidden_layers=2, rms_norm_eps=1e-5,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)

CONFIGS = {
    "llama": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                  num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                  intermediate_size=320, tie_word_embeddings=True, rope_theta=100000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64)),
    # qwen3 and mixtral use one layer to keep compile time down (qwen3 = llama + q/k norm;
    # multi-layer caches are covered by the other three)
    "qwen3": dict(_BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=320, tie_word_embeddings=False),
    "qwen3_moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                      intermediate_size=320, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[0]),
    "mixtral": dict(_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                    intermediate_size=160, num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(_BASE, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                     intermediate_size=320, first_k_dense_replace=1, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1),
}
ARCHS = tuple(CONFIGS)
# One token shape for every full-sequence forward in the tests, so jit compiles are shared.
RECOMPUTE_SHAPE = (3, 32)

# Parallel-test models: heads of 128 and widths that are multiples of 128 per rank, so tensor
# and expert parallel splits land on Hadamard blocks.
_PARALLEL_BASE = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, intermediate_size=512, vocab_size=512, num_hidden_layers=1)
_PARALLEL_EXPERTS = {     # architecture -> its config keys for (experts, expert intermediate)
    "qwen3_moe": lambda E, I: dict(num_experts=E, num_experts_per_tok=2,
                                   moe_intermediate_size=I, mlp_only_layers=[]),
    "glm4_moe": lambda E, I: dict(first_k_dense_replace=1, n_routed_experts=E,
                                  num_experts_per_tok=2, moe_intermediate_size=I),
}


def parallel_model(arch: str, *, experts: int = 0, expert_intermediate: int = 0,
                   **overrides) -> tuple[str, dict]:
    """(arch, config overrides for ``write_models``) of a parallel-test model.

    Defaults: hidden 512, 4 query / 2 KV heads of 128, FFN 512, vocab 512, one layer. MoE
    architectures (qwen3_moe: every layer MoE; glm4_moe: the first layer dense) take
    ``experts`` experts of intermediate ``expert_intermediate``, top-2. ``overrides``: other
    HF config fields (e.g. hidden_size, num_hidden_layers)."""
    cfg = dict(_PARALLEL_BASE)
    if experts:
        if arch not in _PARALLEL_EXPERTS:
            raise ValueError(f"no expert fields for architecture {arch!r}; "
                             f"known: {sorted(_PARALLEL_EXPERTS)}")
        cfg.update(_PARALLEL_EXPERTS[arch](experts, expert_intermediate))
    cfg.update(overrides)
    return arch, cfg


def _pad(d: int) -> int:
    return -(-d // 128) * 128


def model_tensors(cfg: dict) -> tuple[list, list]:
    """(linears [(key, in, out, bias, stack_id)], plain [(name, shape, kind)]) of a config,
    written from the HF naming conventions (spec 5.1), independently of exl3_jax.models."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    arch = cfg["model_type"]
    bias = cfg.get("attention_bias", False)
    lin, plain = [], [("model.embed_tokens.weight", (V, H), "embed"),
                      ("model.norm.weight", (H,), "norm")]
    lin.append(("lm_head", H, V, False, None))
    for i in range(L):
        p = f"model.layers.{i}"
        plain += [(f"{p}.input_layernorm.weight", (H,), "norm"),
                  (f"{p}.post_attention_layernorm.weight", (H,), "norm")]
        lin += [(f"{p}.self_attn.q_proj", H, nh * D, bias, None),
                (f"{p}.self_attn.k_proj", H, nkv * D, bias, None),
                (f"{p}.self_attn.v_proj", H, nkv * D, bias, None),
                (f"{p}.self_attn.o_proj", nh * D, H, False, None)]
        if arch in ("qwen3", "qwen3_moe") or cfg.get("use_qk_norm"):
            plain += [(f"{p}.self_attn.q_norm.weight", (D,), "norm"),
                      (f"{p}.self_attn.k_norm.weight", (D,), "norm")]
        moe = ((arch == "qwen3_moe" and i not in cfg["mlp_only_layers"]) or arch == "mixtral"
               or (arch == "glm4_moe" and i >= cfg["first_k_dense_replace"]))
        if not moe:
            I = cfg["intermediate_size"]
            lin += [(f"{p}.mlp.gate_proj", H, I, False, None),
                    (f"{p}.mlp.up_proj", H, I, False, None),
                    (f"{p}.mlp.down_proj", I, H, False, None)]
            continue
        if arch == "mixtral":
            E, I, pre, names = cfg["num_local_experts"], cfg["intermediate_size"], \
                f"{p}.block_sparse_moe", ("w1", "w3", "w2")
        else:
            E = cfg.get("num_experts") or cfg["n_routed_experts"]
            I, pre, names = cfg["moe_intermediate_size"], f"{p}.mlp", \
                ("gate_proj", "up_proj", "down_proj")
        plain.append((f"{pre}.gate.weight", (E, H), "router"))
        for e in range(E):
            lin += [(f"{pre}.experts.{e}.{names[0]}", H, I, False, f"{pre}.g"),
                    (f"{pre}.experts.{e}.{names[1]}", H, I, False, f"{pre}.u"),
                    (f"{pre}.experts.{e}.{names[2]}", I, H, False, f"{pre}.d")]
        if arch == "glm4_moe":
            plain.append((f"{pre}.gate.e_score_correction_bias", (E,), "score_bias"))
            S = I * cfg["n_shared_experts"]
            lin += [(f"{pre}.shared_experts.gate_proj", H, S, False, None),
                    (f"{pre}.shared_experts.up_proj", H, S, False, None),
                    (f"{pre}.shared_experts.down_proj", S, H, False, None)]
    return lin, plain


def random_linear(rng, in_f: int, out_f: int, K: int, bias: bool):
    """Random EXL3 tensors: trellis int16 [k/16, n/16, 16K], suh ~ N(0,1)/sqrt(in),
    svh ~ N(0, 0.5^2) with svh = 0 on padded outputs, optional fp16 bias (0 on padding)."""
    k, n = _pad(in_f), _pad(out_f)
    trellis = rng.integers(-32768, 32768, size=(k // 16, n // 16, 16 * K), dtype=np.int16)
    suh = (rng.standard_normal(k) / np.sqrt(in_f)).astype(np.float16)
    svh = (0.5 * rng.standard_normal(n)).astype(np.float16)
    svh[out_f:] = 0
    b = None
    if bias:
        b = np.zeros(n, np.float16)
        b[:out_f] = 0.1 * rng.standard_normal(out_f)
    return trellis, suh, svh, b


def _plain(rng, shape, kind):
    if kind == "embed":
        return rng.standard_normal(shape).astype(np.float16)
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "router":
        return (2.0 * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float16)
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)


_dequant = jax.jit(dequantize, static_argnums=3)


def write_models(arch: str, root: Path, rng, *, K: int = 4, head_K: int = 6,
                 config_overrides: dict | None = None, drop: tuple[str, ...] = (),
                 expert_K: dict | None = None) -> tuple[Path, Path]:
    """Write root/exl3 and root/hf for ``arch``; returns (exl3_dir, hf_dir).

    ``drop``: linear keys / plain tensor names to leave out (for bad-directory tests);
    ``expert_K``: {linear key: K} overrides (e.g. one expert with a different K)."""
    cfg = dict(CONFIGS[arch], **(config_overrides or {}))
    root = Path(root)
    lin, plain = model_tensors(cfg)
    hf: dict[str, np.ndarray] = {}
    stack_cb: dict[str, str] = {}
    with Exl3Writer(root / "exl3", cfg) as w:
        for j, (key, in_f, out_f, bias, stack) in enumerate(lin):
            cb = stack_cb.setdefault(stack, CODEBOOKS[len(stack_cb) % 3]) if stack \
                else CODEBOOKS[j % 3]
            if key in drop:
                continue
            kk = head_K if key == "lm_head" else (expert_K or {}).get(key, K)
            trellis, suh, svh, b = random_linear(rng, in_f, out_f, kk, bias)
            w.add_linear(key, trellis, suh, svh, cb, bias=b)
            W = np.asarray(_dequant(trellis, suh, svh, cb))[:in_f, :out_f]
            hf[f"{key}.weight"] = np.ascontiguousarray(W.T)
            if b is not None:
                hf[f"{key}.bias"] = b[:out_f].astype(np.float32)
        for name, shape, kind in plain:
            if name in drop:
                continue
            arr = _plain(rng, shape, kind)
            w.add_tensor(name, arr)
            hf[name] = arr.astype(np.float32)
    hf_dir = root / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf, str(hf_dir / "model.safetensors"))
    with open(hf_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    return root / "exl3", hf_dir


_WRITTEN: dict[str, tuple[Path, Path]] = {}


def cached_models(arch: str, tmp_path_factory) -> tuple[Path, Path]:
    """write_models once per test session and architecture (seed printed for reproduction)."""
    if arch not in _WRITTEN:
        import secrets
        seed = secrets.randbits(32)
        print(f"synthetic {arch} model seed: {seed}")
        _WRITTEN[arch] = write_models(arch, tmp_path_factory.mktemp(arch),
                                      np.random.default_rng(seed))
    return _WRITTEN[arch]
