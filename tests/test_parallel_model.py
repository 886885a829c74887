"""Tensor-parallel forward of a whole model (``Generator(model, mesh=...).logits``, i.e.
``exl3_jax.parallel.shard_model``) on simulated devices.

Synthetic EXL3 checkpoints (tests/helpers_models.py) sized so every split is 128-aligned: a dense
llama-like model (hidden 1024, 8 query / 2 KV heads of 128, 2 layers; TP=4 replicates each KV
head on two ranks) and a qwen3_moe-like model (hidden 512, 8 experts of intermediate 256, top-2,
one MoE layer), plus a GLM-4-MoE-like model at tp=2. fp32 logits at every TP must match the
plain single-device forward ``model(tokens, cache)`` within relative L2 1e-5.
(tests/test_parallel_generate.py runs cached generation on the same models.)

Simulated devices: the same mechanism as tests/test_parallel.py. The device count can only be
set before jax initialises, so with fewer devices every test here delegates to ONE child pytest
process (XLA_FLAGS=--xla_force_host_platform_device_count=8, JAX_PLATFORMS=cpu) and reports the
child's verdict for itself. Models are written and references computed only where the tests
really run (in the child), once per model.
"""

from __future__ import annotations

import secrets

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from exl3_jax import parallel as par
from exl3_jax.generate import Generator
from helpers_devices import ChildDevices
from helpers_models import parallel_model

DEVICES = 8
CHILD_ENV = "EXL3_JAX_PARALLEL_MODEL_CHILD"
REL_L2 = 1e-5          # fp32 sharded vs unsharded (issue 7)
BATCH, SEQ = 2, 8

# -------------------------------------------------------------------------------------------
# delegation to a child process with simulated devices (as in tests/test_parallel.py)

_child = ChildDevices(__file__, CHILD_ENV, DEVICES)
delegated = _child.delegated


# -------------------------------------------------------------------------------------------
# synthetic models and their single-device references (built lazily, once, in the child)

CASES = {     # name -> (architecture, config overrides)
    "llama": parallel_model("llama", hidden_size=1024, num_attention_heads=8,
                            num_hidden_layers=2),
    "qwen3_moe": parallel_model("qwen3_moe", experts=8, expert_intermediate=256),
    # sigmoid router with score bias, shared experts, attention bias, q/k norm, partial
    # rotary, a dense first layer
    "glm4_moe": parallel_model("glm4_moe", experts=8, expert_intermediate=256,
                               num_hidden_layers=2),
    # one layer, 2 query heads / 1 KV head of 128 (replicated at tp=2): the fast smoke model
    "llama_tiny": parallel_model("llama", hidden_size=256, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=256, vocab_size=256),
    # one MoE layer, 4 experts of intermediate 128, top-2
    "qwen3_moe_tiny": parallel_model("qwen3_moe", experts=4, expert_intermediate=128,
                                     hidden_size=256, num_attention_heads=2,
                                     intermediate_size=256, vocab_size=256),
}
_MODELS: dict[str, object] = {}
_CASES: dict[str, tuple] = {}


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def synthetic_model(name: str, tmp_path_factory):
    """The fp32 EXL3 model of ``CASES[name]``, written and loaded once per process."""
    if name not in _MODELS:
        from helpers_models import write_models
        from models.decoder import load_model
        arch, overrides = CASES[name]
        seed = secrets.randbits(32)
        print(f"synthetic {name} model seed: {seed}")
        exl3_dir, _ = write_models(arch, tmp_path_factory.mktemp(f"tp_{name}"),
                                   np.random.default_rng(seed), config_overrides=overrides)
        _MODELS[name] = load_model(exl3_dir, dtype="float32")
    return _MODELS[name]


def model_case(arch: str, tmp_path_factory):
    """(model, tokens, single-device fp32 logits [B, T, vocab]) of a synthetic ``arch`` model."""
    if arch not in _CASES:
        model = synthetic_model(arch, tmp_path_factory)
        rng = np.random.default_rng(secrets.randbits(32))
        vocab = model.config.vocab_size
        tokens = jnp.asarray(rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32))
        ref = nnx.jit(lambda m, t: m(t, m.init_cache(BATCH, SEQ))[0])(model, tokens)
        assert ref.shape == (BATCH, SEQ, vocab) and ref.dtype == jnp.float32
        _CASES[arch] = (model, tokens, np.asarray(ref))
    return _CASES[arch]


# -------------------------------------------------------------------------------------------
# dense model: attention by heads (KV replication at tp=4), MLP column/row, lm_head column

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_model_tp_logits_match_single_device(request, tmp_path_factory, tp):
    if delegated(request):
        return
    model, tokens, ref = model_case("llama", tmp_path_factory)
    gen = Generator(model, mesh=par.make_mesh(tp))
    # k/v laid out as tp blocks of 128 columns: KV heads (2 x 128) replicated when tp = 4
    k = gen.state["layers"][0]["self_attn"]["k_proj"]["weight"]["trellis"]
    assert k.shape[-2] * 16 == max(256, tp * 128)
    assert k.sharding.shard_shape(k.shape)[-2] == (256 // min(tp, 2)) // 16
    got = gen.logits(tokens)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    err = rel_l2(got, ref)
    print(f"dense tp={tp}: rel L2 {err:.3g}")
    assert err <= REL_L2


# -------------------------------------------------------------------------------------------
# MoE model: experts expert-parallel or tensor-split, router replicated

_MOE_TP1: dict[str, np.ndarray] = {}


def moe_tp1(model, tokens):
    if "logits" not in _MOE_TP1:
        _MOE_TP1["logits"] = np.asarray(Generator(model, mesh=par.make_mesh(1)).logits(tokens))
    return _MOE_TP1["logits"]


@pytest.mark.parametrize("tp, mode", [(2, "experts"), (4, "experts"), (2, "tensor")])
def test_moe_model_tp_logits_match_tp1(request, tmp_path_factory, tp, mode):
    if delegated(request):
        return
    model, tokens, ref = model_case("qwen3_moe", tmp_path_factory)
    tp1 = moe_tp1(model, tokens)
    err1 = rel_l2(tp1, ref)
    assert err1 <= REL_L2
    gen = Generator(model, mesh=par.make_mesh(tp), moe_mode=mode)
    down = gen.state["layers"][0]["mlp"]["experts"]["down"]["trellis"]   # [E, I/16, H/16, W]
    shard = down.sharding.shard_shape(down.shape)
    if mode == "experts":
        assert shard[0] == 8 // tp                          # whole experts per rank
    else:
        assert shard[:2] == (8, 256 // tp // 16)            # every expert, I / tp rows
    got = gen.logits(tokens)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    err, err_ref = rel_l2(got, tp1), rel_l2(got, ref)
    print(f"moe {mode} tp={tp}: rel L2 vs tp=1 {err:.3g}, vs single device {err_ref:.3g} "
          f"(tp=1 vs single device {err1:.3g})")
    assert err <= REL_L2 and err_ref <= REL_L2


def test_moe_tensor_split_below_128_is_rejected(request, tmp_path_factory):
    if delegated(request):
        return
    model, tokens, _ = model_case("qwen3_moe", tmp_path_factory)
    with pytest.raises(par.ShardingError,
                       match=r"model\.layers\.0\.mlp\.experts\.gate_(up_)?proj.*below 128"):
        Generator(model, mesh=par.make_mesh(4), moe_mode="tensor")
    with pytest.raises(ValueError, match="unknown MoE parallel mode"):
        par.shard_model(model, par.make_mesh(2), moe_mode="rows")


@pytest.mark.parametrize("mode", ["experts", "tensor"])
def test_glm4_moe_model_tp2_matches_single_device(request, tmp_path_factory, mode):
    """Shared experts (256 wide) split like an MLP; at tp=4 they cannot (64 per rank)."""
    if delegated(request):
        return
    model, tokens, ref = model_case("glm4_moe", tmp_path_factory)
    got = Generator(model, mesh=par.make_mesh(2), moe_mode=mode).logits(tokens)
    err = rel_l2(got, ref)
    print(f"glm4_moe {mode} tp=2: rel L2 {err:.3g}")
    assert err <= REL_L2
    if mode == "experts":
        with pytest.raises(par.ShardingError,
                           match=r"model\.layers\.1\.mlp\.shared_experts\.gate_proj.*below 128"):
            par.shard_model(model, par.make_mesh(4), moe_mode=mode)
