"""CPU tests of the grouped MoE path: route packing vs a NumPy loop oracle, the packed jnp
reference vs the all-experts reference (moe_experts), plans, mixed tiers, and the GPU glue
(ffi/trellis_moe.moe_gpu) with its kernel calls replaced by jnp emulations of their contracts.
The kernels themselves are compiled in tests/test_moe_kernels.py and validated on the H200 by
scripts/gpu_validate_moe.py."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.format.spec import width_from_rate
from exl3_jax.ops.moe_plans import moe_plan
from exl3_jax.ops.moe_routing import (BLOCK_M_CHOICES, combine_routes, max_blocks, pack_routes,
                                      pack_routes_numpy, pack_routes_per_route, select_block_m)
from exl3_jax.trellis import Exl3Weight, decode_trellis, hadamard128
from helpers_cute import needs_cutlass

moe_ops = importlib.import_module("exl3_jax.ops.moe")   # the package re-exports the function moe


def random_stack(rng, lead, k, n, K, codebook="mcg", bias=False, scale=1 / 64):
    """Random Exl3Weight with leading axes ``lead`` (random trellis bits, +-1 suh)."""
    t = rng.integers(-32768, 32768, size=(*lead, k // 16, n // 16, width_from_rate(K)),
                     dtype=np.int64).astype(np.int16)
    suh = rng.choice([-1.0, 1.0], size=(*lead, k)).astype(np.float16)
    svh = (rng.uniform(0.5, 1.5, size=(*lead, n)) * scale).astype(np.float16)
    b = jnp.asarray((rng.standard_normal((*lead, n)) * 0.1).astype(np.float16)) if bias else None
    return Exl3Weight(jnp.asarray(t), jnp.asarray(suh), jnp.asarray(svh), b, codebook, K, k, n)


def random_moe(rng, E, H, I, K=4, codebook="mcg"):
    return random_stack(rng, (2, E), H, I, K, codebook), random_stack(rng, (E,), I, H, K,
                                                                       codebook)


def random_routing(rng, T, top_k, E, invalid=0.0):
    ids = np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[rng.random(ids.shape) < invalid] = -1
    w = rng.uniform(0.1, 1.0, size=(T, top_k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w)


def rel_err(a, b):
    """||a - b|| / ||b||; when b is all zero (e.g. every route of a token invalid), 0 only if a is
    exactly zero too, else inf."""
    nb = float(jnp.linalg.norm(b))
    if nb == 0.0:
        return 0.0 if float(jnp.linalg.norm(a)) == 0.0 else float("inf")
    return float(jnp.linalg.norm(a - b)) / nb


# --- route packing ---------------------------------------------------------------------------


@pytest.mark.parametrize("T,top_k,E,bm", [(1, 8, 128, 8), (5, 2, 4, 8), (40, 4, 8, 16),
                                          (9, 3, 5, 48), (64, 8, 16, 64), (3, 2, 6, None),
                                          (300, 8, 32, 128)])
def test_pack_routes_matches_numpy(rng, T, top_k, E, bm):
    ids = rng.integers(-1, E, size=(T, top_k)).astype(np.int32)   # duplicates and -1 included
    ids[0, 0] = E + 3                                               # out of range: dropped
    pr = jax.jit(pack_routes, static_argnums=(1, 2))(jnp.asarray(ids), E, bm)
    ref = pack_routes_numpy(ids, E, pr.block_m)
    for name, want in ref.items():
        np.testing.assert_array_equal(np.asarray(getattr(pr, name)), want, err_msg=name)
    assert pr.blocks == max_blocks(T * top_k, E, pr.block_m)


def test_pack_routes_per_route_layout(rng):
    T, top_k, E = 3, 4, 64
    ids = rng.integers(-1, E, size=(T, top_k)).astype(np.int32)
    ids[1, 2] = E + 1                                              # out of range: no block
    pr = pack_routes_per_route(jnp.asarray(ids), E)
    bm = pr.block_m
    assert (pr.blocks, pr.rows, bm) == (T * top_k, T * top_k * 8, 8)
    want_tok = np.full(pr.rows, -1)
    want_be = np.full(pr.blocks, -1)
    want_rr = np.full((T, top_k), -1)
    for t in range(T):
        for j in range(top_k):
            r = t * top_k + j
            if 0 <= ids[t, j] < E:
                want_tok[r * bm], want_be[r], want_rr[t, j] = t, ids[t, j], r * bm
    np.testing.assert_array_equal(np.asarray(pr.row_token), want_tok)
    np.testing.assert_array_equal(np.asarray(pr.block_expert), want_be)
    np.testing.assert_array_equal(np.asarray(pr.row_expert), np.repeat(want_be, bm))
    np.testing.assert_array_equal(np.asarray(pr.route_row), want_rr)
    # the plan picks it for few routes over many experts, decode only
    assert moe_plan(1, 8, 128, 256, 128).packing == "per_route"
    assert moe_plan(8, 8, 128, 256, 128).packing == "sorted"
    assert moe_plan(40, 1, 256, 256, 128).packing == "sorted"       # prefill


def test_pack_routes_capacity_bound_is_tight(rng):
    # Worst case: every expert gets one route more than a multiple of block_m.
    E, bm = 4, 8
    ids = np.repeat(np.arange(E), bm + 1)[:, None].astype(np.int32)   # 36 routes, top_k 1
    pr = pack_routes(jnp.asarray(ids), E, bm)
    assert int(pr.num_blocks) == pr.blocks == 2 * E
    assert np.all(np.asarray(pr.block_expert) == np.repeat(np.arange(E), 2))


def test_select_block_m():
    assert select_block_m(8, 128) == 8
    assert select_block_m(128 * 8, 128) == 8
    assert select_block_m(128 * 9, 128) == 16
    assert select_block_m(4096 * 8, 128) == 64
    assert select_block_m(40 * 128, 128) == 48
    assert set(BLOCK_M_CHOICES) == {8, 16, 32, 48, 64}
    with pytest.raises(ValueError, match="block_m"):
        pack_routes(jnp.zeros((2, 2), jnp.int32), 4, 12)


def test_combine_routes_zero_for_invalid(rng):
    y = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32).at[3].set(jnp.nan)
    rr = jnp.asarray([[0, -1], [5, 2]], jnp.int32)
    w = jnp.asarray([[0.5, 7.0], [1.0, 2.0]], jnp.float32)
    out = np.asarray(combine_routes(y, rr, w))
    np.testing.assert_allclose(out[0], 0.5 * np.asarray(y[0]), rtol=1e-6)
    np.testing.assert_allclose(out[1], np.asarray(y[5] + 2 * y[2]), rtol=1e-6)


# --- plans --------------------------------------------------------------------------------------


def test_decode_plan_accumulation_order_independent_of_tokens():
    for H, I, E in ((2048, 768, 128), (4096, 1408, 128), (6144, 512, 256), (256, 128, 4)):
        ref = moe_plan(1, 8 if E > 8 else 2, E, H, I)
        for T in (2, 4, 8, 16, 32):
            p = moe_plan(T, ref.top_k, E, H, I)
            assert p.kind == "decode" and (p.fc1, p.fc2) == (ref.fc1, ref.fc2)
        big = moe_plan(4096, ref.top_k, E, H, I)
        assert big.kind == "prefill" and big.fc1.splits == 1 and big.block_m <= 64
        for p in (ref, big):
            for gp, k in ((p.fc1, H), (p.fc2, I)):
                assert (k // 16 // gp.splits) % (gp.warps * gp.unroll) == 0


def test_decode_plan_cta_shapes():
    """Decode plans split K only while the m = 1 grid has fewer CTAs than SMs, and give each
    warp at least 8 k16 tiles with as many warps (<= 8) as allow that (both measured on the
    H200 in session 14: bench/NOTES.md)."""
    sms = 132
    for H, I, E, top_k in ((2048, 768, 128, 8), (4096, 1408, 128, 8), (6144, 512, 256, 8),
                           (2048, 256, 64, 2), (256, 128, 4, 2)):
        p = moe_plan(1, top_k, E, H, I, sms=sms)
        for gp, k, n, planes in ((p.fc1, H, I, 2), (p.fc2, I, H, 1)):
            k16 = k // 16
            ctas = n // 16 // gp.n_tiles * planes * top_k
            assert gp.splits == 1 or ctas * gp.splits // 2 < sms, (H, I, gp)
            assert k16 // gp.warps >= 8 and k16 % gp.warps == 0, (H, I, gp)
            wider = 2 * gp.warps
            assert wider > 8 or k16 % wider or k16 // wider < 8, (H, I, gp)
    glm = moe_plan(1, 8, 256, 6144, 512, sms=sms)          # the GLM-5.2 TP4 shard of the bench
    assert (glm.fc1.splits, glm.fc2.warps) == (1, 4)
    assert moe_plan(1, 2, 64, 2048, 256, sms=sms).fc1.splits > 1     # 32 CTAs: split


@needs_cutlass
def test_gemm_override(monkeypatch):
    from exl3_jax.ffi import trellis_moe as tm
    from exl3_jax.ops.moe_plans import MoeGemmPlan
    plan = moe_plan(1, 8, 128, 2048, 768)
    assert tm.with_gemm_override(plan, "") == plan
    got = tm.with_gemm_override(plan, "fc2=4,8,1,2")
    assert got.fc2 == MoeGemmPlan(4, 8, 1, 2) and got.fc1 == plan.fc1
    got = tm.with_gemm_override(plan, " fc1=1,4,2,4 ; fc2=2,4,1,4 ")
    assert (got.fc1, got.fc2) == (MoeGemmPlan(1, 4, 2, 4), MoeGemmPlan(2, 4, 1, 4))
    for bad in ("fc3=1,2,3,4", "fc1=1,2,3", "fc1=0,8,1,4", "fc2=a,b,c,d", "fc1"):
        with pytest.raises(ValueError, match=tm.GEMM_ENV):
            tm.with_gemm_override(plan, bad)
    monkeypatch.setenv(tm.GEMM_ENV, "fc1=2,8,1,8")
    forced = tm.plan_for(1, 8, 128, 2048, 768)
    assert forced.fc1 == MoeGemmPlan(2, 8, 1, 8) and forced.fc2 == plan.fc2
    # A shape the kernel cannot tile is refused when the layer is built, naming the reason.
    w13 = Exl3Weight(jnp.zeros((2, 4, 128, 48, 64), jnp.int16), jnp.ones((2, 4, 2048)),
                     jnp.ones((2, 4, 768)), None, "mcg", 4, 2048, 768)
    bad_plan = tm.with_gemm_override(plan, "fc1=2,8,1,32")
    with pytest.raises(ValueError, match="warps\\*unroll"):
        tm.grouped_config(w13, bad_plan.fc1, bad_plan)


def test_wgmma_plan_selection():
    """On Hopper auto takes the wgmma plan for prefill blocks of >= 16 rows (more than 8 routes
    per expert), never for decode plans or elsewhere; its blocks are the smallest of 32 / 64 /
    128 rows (wgmma's N) that hold the average routes per expert; forcing it works at any
    size."""
    from exl3_jax.ops.moe_plans import WGMMA_MIN_BLOCK_M
    for H, I, E, top_k in ((2048, 768, 128, 8), (4096, 1408, 128, 8), (256, 128, 8, 2)):
        for T in (1, 8, 32, 33, 64, 256, 512, 640, 1024, 1025, 4096):
            ref = moe_plan(T, top_k, E, H, I)
            p = moe_plan(T, top_k, E, H, I, hopper=True)
            if ref.kind == "prefill" and ref.block_m >= WGMMA_MIN_BLOCK_M:
                avg = T * top_k / E
                assert p.kind == "wgmma", (T, p)
                assert p.block_m == next((b for b in (32, 64, 128) if b >= avg), 128), (T, p)
                assert p.blocks == max_blocks(T * top_k, E, p.block_m)
            else:
                assert p == ref
    # Qwen3-30B-A3B: 8 routes per expert stay on the mma.sync kernel, 8.06 and 12 take wgmma
    assert moe_plan(128, 8, 128, 2048, 768, hopper=True).kind == "prefill"
    assert moe_plan(129, 8, 128, 2048, 768, hopper=True).kind == "wgmma"
    assert moe_plan(192, 8, 128, 2048, 768, hopper=True).block_m == 32
    assert moe_plan(640, 8, 128, 2048, 768).block_m == 48          # 40 routes per expert
    assert moe_plan(640, 8, 128, 2048, 768, hopper=True).block_m == 64
    assert moe_plan(1025, 8, 128, 2048, 768, hopper=True).block_m == 128   # 64.06 per expert
    assert moe_plan(4096, 8, 128, 2048, 768, hopper=True).block_m == 128
    forced = moe_plan(40, 2, 8, 256, 128, kind="wgmma")             # 10 routes per expert
    assert (forced.kind, forced.block_m, forced.packing) == ("wgmma", 32, "sorted")
    assert moe_plan(40, 2, 8, 256, 128, kind="prefill", hopper=True).kind == "prefill"


@needs_cutlass
def test_wgmma_plan_configs():
    # Both GEMMs of a wgmma plan get the grouped wgmma kernel's config; tier slabs get one
    # launch config per tier (its codebook, K and slab size; bexp's global expert range).
    from exl3_jax.ffi import trellis_moe as tm
    plan = moe_plan(200, 2, 8, 256, 256, hopper=True)
    w13 = Exl3Weight(jnp.zeros((2, 8, 16, 16, 64), jnp.int16), jnp.ones((2, 8, 256)),
                     jnp.ones((2, 8, 256)), None, "mcg", 4, 256, 256)
    down = Exl3Weight(jnp.zeros((8, 16, 16, 64), jnp.int16), jnp.ones((8, 256)),
                      jnp.ones((8, 256)), None, "mcg", 4, 256, 256)
    c1, c2 = tm.grouped_config(w13, plan.fc1, plan), tm.grouped_config(down, plan.fc2, plan)
    assert isinstance(c1, tm.GroupedWgmmaConfig) and isinstance(c2, tm.GroupedWgmmaConfig)
    assert (c1.planes, c1.experts, c1.block_m, c1.rows) == (2, 8, 64, plan.rows)
    assert c1.grid == (2, 1, 2 * plan.blocks) and c2.grid == (2, 1, plan.blocks)
    assert c1.launch_configs() == [c1]
    w13_k3 = Exl3Weight(jnp.zeros((2, 5, 16, 16, 48), jnp.int16), jnp.ones((2, 5, 256)),
                        jnp.ones((2, 5, 256)), None, "mul1", 3, 256, 256)
    tiered = tm.grouped_config([w13, w13_k3], plan.fc1, dataclasses.replace(plan, experts=14))
    assert tiered.experts == 14 and tiered.tiers == (("mcg", 4, 8), ("mul1", 3, 5))
    assert [(c.codebook, c.K, c.experts, c.tier, c.global_experts, c.planes, c.m_tile)
            for c in tiered.launch_configs()] == [("mcg", 4, 8, 0, 14, 2, 64),
                                                  ("mul1", 3, 5, 1, 14, 2, 64)]
    with pytest.raises(ValueError, match="at most 3"):
        tm.grouped_config([w13] * 4, plan.fc1, dataclasses.replace(plan, experts=32))
    assert tm.grouped_config(w13, plan.fc1, moe_plan(300, 2, 8, 256, 256, hopper=True)).m_tile \
        == 128


@needs_cutlass
def test_wgmma_plan_needs_hopper(monkeypatch):
    # Auto leaves the plan to WGMMA_AUTO; forcing it elsewhere than sm_90a is refused by name.
    from exl3_jax.ffi import aot
    from exl3_jax.ffi import trellis_moe as tm
    from exl3_jax.ops import moe_plans
    monkeypatch.setattr(aot, "device_arch", lambda: "sm_120a")
    with pytest.raises(ValueError, match="needs Hopper.*sm_120a"):
        tm.plan_for(300, 2, 8, 256, 256, "wgmma")
    monkeypatch.setattr(aot, "device_arch", lambda: "sm_90a")
    assert tm.plan_for(300, 2, 8, 256, 256, "wgmma").kind == "wgmma"
    for auto in (False, True):
        monkeypatch.setattr(moe_plans, "WGMMA_AUTO", auto)
        assert tm.plan_for(300, 2, 8, 256, 256).kind == ("wgmma" if auto else "prefill")


@needs_cutlass
def test_route_packing_kernel_sizes_and_switch(monkeypatch):
    # The packing kernel takes one CTA's worth (up to 1024 experts, 64 rounds of 1024 routes,
    # its shared memory); past that, or with EXL3_JAX_MOE_PACK=xla, the sorted plans pack in
    # XLA; a bad switch value or inconsistent config is refused by name.
    from exl3_jax.ffi import route_pack as rp
    from exl3_jax.ffi import trellis_moe as tm
    from exl3_jax.ops import moe_plans
    cfg = lambda R, E, bm, k=8: rp.PackConfig(R, E, bm, max_blocks(R, E, bm), k)  # noqa: E731
    assert cfg(4096 * 8, 128, 128).fits() and cfg(8, 1024, 8).fits()
    assert not cfg(8, 1025, 8).fits() and not cfg(65 * 1024 * 8, 128, 128).fits()
    for bad, msg in ((cfg(16, 1025, 8), "1025 experts"), (cfg(65 * 8192, 16, 128), "routes exceed"),
                     (rp.PackConfig(16, 4, 8, 3, 8), "static bound"),
                     (rp.PackConfig(15, 4, 8, max_blocks(15, 4, 8), 8), "T \\* top_k")):
        with pytest.raises(ValueError, match=msg):
            bad.validate()
    used = []
    monkeypatch.setattr(rp, "pack_routes_gpu", lambda *a: used.append(a) or pack_routes(*a))

    def packs_in_kernel(T, top_k, env=None):
        # Whether pack_for takes the kernel for T tokens at top_k (E 8, the auto plan).
        if env is None:
            monkeypatch.delenv(tm.PACK_ENV, raising=False)
        else:
            monkeypatch.setenv(tm.PACK_ENV, env)
        plan = moe_plan(T, top_k, 8, 256, 256, kind="prefill")
        before = len(used)
        tm.pack_for(jnp.zeros((T, top_k), jnp.int32), 8, plan)
        return len(used) > before

    # By default the kernel up to PACK_KERNEL_MAX_ROUTES routes, XLA's sort past it.
    limit = moe_plans.PACK_KERNEL_MAX_ROUTES
    assert packs_in_kernel(40, 4) and packs_in_kernel(limit // 4, 4)
    assert not packs_in_kernel(limit // 4 + 1, 4)
    assert packs_in_kernel(limit // 4 + 1, 4, "kernel")      # the switch forces either
    assert not packs_in_kernel(40, 4, "xla")
    monkeypatch.setattr(moe_plans, "PACK_KERNEL_MAX_ROUTES", 0)
    assert not packs_in_kernel(40, 4)
    with pytest.raises(ValueError, match="EXL3_JAX_MOE_PACK='fast'"):
        packs_in_kernel(40, 4, "fast")


def test_plan_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_plan(1, 2, 4, 200, 128)
    with pytest.raises(ValueError, match="plan kind"):
        moe_plan(1, 2, 4, 256, 128, kind="fast")


# --- references ---------------------------------------------------------------------------------


@pytest.mark.parametrize("T,top_k,E,invalid", [
    pytest.param(1, 2, 4, 0.0, marks=pytest.mark.slow), (7, 3, 6, 0.2),
    pytest.param(33, 2, 4, 0.0, marks=pytest.mark.slow)])
def test_packed_reference_matches_all_experts_reference(rng, T, top_k, E, invalid):
    H, I = 256, 128
    w13, down = random_moe(rng, E, H, I, K=3)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids, w = random_routing(rng, T, top_k, E, invalid)
    ref = moe_ops.moe_experts(x, ids, w, moe_ops.plane(w13, 0), moe_ops.plane(w13, 1), down,
                              backend="reference")
    got = moe_ops.moe(x, ids, w, w13, down, backend="packed")
    assert got.shape == (T, H)
    assert rel_err(got, ref) < 1e-5


def test_no_experts_hit_is_exactly_zero(rng):
    w13, down = random_moe(rng, 4, 128, 128, K=2)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    ids = -jnp.ones((3, 2), jnp.int32)
    out = moe_ops.moe(x, ids, jnp.ones((3, 2)), w13, down, backend="packed")
    assert np.all(np.asarray(out) == 0.0)


def test_tiered_matches_single_stack(rng):
    # Mixed K3 / K4 experts: the tiered call equals the per-expert reference on one logical
    # expert set (each expert's tensors taken from its tier).
    H, I, E = 256, 128, 6
    t3, t4 = random_moe(rng, 3, H, I, K=3), random_moe(rng, 3, H, I, K=4)
    expert_tier = jnp.asarray([0, 1, 1, 0, 0, 1], jnp.int32)
    expert_slot = jnp.asarray([0, 0, 1, 1, 2, 2], jnp.int32)
    x = jnp.asarray(rng.standard_normal((5, H)), jnp.float32)
    ids, w = random_routing(rng, 5, 2, E, 0.1)
    got = moe_ops.moe_tiered(x, ids, w, [t3, t4], expert_tier, expert_slot, backend="packed")
    @jax.jit
    def one_route(xt, w13, down, s):          # one token through one expert, [1, H]
        take = moe_ops._take_expert
        g = moe_ops._linear_ref(xt, take(moe_ops.plane(w13, 0), s))
        u = moe_ops._linear_ref(xt, take(moe_ops.plane(w13, 1), s))
        return moe_ops._linear_ref(jax.nn.silu(g) * u, take(down, s))

    ref = np.zeros((5, H), np.float32)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e < 0:
                continue
            w13, down = (t3, t4)[int(expert_tier[e])]
            y = one_route(x[t:t + 1], w13, down, expert_slot[e])
            ref[t] += float(w[t, j]) * np.asarray(y[0])
    assert rel_err(got, jnp.asarray(ref)) < 1e-5


# --- the GPU glue with emulated kernels ---------------------------------------------------------


def emulate_moe_kernels(patch):
    """Replace the CuTe calls of moe_gpu by jnp code with the same flat contracts;
    patch(module, name, value) installs a replacement (monkeypatch.setattr)."""
    from exl3_jax.ffi import trellis_gemm as tg
    from exl3_jax.ffi import trellis_moe as tm
    calls = []

    def grouped_partials(xw, weight, block_expert, cfg, out_init=None, tier_maps=None):
        calls.append(cfg)
        xh = jax.lax.bitcast_convert_type(xw, jnp.float16).reshape(cfg.planes, cfg.blocks,
                                                                   cfg.block_m, cfg.k)
        live = (block_expert >= 0) & (block_expert < cfg.experts)
        e = jnp.where(live, block_expert, 0)
        slabs = [weight] if not cfg.tiers else list(weight)
        decoded = []                                    # per slab: [P, E_slab, k, n]
        for w, c in zip(slabs, cfg.slab_configs()):
            trellis = w.trellis.reshape(cfg.planes, c.experts, *w.trellis.shape[-3:])
            decoded.append(decode_trellis(trellis, c.codebook).astype(jnp.float32))
        if not cfg.tiers:
            wb = decoded[0][:, e]                                             # [P, B, k, n]
        else:                       # each block from its expert's tier slab; no tier: zero
            tier, slot = tier_maps[0][e], tier_maps[1][e]
            wb = sum(jnp.where((tier == t)[None, :, None, None],
                               d[:, jnp.where(tier == t, slot, 0)], 0.0)
                     for t, d in enumerate(decoded))
        ks = cfg.k // cfg.splits
        parts = [jnp.einsum("pbmk,pbkn->pbmn", xh[..., s * ks:(s + 1) * ks].astype(jnp.float32),
                            wb[:, :, s * ks:(s + 1) * ks], precision="highest")
                 for s in range(cfg.splits)]
        out = jnp.where(live[None, None, :, None, None], jnp.stack(parts), 0.0)
        return out.reshape(-1)

    def hadamard_in(x, suh, m_pad):        # the kernels' contract via the jnp transforms
        xh, scale = tg.input_transform(x, suh)
        pad = m_pad - x.shape[0]
        return (jnp.pad(xh, ((0, pad), (0, 0))).reshape(-1),
                jnp.pad(scale[:, 0], (0, pad), constant_values=1.0))

    def hadamard_out(part, svh, bias, scale, *, m, m_pad, splits, n):
        return tg.output_transform(part.reshape(splits, m_pad, n).sum(0)[:m], svh, bias,
                                   scale[:m, None])

    from exl3_jax.ops.moe_routing import gather_expert_rows, gather_rows

    def rows_scaled(xs):              # [rows, n] fp32 -> (fp16 had128(xs / s), s [rows])
        xh, s = tg.input_transform(xs, jnp.ones((xs.shape[-1],), jnp.float32))
        return xh, s[:, 0]

    def rotate_in(x, suh13, kr):
        pr = kr.as_packed()
        live = ((pr.row_token >= 0) & (pr.row_expert >= 0))[:, None]
        xr = gather_rows(jnp.asarray(x, jnp.float32), pr.row_token)
        xs = jnp.concatenate([jnp.where(live, xr * gather_expert_rows(suh13[p], pr.row_expert),
                                        0.0) for p in range(2)])         # [2 * rows, H]
        xh, s = rows_scaled(xs)
        return xh.reshape(-1), s

    def activation(part1, scale1, svh13, suh2, kr, x_scale, *, splits, inter, valid_cols):
        pr = kr.as_packed()
        y = hadamard128(part1.reshape(splits, 2, pr.rows, inter).sum(0))
        y = y * jnp.stack([gather_expert_rows(svh13[p], pr.row_expert)
                           for p in range(2)]).astype(jnp.float32)
        y = y * scale1.reshape(2, pr.rows, 1)
        if x_scale is not None:
            y = y * gather_rows(jnp.asarray(x_scale, jnp.float32), pr.row_token)[None]
        live = ((pr.row_token >= 0) & (pr.row_expert >= 0))[:, None]
        h = jnp.where(live & (jnp.arange(inter) < valid_cols), jax.nn.silu(y[0]) * y[1], 0.0)
        h = h * gather_expert_rows(suh2, pr.row_expert).astype(jnp.float32)
        xh, s = rows_scaled(h)
        return xh.reshape(-1), s

    def combine(part2, scale2, svh2, kr, weights, *, splits, hidden):
        pr = kr.as_packed()
        y = hadamard128(part2.reshape(splits, pr.rows, hidden).sum(0))
        y = y * gather_expert_rows(svh2, pr.row_expert).astype(jnp.float32) * scale2[:, None]
        return combine_routes(y, pr.route_row, weights)

    def moe_layer(x, kr, w13, down, weights, *, glue, cfg1, cfg2, x_scale=None, tier_maps=None,
                  valid_cols, poison=False, pdl=None):
        # The one custom call's five kernels, in its order, on the same flat contracts.
        calls.append("moe_layer")
        suh13, svh13, suh2, svh2 = glue
        xh, s1 = rotate_in(x, suh13, kr)
        p1 = grouped_partials(tg.f16_words(xh), w13, kr.block_expert, cfg1, None, tier_maps)
        xh2, s2 = activation(p1, s1, svh13, suh2, kr, x_scale, splits=cfg1.splits,
                             inter=cfg1.n, valid_cols=valid_cols)
        p2 = grouped_partials(tg.f16_words(xh2), down, kr.block_expert, cfg2, None, tier_maps)
        return combine(p2, s2, svh2, kr, weights, splits=cfg2.splits, hidden=x.shape[1])

    patch(tm, "moe_layer", moe_layer)
    patch(tm, "grouped_partials", grouped_partials)
    # The packing kernel (pack_for's default up to PACK_KERNEL_MAX_ROUTES): the counting sort
    # computes the same tables (test_emulated_kernels checks the kernel against them).
    from exl3_jax.ffi import route_pack
    patch(route_pack, "pack_routes_gpu", pack_routes)
    patch(tg, "hadamard_in", hadamard_in)
    patch(tg, "hadamard_out", hadamard_out)
    return calls


@pytest.fixture
def emulated_moe_kernels(monkeypatch):
    return emulate_moe_kernels(monkeypatch.setattr)


@needs_cutlass
@pytest.mark.parametrize("T,top_k,E,kind,fused", [
    (1, 2, 4, "decode", True), (6, 3, 8, "decode", False), (2, 2, 16, "decode", True),
    pytest.param(40, 2, 4, "prefill", True, marks=pytest.mark.slow)])
def test_gpu_glue_matches_reference(rng, emulated_moe_kernels, T, top_k, E, kind, fused):
    from exl3_jax.ffi import trellis_moe as tm
    H, I = 256, 384
    w13, down = random_moe(rng, E, H, I, K=4)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids, w = random_routing(rng, T, top_k, E, 0.15)
    scale = jnp.asarray(rng.uniform(0.5, 2, (T, 1)), jnp.float32)
    got = jax.jit(lambda *a: tm.moe_gpu(*a, x_scale=scale, plan=kind, fused=fused))(
        x, ids, w, w13, down)
    ref = moe_ops.moe(x, ids, w, w13, down, x_scale=scale, backend="packed")
    assert got.shape == (T, H) and got.dtype == jnp.float32
    assert rel_err(got, ref) < 2e-3                  # fp16 rounding of the rotated operands
    gemms = [c.planes for c in emulated_moe_kernels if not isinstance(c, str)]
    assert gemms == [2, 1]
    glue = [c for c in emulated_moe_kernels if isinstance(c, str)]
    assert glue == (["moe_layer"] if fused else [])


@needs_cutlass
def test_gpu_dispatch_pads_prefill_to_a_token_bucket(rng, emulated_moe_kernels):
    # 35 tokens run as the 64-token bucket (routeless padding tokens), sliced back.
    H = I = 128
    w13, down = random_moe(rng, 4, H, I, K=3)
    x = jnp.asarray(rng.standard_normal((35, H)), jnp.float32)
    ids, w = random_routing(rng, 35, 2, 4, 0.1)
    got = moe_ops.moe(x, ids, w, w13, down, backend="gpu")
    ref = moe_ops.moe(x, ids, w, w13, down, backend="packed")
    assert got.shape == (35, H)
    assert rel_err(got, ref) < 2e-3
    assert moe_ops.token_bucket(35) == 64
    gemms = [c for c in emulated_moe_kernels if not isinstance(c, str)]
    assert len(gemms) == 2 and {c.blocks for c in gemms} == {moe_plan(64, 2, 4, H, I).blocks}


@needs_cutlass
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_glue_keeps_overflowing_rows_finite(rng, emulated_moe_kernels, fused):
    # The fp16 boundary of the MoE (ffi/trellis_moe.py): token 1's x reaches 3e4 and token 2's
    # 3e6 (bf16, no caller x_scale), so both the rotated FC1 operand and the SwiGLU output that
    # FC2 takes overflow fp16 unless each row is scaled by its power of two; token 0 is in
    # range. Every token must match the fp32 packed reference, each to its own magnitude.
    from exl3_jax.ffi import trellis_moe as tm
    H, I, E = 256, 256, 4
    w13, down = random_moe(rng, E, H, I, K=4)
    x = rng.standard_normal((3, H))
    x[1] *= 3e4 / np.abs(x[1]).max()
    x[2] *= 3e6 / np.abs(x[2]).max()
    x = jnp.asarray(x, jnp.bfloat16)
    ids, w = random_routing(rng, 3, 2, E)
    got = jax.jit(lambda *a: tm.moe_gpu(*a, plan="decode", fused=fused))(x, ids, w, w13, down)
    ref = moe_ops.moe(x, ids, w, w13, down, backend="packed")
    assert bool(jnp.all(jnp.isfinite(got)))
    for t in range(3):
        assert rel_err(got[t], ref[t]) < 2e-3, t


@needs_cutlass
@pytest.mark.parametrize("tiers,T,kind", [
    ((("mcg", 3, 3), ("mul1", 4, 3)), 5, "decode"),
    ((("mcg", 3, 2), ("3inst", 2, 3), ("mul1", 3.5, 2)), 3, "decode"),
    ((("mcg", 3, 4), ("mul1", 4, 4)), 1, "decode"),         # per-route plan: ids, no packing
    pytest.param((("mcg", 3, 3), ("mul1", 4, 3)), 40, "prefill", marks=pytest.mark.slow)])
def test_mixed_tiers_share_one_set_of_launches(rng, emulated_moe_kernels, tiers, T, kind):
    """moe_tiered on the GPU path: one route packing and one layer call for every tier (its 2
    grouped GEMMs' configs carry the tiers), against the packed
    reference run tier by tier; experts of the tiers interleaved in a random global order,
    some routes invalid, an expert in no tier (a rank's missing expert: exactly zero)."""
    H, I = 256, 128
    slabs = [random_moe(rng, n, H, I, K=K, codebook=cb) for cb, K, n in tiers]
    E = sum(n for *_, n in tiers) + 1                   # the last expert is in no tier
    owner = np.concatenate([np.full(n, t) for t, (*_, n) in enumerate(tiers)] + [[-1]])
    rng.shuffle(owner)
    slot = np.zeros(E, np.int32)
    for t in range(len(tiers)):
        slot[owner == t] = np.arange((owner == t).sum())
    expert_tier, expert_slot = jnp.asarray(owner, jnp.int32), jnp.asarray(slot)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids, w = random_routing(rng, T, 2, E, 0.1)
    ids = ids.at[0, 0].set(int(np.flatnonzero(owner == -1)[0]))
    run = jax.jit(lambda x, ids, w: moe_ops.moe_tiered(x, ids, w, slabs, expert_tier,
                                                       expert_slot, backend="gpu"))
    got = run(x, ids, w)
    ref = moe_ops.moe_tiered(x, ids, w, slabs, expert_tier, expert_slot, backend="packed")
    assert got.shape == (T, H) and rel_err(got, ref) < 2e-3
    gemms = [c for c in emulated_moe_kernels if not isinstance(c, str)]
    assert [(c.planes, c.tiers) for c in gemms] == [(2, tiers), (1, tiers)]
    assert {c.experts for c in gemms} == {E}
    assert [c for c in emulated_moe_kernels if isinstance(c, str)] == ["moe_layer"]
    only = jnp.asarray([[int(np.flatnonzero(owner == -1)[0]), -1]], jnp.int32)
    assert float(jnp.abs(run(x[:1], only, w[:1])).max()) == 0.0


def test_tier_glue_orders_the_tables_by_global_expert(rng):
    H, I = 128, 128
    slabs = [random_moe(rng, 2, H, I, K=3), random_moe(rng, 1, H, I, K=4)]
    expert_tier = jnp.asarray([1, 0, -1, 0], jnp.int32)
    expert_slot = jnp.asarray([0, 1, -1, 0], jnp.int32)
    suh13, svh13, suh2, svh2 = moe_ops.tier_glue(slabs, expert_tier, expert_slot)
    for e, (t, s) in enumerate([(1, 0), (0, 1), (0, 0), (0, 0)]):   # no tier: tier 0 slot 0
        w13, down = slabs[t]
        np.testing.assert_array_equal(suh13[:, e], w13.suh[:, s])
        np.testing.assert_array_equal(svh13[:, e], w13.svh[:, s])
        np.testing.assert_array_equal(suh2[e], down.suh[s])
        np.testing.assert_array_equal(svh2[e], down.svh[s])


@needs_cutlass
def test_per_route_plans_hand_the_kernels_the_ids(rng, monkeypatch):
    """A per-route plan packs nothing: the kernels get the flat ids as their tables (and derive
    rows themselves); as_packed is the per-route packing they must reproduce. A sorted plan
    hands over pack_routes' tables (XLA's here: the packing kernel needs a GPU)."""
    from exl3_jax.ffi import trellis_moe as tm
    monkeypatch.setenv(tm.PACK_ENV, "xla")
    ids, _ = random_routing(rng, 2, 4, 64, 0.2)
    plan = moe_plan(2, 4, 64, 256, 128)
    assert plan.packing == "per_route"
    kr = tm.kernel_routes(ids, 64, plan)
    assert (kr.per_route, kr.rows, kr.blocks) == (8, 8 * 8, 8)
    jaxpr = jax.make_jaxpr(lambda i: tm.kernel_routes(i, 64, plan).block_expert)(ids)
    assert {e.primitive.name for e in jaxpr.eqns} <= {"reshape"}     # no packing ops
    for got, want in ((kr.block_expert, ids.reshape(-1)), (kr.route_row, ids.reshape(-1))):
        np.testing.assert_array_equal(got, want)
    ref = pack_routes_per_route(ids, 64, 8)
    for name in ("row_token", "row_expert", "block_expert", "route_row"):
        np.testing.assert_array_equal(getattr(kr.as_packed(), name), getattr(ref, name))
    ids8 = jnp.where(ids < 8, ids, -1)
    sorted_plan = moe_plan(2, 4, 8, 256, 128)                  # 8 routes over 8 experts
    ks = tm.kernel_routes(ids8, 8, sorted_plan)
    assert sorted_plan.packing == "sorted" and ks.per_route == 0
    np.testing.assert_array_equal(ks.block_expert,
                                  pack_routes(ids8, 8, ks.block_m).block_expert)
