"""Mixed-K MoE layers: experts of one layer at different K (and codebooks) load as (K, codebook)
tiers and run through ``ops.moe_tiered``, checked against the same checkpoint's experts
dequantized one by one (reference decode) and combined in NumPy; single-K layers keep the
one-stack ``Exl3Experts``; unrouted experts contribute exactly zero."""

from __future__ import annotations

import dataclasses
import importlib
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.format import Exl3Checkpoint
from exl3_jax.generate import Generator
from exl3_jax.models import load_model
from exl3_jax.nn import Exl3Experts, MoEBlock, PlainExperts
from exl3_jax.nn.moe import TieredExl3Experts, routed_experts
from exl3_jax.trellis import Exl3Weight, dequantize
from helpers_models import CONFIGS, random_linear, write_models

moe_ops = importlib.import_module("exl3_jax.ops.moe")   # the package re-exports the function moe

jax.config.update("jax_default_matmul_precision", "highest")

E, TOP_K = 6, 2
LAYER = 1                                     # qwen3_moe test config: layer 0 dense, layer 1 MoE
PREFIX = f"model.layers.{LAYER}.mlp"
K3_EXPERTS = (1, 3, 4)                        # gate, up, down at K3; the others K4 ...
K5_DOWN_EXPERT = 5                            # ... except expert 5's down at K5: a third tier
# tiers by K (gate, up, down) ascending: (3, 3, 3) [1, 3, 4], (4, 4, 4) [0, 2], (4, 4, 5) [5]
WANT_TIER = [1, 0, 1, 0, 0, 2]
WANT_SLOT = [0, 0, 1, 1, 2, 0]

_dequant = jax.jit(dequantize, static_argnums=3)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def expert_key(e: int, proj: str) -> str:
    return f"{PREFIX}.experts.{e}.{proj}"


@pytest.fixture(scope="module")
def mixed_dirs(tmp_path_factory):
    """A tiny Qwen3-MoE EXL3 checkpoint (6 experts, top-2) with K3, K4 and K5 experts, and its
    dequantized fp32 HF twin."""
    seed = secrets.randbits(32)
    print(f"mixed-K model seed: {seed}")
    expert_K = {expert_key(e, p): 3 for e in K3_EXPERTS
                for p in ("gate_proj", "up_proj", "down_proj")}
    expert_K[expert_key(K5_DOWN_EXPERT, "down_proj")] = 5
    return write_models("qwen3_moe", tmp_path_factory.mktemp("mixed_k"),
                        np.random.default_rng(seed), expert_K=expert_K,
                        config_overrides=dict(num_experts=E, num_experts_per_tok=TOP_K))


@pytest.fixture(scope="module")
def mixed_model(mixed_dirs):
    return load_model(mixed_dirs[0], dtype="float32")


def dequantized_experts(exl3_dir):
    """float64 (gate [E, H, I], up [E, H, I], down [E, I, H]) at the logical sizes: every expert
    read from the checkpoint and dequantized on its own with the reference decode."""
    H, I = CONFIGS["qwen3_moe"]["hidden_size"], CONFIGS["qwen3_moe"]["moe_intermediate_size"]
    ckpt = Exl3Checkpoint(exl3_dir)
    out = []
    for proj, (in_f, out_f) in (("gate_proj", (H, I)), ("up_proj", (H, I)),
                                ("down_proj", (I, H))):
        mats = []
        for e in range(E):
            key = expert_key(e, proj)
            a = ckpt.read_linear(key)
            W = _dequant(a["trellis"], a["suh"], a["svh"], ckpt.linears[key].codebook)
            mats.append(np.asarray(W, np.float64)[:in_f, :out_f])
        out.append(np.stack(mats))
    return tuple(out)


def np_experts(x, ids, w, Wg, Wu, Wd):
    """sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[t, j], float64 loop (ids < 0
    route nowhere). x [T, H]; Wg, Wu [E, H, I]; Wd [E, I, H]. Returns [T, H]."""
    out = np.zeros((x.shape[0], Wd.shape[-1]))
    for t in range(x.shape[0]):
        for e, we in zip(ids[t], w[t]):
            if e < 0:
                continue
            g, u = x[t] @ Wg[e], x[t] @ Wu[e]
            silu = g * 0.5 * (1 + np.tanh(g / 2))          # no exp overflow for |g| >> 1
            out[t] += we * ((silu * u) @ Wd[e])
    return out


def np_route_softmax(logits, k):
    """Softmax top-k, renormalised (Qwen3-MoE with norm_topk_prob), float64."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return ids, w / w.sum(-1, keepdims=True)


# -- loading ----------------------------------------------------------------------------------

def test_mixed_k_loads_as_native_tiers(mixed_dirs, mixed_model):
    """Experts grouped by K into three tiers (K ascending, experts in id order), maps right,
    every expert's tensors the checkpoint's own words (stacked, not re-encoded)."""
    experts = mixed_model.layers[LAYER].mlp.experts
    assert isinstance(experts, TieredExl3Experts) and experts.num_experts == E
    assert np.asarray(experts.expert_tier).tolist() == WANT_TIER
    assert np.asarray(experts.expert_slot).tolist() == WANT_SLOT
    assert [(t.gate.K, t.up.K, t.down.K) for t in experts.tiers] == [(3, 3, 3), (4, 4, 4),
                                                                       (4, 4, 5)]
    ckpt = Exl3Checkpoint(mixed_dirs[0])
    for e in range(E):
        tier = experts.tiers[WANT_TIER[e]]
        for proj, w in (("gate_proj", tier.gate), ("up_proj", tier.up), ("down_proj", tier.down)):
            a = ckpt.read_linear(expert_key(e, proj))
            s = WANT_SLOT[e]
            for field in ("trellis", "suh", "svh"):
                np.testing.assert_array_equal(np.asarray(getattr(w, field)[s]), a[field],
                                              err_msg=f"expert {e} {proj}.{field}")


def test_single_k_layer_stays_one_stack(tmp_path, rng):
    """A uniform-K checkpoint loads to today's one-tier Exl3Experts ([E] stacks)."""
    exl3, _ = write_models("qwen3_moe", tmp_path, rng)
    experts = load_model(exl3, dtype="float32").layers[LAYER].mlp.experts
    assert type(experts) is Exl3Experts
    assert experts.gate.stack_shape == experts.down.stack_shape == (4,)
    assert (experts.gate.K, experts.up.K, experts.down.K) == (4, 4, 4)


def test_mixed_k_under_a_mesh_is_a_clear_error(mixed_model):
    from exl3_jax.parallel import make_mesh, shard_model
    with pytest.raises(NotImplementedError, match=rf"model\.layers\.{LAYER}\.mlp: mixed-K"):
        shard_model(mixed_model, make_mesh(1))


# -- numerics ---------------------------------------------------------------------------------

def test_mixed_k_logits_match_dequantized_twin(mixed_dirs, mixed_model, rng):
    """Whole-model logits of the tiered EXL3 model vs the HF twin whose experts are the
    checkpoint's experts dequantized one by one (plain fp32 top-k experts)."""
    exl3_dir, hf_dir = mixed_dirs
    tokens = rng.integers(0, 300, size=(2, 12))
    ref = np.asarray(Generator(load_model(hf_dir, dtype="float32")).logits(tokens))
    got = np.asarray(Generator(mixed_model).logits(tokens))
    assert np.all(np.isfinite(ref))
    assert rel_l2(got, ref) < 1e-5


def test_mixed_k_moe_block_matches_numpy(mixed_dirs, mixed_model, rng):
    """The tiered MoE block (router + experts) vs NumPy: router from the checkpoint, softmax
    top-2, every expert dequantized on its own, float64 combine. Also bf16 activations (the
    fp16-operand scaling, one row beyond the fp16 range) with the routing given."""
    block = mixed_model.layers[LAYER].mlp
    assert isinstance(block, MoEBlock)
    Wg, Wu, Wd = dequantized_experts(mixed_dirs[0])
    G = Exl3Checkpoint(mixed_dirs[0]).store.read(f"{PREFIX}.gate.weight").astype(np.float64)
    H = G.shape[1]
    # 64 rows: with 16, some seeds left one of the 6 experts unrouted (CI seed 3697462891)
    x = rng.standard_normal((64, H)).astype(np.float32)
    ids, w = np_route_softmax(x.astype(np.float64) @ G.T, TOP_K)
    assert len(np.unique(ids)) == E, "every tier should be hit"
    want = np_experts(x.astype(np.float64), ids, w, Wg, Wu, Wd)
    got = jax.jit(lambda x: block(x))(jnp.asarray(x))
    assert rel_l2(got, want) < 1e-5

    xb = jnp.asarray(x, jnp.bfloat16).at[3].multiply(2.0 ** 20)      # row 3 beyond fp16 range
    x64 = np.asarray(xb, np.float64)
    ids_j, w_j = jnp.asarray(ids, jnp.int32), jnp.asarray(w, jnp.float32)
    got_b = np.asarray(jax.jit(lambda x: block.experts(x, ids_j, w_j))(xb))
    want_b = np_experts(x64, ids, np.asarray(w_j, np.float64), Wg, Wu, Wd)
    assert np.all(np.isfinite(got_b))
    per_row = np.linalg.norm(got_b - want_b, axis=1) / np.linalg.norm(want_b, axis=1)
    assert per_row.max() < 1e-4, per_row


def test_mixed_k_dequantized_cache_matches(mixed_dirs, mixed_model, rng):
    """cache_dequantized decodes every tier; the cached model gives the same logits."""
    tokens = rng.integers(0, 300, size=(2, 12))
    want = np.asarray(Generator(mixed_model).logits(tokens))
    cached = load_model(mixed_dirs[0], dtype="float32", cache_dequantized=True)
    assert all(t.dense is not None for t in cached.layers[LAYER].mlp.experts.tiers)
    assert rel_l2(Generator(cached).logits(tokens), want) < 1e-5


def make_expert(rng, in_f, out_f, K, codebook):
    t, suh, svh, _ = random_linear(rng, in_f, out_f, K, False)
    w = Exl3Weight.create(jnp.asarray(t), jnp.asarray(suh), jnp.asarray(svh), codebook,
                          in_features=in_f, out_features=out_f)
    return w, np.asarray(_dequant(t, suh, svh, codebook), np.float64)[:in_f, :out_f]


ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend", ["reference", "packed",
                                     pytest.param("gpu", marks=[pytest.mark.gpu, ON_GPU])])
def test_tiered_w13_slabs_match_numpy(rng, monkeypatch, backend):
    """Tiers whose gate and up share K and codebook run as w13 slabs through ops.moe (backend
    from EXL3_JAX_MOE_BACKEND; "gpu": the grouped kernels, fp16 operands); ids of -1 and >= E
    route nowhere."""
    monkeypatch.setenv(moe_ops.MOE_BACKEND_ENV, backend)
    H, I, n = 160, 96, 5
    K = [4, 3, 4, 3, 3]
    ws = {p: [make_expert(rng, *dims, K[e], "mcg") for e in range(n)]
          for p, dims in (("g", (H, I)), ("u", (H, I)), ("d", (I, H)))}
    experts = routed_experts(*([w for w, _ in ws[p]] for p in "gud"))
    assert isinstance(experts, TieredExl3Experts)
    assert all(t.w13 is not None for t in experts.tiers)      # one slab per tier
    assert np.asarray(experts.expert_tier).tolist() == [1, 0, 1, 0, 0]
    assert np.asarray(experts.expert_slot).tolist() == [0, 0, 1, 1, 2]
    T = 7
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, n, size=(T, 2))
    ids[1, 0], ids[4, 1] = -1, n                   # no expert
    w = rng.uniform(0.1, 1.0, size=(T, 2)).astype(np.float32)
    got = jax.jit(lambda x, i, w: experts(x, i, w))(jnp.asarray(x), jnp.asarray(ids, jnp.int32),
                                                   jnp.asarray(w))
    W = [np.stack([M for _, M in ws[p]]) for p in "gud"]
    want = np_experts(x.astype(np.float64), np.where(ids < n, ids, -1), w, *W)
    assert rel_l2(got, want) < (5e-3 if backend == "gpu" else 1e-5)


def test_uniform_projection_gathered_into_tiers(rng):
    """gate/up given as one [E] stack (uniform K4), down mixed K3/K4: tiers follow down, the
    stacked projections are gathered per tier; output vs NumPy."""
    H, I, n, T = 128, 96, 4, 6
    Kd = [3, 4, 3, 4]
    g = [make_expert(rng, H, I, 4, "mul1") for _ in range(n)]
    u = [make_expert(rng, H, I, 4, "mul1") for _ in range(n)]
    d = [make_expert(rng, I, H, Kd[e], "3inst") for e in range(n)]
    experts = routed_experts(moe_ops.stack_experts([w for w, _ in g]),
                             moe_ops.stack_experts([w for w, _ in u]), [w for w, _ in d])
    assert isinstance(experts, TieredExl3Experts)
    assert np.asarray(experts.expert_tier).tolist() == [0, 1, 0, 1]
    assert [t.down.K for t in experts.tiers] == [3, 4]
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(n)[:2] for _ in range(T)])
    w = rng.uniform(0.1, 1.0, size=(T, 2)).astype(np.float32)
    got = experts(jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(w))
    W = [np.stack([M for _, M in ws]) for ws in (g, u, d)]
    assert rel_l2(got, np_experts(x.astype(np.float64), ids, w, *W)) < 1e-5


# -- unrouted experts contribute exactly zero ---------------------------------------------------

def test_unrouted_inf_expert_contributes_zero(rng):
    """An expert whose output is inf on every token adds nothing to the tokens that do not
    route to it (no 0 * inf = NaN in the combine), in the EXL3 all-experts reference (with and
    without a dequantized cache) and in PlainExperts; tokens routed to it stay non-finite."""
    H, I, n, T = 128, 128, 3, 5
    ws = {p: [make_expert(rng, *dims, 3, "mul1") for _ in range(n)]
          for p, dims in (("g", (H, I)), ("u", (H, I)), ("d", (I, H)))}
    gate, up, down = (moe_ops.stack_experts([w for w, _ in ws[p]]) for p in "gud")
    down = dataclasses.replace(down, svh=down.svh.at[1].set(jnp.inf))   # expert 1: inf
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray([[0, 2], [2, 0], [0, -1], [1, 0], [2, 2]], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, 2)), jnp.float32)
    W = [np.stack([M for _, M in ws[p]]) for p in "gud"]
    want = np_experts(np.asarray(x, np.float64), np.asarray(ids), np.asarray(w), *W)
    clean = np.array([True, True, True, False, True])         # token 3 routes to expert 1
    dense = tuple(jnp.asarray(M, jnp.float32) for M in W[:2]) + (
        jnp.asarray(W[2], jnp.float32).at[1].set(jnp.inf),)
    plain = PlainExperts(*(jnp.asarray(M, jnp.float32) for M in W[:2]),
                         jnp.asarray(W[2], jnp.float32).at[1].set(jnp.inf))
    outs = {"exl3": moe_ops.moe_experts(x, ids, w, gate, up, down, backend="reference"),
            "dense": moe_ops.moe_experts(x, ids, w, gate, up, down, dense=dense),
            "plain": plain(x, ids, w)}
    for name, y in outs.items():
        y = np.asarray(y)
        assert np.all(np.isfinite(y[clean])), name
        assert rel_l2(y[clean], want[clean]) < 1e-5, name
        assert not np.all(np.isfinite(y[3])), name
