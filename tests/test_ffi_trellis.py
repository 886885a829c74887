"""CPU tests of the GPU Trellis GEMM (exl3_jax.ffi): geometry, plans, plumbing, compile, export.

No GPU here. What runs on CPU:
  * the per-lane window geometry the kernels use, emulated on the host, vs the reference decoder;
  * plan selection (static, deterministic, decode vs prefill boundaries);
  * the JAX-side plumbing of trellis_matmul_gpu (padding, bitcasts, K-split sums, transposed
    dequant, transforms) with the two kernel calls replaced by jnp emulations of their contracts;
  * compile-only builds of the CuTe kernels for sm_90a and sm_120a (one subprocess per arch,
    since CuTe DSL reads CUTE_DSL_ARCH once per process) through jax.export(platforms=["cuda"]),
    checking the custom call and the SM of the embedded cubin;
  * the jitted dispatch op (exl3_jax.ops.trellis_matmul, backend="gpu") lowers for CUDA.
The kernels' numerics are validated on the H200 by scripts/gpu_validate.py (bench/NOTES.md).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import helpers_sass
from helpers_cute import check_rows, last_line_of_script, needs_cutlass

from exl3_jax.format.spec import width_from_rate
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ffi import aot
from exl3_jax.ffi.trellis_geometry import (A_OPERAND_PAIRS, b_fragment_slot, b_fragment_word,
                                           emulate_lane_states, lane_geometry,
                                           pair_fragment_slot, pair_fragment_word,
                                           quad_fragment_index, row_fragment_slot,
                                           supported_rates,
                                           token_fragment_word)
from exl3_jax.ops import plans
from exl3_jax.trellis import (Exl3Weight, decode_trellis, dequantize, linear_reference, tile_perm,
                             unpack_states)


def random_weight(rng, k, n, K, codebook, bias=False):
    trellis = rng.integers(-32768, 32768, size=(k // 16, n // 16, width_from_rate(K)),
                           dtype=np.int64).astype(np.int16)
    suh = rng.choice([-1.0, 1.0], size=k).astype(np.float16)
    svh = (rng.uniform(0.5, 1.5, size=n) / 64).astype(np.float16)
    b = jnp.asarray(rng.standard_normal(n).astype(np.float16)) if bias else None
    return Exl3Weight.create(jnp.asarray(trellis), jnp.asarray(suh), jnp.asarray(svh), codebook,
                             b)


# --- geometry ------------------------------------------------------------------------------


@pytest.mark.parametrize("K", supported_rates())
def test_lane_geometry_matches_reference_states(rng, K):
    width = width_from_rate(K)
    trellis = rng.integers(-32768, 32768, size=(7, width), dtype=np.int64).astype(np.int16)
    u = trellis.view(np.uint16).astype(np.uint32)
    words = u[:, 0::2] | (u[:, 1::2] << 16)
    ref = np.asarray(unpack_states(jnp.asarray(trellis)))
    np.testing.assert_array_equal(emulate_lane_states(words, K), ref)
    # The FMA-pipe extraction: top windows (packed kernels), and byte windows (split pairs).
    np.testing.assert_array_equal(emulate_lane_states(words, K, fma_pipe=True), ref)
    np.testing.assert_array_equal(
        emulate_lane_states(words, K, fma_pipe=True, byte_windows=True), ref)
    # K = 4 on both pipes (LaneGeometry.nibble_plan: the MoE kernels, the byte-sum mul1).
    for byte_windows in (False, True):
        np.testing.assert_array_equal(emulate_lane_states(
            words, K, fma_pipe=True, byte_windows=byte_windows, nibbles=True), ref)


@pytest.mark.parametrize("codebook", ["mcg", "3inst"])
def test_folded_state_product(rng, codebook):
    # FoldedState: state * a from the unmasked base word r and high = r >> 16, as the decode's
    # two IMADs compute it (cute_ops._product), equals the masked state's product mod 2^32.
    from exl3_jax.trellis.codebook import (MCG_MULTIPLIER, THREEINST_ADDEND,
                                           THREEINST_MULTIPLIER)
    a, b = ((MCG_MULTIPLIER, 0) if codebook == "mcg"
            else (THREEINST_MULTIPLIER, THREEINST_ADDEND))
    r = rng.integers(0, 2**32, size=4096, dtype=np.uint64)
    r[:3] = [0, 0xFFFFFFFF, 0xFFFF0000]
    mod = np.uint64(2**32)
    want = ((r & np.uint64(0xFFFF)) * np.uint64(a) + np.uint64(b)) % mod
    high = r >> np.uint64(16)
    got = ((r * np.uint64(a) + np.uint64(b)) % mod
           + high * np.uint64((-(a << 16)) % 2**32)) % mod
    np.testing.assert_array_equal(got, want)


def test_lane_geometry_groups():
    # Two-word funnels must cover a whole group for every lane (the kernels assume it); K=2..4
    # take at most two funnels per lane and tile.
    for K in supported_rates():
        geo = lane_geometry(K)
        assert 8 % geo.group == 0 and geo.offsets[0] == 0
    assert lane_geometry(3).groups == 1 and lane_geometry(4).groups == 1
    assert lane_geometry(3.5).groups == 2 and lane_geometry(7).groups == 4
    # Byte windows (split pairs' FMA-pipe extraction) where the lowest state is byte-aligned
    # in every lane and not every state is on top: K3 (8 states, both windows), not K2 / K4.
    plan3 = lane_geometry(3).window_plan(0)
    assert plan3 is not None and {w for w, _, _ in plan3} == {0, 1}
    assert sum(fma for _, _, fma in plan3) == 4
    assert lane_geometry(2).window_plan(0) is None and lane_geometry(4).window_plan(0) is None


def test_fragment_pairs_follow_the_tile_permutation():
    # Element j of lane l sits at (r, c) = perm[8l + j]; as the MMA A operand (rows = output
    # column c, cols = input row r) the register pairs must be (c0, r0..r0+1), (c0+8, r0..),
    # (c0, r0+8..), (c0+8, r0+8..) with r0 = 2(l%4), c0 = l//4 (PTX m16n8k16 A layout).
    perm = tile_perm()
    for lane in range(32):
        r0, c0 = 2 * (lane % 4), lane // 4
        want = [(c0, r0), (c0 + 8, r0), (c0, r0 + 8), (c0 + 8, r0 + 8)]
        for reg, (ja, jb) in enumerate(A_OPERAND_PAIRS):
            ra, ca = divmod(int(perm[8 * lane + ja]), 16)
            rb, cb = divmod(int(perm[8 * lane + jb]), 16)
            assert (ca, ra) == want[reg] and (cb, rb) == (want[reg][0], want[reg][1] + 1)


# --- plans ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(4096, 14336), (8192, 8192), (8192, 28672), (2048, 768),
                                 (128, 128)])
@pytest.mark.parametrize("hopper", [False, True])
def test_plan_selection(k, n, hopper):
    # Auto: decode up to 32 rows and prefill above; on Hopper wgmma for 25..128 rows, 25..256
    # for weights up to WGMMA_WIDE_MAX_WEIGHTS.
    for m in (1, 2, 7, 8, 9, 16, 17, 24, 25, 31, 32):
        p = plans.select_plan(m, k, n, hopper=hopper)
        if hopper and m >= 25:
            assert p == plans.select_plan(m, k, n, force="wgmma")
            continue
        assert p.kind == "decode" and p.m_tile == -(-m // 8) * 8 and p.m_tile >= m
        assert (k // 16) % p.splits == 0 and (n // 16) % p.n_tiles == 0
        assert (k // 16) // p.splits >= p.warps      # every warp gets k16 tiles
    wgmma_max = (plans.WGMMA_WIDE_MAX_M if k * n <= plans.WGMMA_WIDE_MAX_WEIGHTS
                 else plans.WGMMA_MAX_M)
    for m in (33, 128, 129, 256, 257, 1000, 4096):
        p = plans.select_plan(m, k, n, hopper=hopper)
        if hopper and m <= wgmma_max:
            assert p == plans.select_plan(m, k, n, force="wgmma")
            continue
        assert p == plans.TrellisPlan("prefill", m)     # nothing to choose: one form
    # Static and deterministic: a decode loop at fixed m always gets the same plan (no
    # recompiles), and m = 2..8 share one binary (the kernel config does not contain m; m = 1
    # has its own one-token layout, and above ROW_LINEAR_MAX_WEIGHTS its own ring plan).
    assert plans.select_plan(5, k, n) == plans.select_plan(5, k, n)
    assert len({(p.m_tile, p.splits, p.unroll) for p in (plans.select_plan(m, k, n)
                                                         for m in range(2, 9))}) == 1
    one = plans.select_plan(1, k, n, hopper=hopper)
    assert one.ring == (plans.RING_SLOTS if hopper and k * n > plans.ROW_LINEAR_MAX_WEIGHTS
                        else 0)


@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 28672), (128, 128)])
@pytest.mark.parametrize("m", [33, 64, 65, 128, 1000])
def test_tiles_plan(k, n, m):
    # Forced only (not chosen by auto until measured): token tiles of 64 / 128, 128-column
    # CTAs, whole 4-step chunks per split, the fewest splits giving two CTAs per SM.
    assert plans.select_plan(m, k, n).kind == "prefill"
    p = plans.select_plan(m, k, n, force="tiles")
    assert p.kind == "tiles" and p.m_tile == (64 if m <= 64 else 128)
    assert p.warps * p.n_tiles == 8 and (n // 16) % 8 == 0
    kps = (k // 16) // p.splits
    assert (k // 16) % p.splits == 0 and kps % p.unroll == 0 and p.splits <= 16
    ctas = (n // 128) * -(-m // p.m_tile)
    fewer = [s for s in range(1, p.splits) if (k // 16) % s == 0 and ((k // 16) // s) % 4 == 0]
    assert ctas * p.splits >= 2 * plans.DEFAULT_SMS or p.splits == max(
        [s for s in range(1, 17) if (k // 16) % s == 0 and ((k // 16) // s) % 4 == 0])
    assert all(ctas * s < 2 * plans.DEFAULT_SMS for s in fewer)
    with pytest.raises(ValueError, match="unknown plan kind"):
        from exl3_jax.ops import moe_plans
        moe_plans.moe_plan(m, 8, 128, 2048, 768, kind="tiles")


@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 28672), (128, 128)])
@pytest.mark.parametrize("m", [16, 32, 33, 64, 65, 128, 200, 256, 257, 1000, 2049, 4096])
def test_wgmma_plan(k, n, m):
    # Token tiles of 32 / 64 / 128 / 256 (wgmma's N), two warpgroups of 64 columns, whole 4-step
    # chunks per split, the fewest splits giving one CTA per SM; auto only on Hopper.
    assert plans.select_plan(m, k, n).kind == ("decode" if m <= 32 else "prefill")
    # (session 30's H100 A/B: up to 256 rows for 4096x14336 and 14336x4096, 128 for the
    # 235 M weights of 8192x28672)
    wgmma_max = 128 if k * n == 8192 * 28672 else 256
    assert plans.select_plan(m, k, n, hopper=True).kind == (
        "wgmma" if 25 <= m <= wgmma_max else "decode" if m <= 32 else "prefill")
    p = plans.select_plan(m, k, n, force="wgmma")
    assert p.kind == "wgmma" and p.warps == 8
    assert p.m_tile == (32 if m <= 32 else 64 if m <= 64 else 128 if m <= 2048 else 256)
    allowed = [s for s in range(1, 17) if (k // 16) % s == 0 and ((k // 16) // s) % 4 == 0]
    assert p.splits in allowed
    ctas = (n // 128) * -(-m // p.m_tile)
    assert ctas * p.splits >= plans.DEFAULT_SMS or p.splits == allowed[-1]
    assert all(ctas * s < plans.DEFAULT_SMS for s in allowed if s < p.splits)
    assert plans.wgmma_plan(m, k, n, tiling=(256, 1, 2)) == plans.TrellisPlan(
        "wgmma", m, m_tile=256, warps=4, splits=2)
    assert p.fused_out == (p.splits == 1)          # one split: the epilogue transforms
    assert plans.tiled_plan("wgmma", m, k, n, "128,2,1") == plans.TrellisPlan(
        "wgmma", m, m_tile=128, warps=8, splits=1, fused_out=True)
    assert plans.tiled_plan("wgmma", m, k, n, "128,2,1,0,6") == plans.TrellisPlan(
        "wgmma", m, m_tile=128, warps=8, splits=1, fused_out=False, weight_ring=6)
    with pytest.raises(ValueError, match="m_tile,warpgroups,splits"):
        plans.tiled_plan("wgmma", m, k, n, "128,2,1,0,4,2")      # no sixth field
    with pytest.raises(ValueError, match="takes no tiling"):
        plans.tiled_plan("prefill", m, k, n, "128,2,1")


@needs_cutlass
@pytest.mark.parametrize("K", [2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])
def test_wgmma_weight_ring_copies_cover_each_chunk_once(K, rng):
    # The wgmma kernel's weight copies: the lanes' 16-byte pieces (the spare lanes repeating
    # the last) land every word of the warp's K_CHUNK tiles in its ring slot exactly where the
    # decode reads it (slot word kk * words + f <- trellis word ((c0 + kk) * n16 + tn) * words
    # + f), and nothing else.
    from exl3_jax.ffi import trellis_wgmma as tw
    from exl3_jax.ffi.trellis_geometry import lane_geometry
    geo = lane_geometry(K)
    n16, c0, tn = 24, int(rng.integers(0, 8)), int(rng.integers(0, 24))
    total = tw.K_CHUNK * geo.words // 4
    lanes = {min(lane + 32 * i, total - 1) for lane in range(32) for i in range(-(-total // 32))}
    assert lanes == set(range(total))
    got = {}
    for p in lanes:
        kk, q = tw.weight_piece(p, geo)
        for e in range(4):
            got[4 * p + e] = ((c0 + kk) * n16 + tn) * geo.words + 4 * q + e
    want = {kk * geo.words + f: ((c0 + kk) * n16 + tn) * geo.words + f
            for kk in range(tw.K_CHUNK) for f in range(geo.words)}
    assert got == want


@needs_cutlass
def test_wgmma_stage_swizzle_and_descriptor(rng):
    # The kernel stores 16-byte unit (row, seg) of a chunk at swizzled_word(row, seg); wgmma
    # reads B (16 k x m_tile tokens, K-major, 128-byte swizzle) of step kk from the descriptor's
    # start address: element (token r, k j) at start + (r // 8) * SBO + (r % 8) * 128 + 2 j,
    # with address bits 4..6 XORed by bits 7..9 (PTX ISA, shared memory matrix layouts). Model
    # that read and check it returns x[r, 16 kk + j] for every token, step and stage.
    from exl3_jax.ffi import trellis_wgmma as tw
    cfg = tw.WgmmaGemmConfig("mcg", 4, 1, 1024, 512, m_tile=128, warpgroups=2).validate()
    stage_bytes = cfg.stage_words * 4
    x = rng.integers(0, 2**16, size=(cfg.m_tile, 16 * tw.K_CHUNK)).astype(np.uint16)
    words = x.view(np.uint32)                                 # [m_tile, 32]: one chunk
    base = 3 * 1024                                           # any 1024-aligned address
    smem = np.zeros(base + tw.ACTIVATION_STAGES * stage_bytes, np.uint8)
    units = np.arange(cfg.copy_units * cfg.threads)
    row, seg = tw.stage_unit(cfg, units)
    assert sorted(zip(row, seg)) == [(r, s) for r in range(cfg.m_tile) for s in range(8)]
    stage = 2
    for r, sg in zip(row, seg):
        at = base + stage * stage_bytes + tw.swizzled_word(r, sg) * 4
        smem[at:at + 16] = words[r, 4 * sg:4 * sg + 4].view(np.uint8)
    desc_hi = tw.DESC_HI
    assert (desc_hi & 0x3FFF) * 16 == tw.SWIZZLE_ATOM_BYTES and desc_hi >> 30 == 1
    for kk in range(tw.K_CHUNK):
        lo = tw.descriptor_lo(base + stage * stage_bytes, kk)
        # the kernel's way: stage 0's word plus stage and step offsets in 16-byte units
        assert lo == tw.descriptor_lo(base) + stage * (stage_bytes >> 4) + 2 * kk
        assert lo >> 16 == 1                                  # leading byte offset field: 1
        start = (lo & 0x3FFF) * 16
        r = np.arange(cfg.m_tile)[:, None]
        j = np.arange(16)[None, :]
        logical = start + (r // 8) * tw.SWIZZLE_ATOM_BYTES + (r % 8) * tw.ROW_BYTES + 2 * j
        physical = logical ^ (((logical >> 7) & 7) << 4)
        got = smem[physical] | (smem[physical + 1].astype(np.uint16) << 8)
        np.testing.assert_array_equal(got, x[:, 16 * kk:16 * kk + 16])
    with pytest.raises(ValueError, match="m_tile 96"):
        tw.WgmmaGemmConfig("mcg", 4, 1, 1024, 512, m_tile=96).validate()
    with pytest.raises(ValueError, match="whole chunks"):
        tw.WgmmaGemmConfig("mcg", 4, 1, 1024, 512, splits=32).validate()
    with pytest.raises(ValueError, match="warpgroups 4 must be 1 or 2"):
        tw.WgmmaGemmConfig("mcg", 4, 1, 1024, 512, warpgroups=4).validate()
    with pytest.raises(ValueError, match="bytes of shared memory per CTA exceed"):
        tw.WgmmaGemmConfig("mcg", 8, 1, 1024, 512, m_tile=256, weight_ring=40).validate()


@needs_cutlass
@pytest.mark.parametrize("m_tile", [32, 128, 256])
def test_wgmma_d_fragments_and_epilogue_banks(m_tile):
    # Every (token, column) of a CTA's tile is one accumulator register of one lane (the
    # partials' stores and the fused epilogue both use d_fragment_position); the epilogue's
    # fp32 rows (EPILOGUE_ROW_WORDS words apart) put each register's 32 lanes in 32 banks, and
    # the rows' 16-byte reads stay inside one row.
    from exl3_jax.ffi import trellis_wgmma as tw
    warp, lane, i = np.meshgrid(np.arange(8), np.arange(32), np.arange(m_tile // 2),
                                indexing="ij")
    row, col = tw.d_fragment_position(warp, lane, i)
    cells = row * 128 + col
    assert sorted(cells.ravel()) == list(range(m_tile * 128))
    # one warpgroup's D rows: warp w % 4 holds rows 16 (w % 4) .. + 15 of its 64
    assert ((col // 16) == warp).all() and (col % 16 < 16).all()
    words = row * tw.EPILOGUE_ROW_WORDS + col
    for w in range(8):
        for r in range(m_tile // 2):
            assert len(set(words[w, :, r] % 32)) == 32
    assert tw.EPILOGUE_ROW_WORDS >= 128 and tw.EPILOGUE_ROW_WORDS % 4 == 0


def test_wgmma_plan_needs_hopper(monkeypatch):
    # The warpgroup MMA exists on sm_90a only: building the kernel config elsewhere is an error
    # that names the arch and the alternative, before anything is compiled.
    w = random_weight(np.random.default_rng(0), 512, 256, 4, "mcg")
    plan = plans.select_plan(100, 512, 256, force="wgmma")
    for arch in ("sm_120a", None):
        monkeypatch.setattr(aot, "device_arch", lambda arch=arch: arch)
        with pytest.raises(ValueError, match="needs a Hopper GPU.*tiles plan"):
            tg._tiles_config(w, plan)


def test_plan_forcing_and_errors(monkeypatch):
    assert plans.select_plan(3, 1024, 1024, force="prefill").kind == "prefill"
    with pytest.raises(ValueError):
        plans.select_plan(33, 1024, 1024, force="decode")
    with pytest.raises(ValueError):
        plans.select_plan(4, 1000, 1024)
    with pytest.raises(ValueError):
        plans.select_plan(0, 1024, 1024)
    w = random_weight(np.random.default_rng(0), 256, 256, 3, "mcg")
    monkeypatch.setenv(tg.PLAN_ENV, "prefill")
    assert tg.plan_for(4, w).kind == "prefill"
    monkeypatch.setenv(tg.PLAN_ENV, "auto")
    assert tg.plan_for(4, w).kind == "decode"
    # the decode kernel's cp.async ring: slots, unroll, splits (0: the plan's), register cap
    monkeypatch.setenv(tg.DECODE_RING_ENV, "3,2,0,6")
    auto = plans.select_plan(1, 256, 256)
    assert tg.plan_for(1, w) == dataclasses.replace(auto, ring=3, unroll=2, min_ctas=6)
    assert tg.plan_for(64, w).ring == 0                  # other plan kinds keep theirs
    monkeypatch.setenv(tg.DECODE_RING_ENV, "2,0,0,0,4")                # ... and warps
    assert tg.plan_for(1, w) == dataclasses.replace(auto, ring=2, warps=4)
    for bad in ("3,2", "3,2,0,6,4,1"):
        monkeypatch.setenv(tg.DECODE_RING_ENV, bad)
        with pytest.raises(ValueError, match="slots,unroll,splits"):
            tg.plan_for(1, w)
    # "off": one token past the row linear's size plans direct loads, as before the ring
    monkeypatch.setenv(tg.DECODE_RING_ENV, "off")
    big = (1, 8192, 8320)
    assert tg.plan_for_shape(*big) == plans.decode_plan(*big, sms=tg.device_sms(), ring=False)
    monkeypatch.delenv(tg.DECODE_RING_ENV)
    for arch, ring in (("sm_90a", plans.RING_SLOTS), ("sm_120a", 0)):   # the ring: Hopper only
        monkeypatch.setattr(aot, "device_arch", lambda arch=arch: arch)
        assert tg.plan_for_shape(*big).ring == ring
    # The device's arch decides whether auto may take wgmma (a CPU process: $CUTE_DSL_ARCH).
    for arch, kind in (("sm_90a", "wgmma"), ("sm_120a", "prefill"), (None, "prefill")):
        monkeypatch.setattr(aot, "device_arch", lambda arch=arch: arch)
        assert tg.plan_for(40, w).kind == kind and tg.plan_for(24, w).kind == "decode"
    monkeypatch.setenv(aot.ARCH_ENV, "sm_90a")
    assert aot.resolve_plan(40, 256, 256).kind == "wgmma"
    monkeypatch.setenv(aot.ARCH_ENV, "sm_120a")
    assert aot.resolve_plan(40, 256, 256).kind == "prefill"


@pytest.mark.parametrize("k,n", [(8192, 28672), (4096, 14336), (14336, 4096), (4096, 4096),
                                 (4096, 1024), (2048, 512), (2048, 151936)])
def test_plan_splits_balance_cta_work(k, n):
    """Each CTA gets at most TILES_PER_CTA weight tiles per token group (up to 2 groups) when a
    split allows it, the grid has >= MIN_CTAS CTAs where splitting can get there, and the split
    is the smallest such one (fewest fp32 partials)."""
    k16, n16 = k // 16, n // 16
    for m in (1, 8, 16, 32):
        p = plans.select_plan(m, k, n)
        if p.ring:              # one token past the row linear's size: test_ring_plan
            continue
        groups = min(p.m_tile // 8, 2)
        per_cta = k16 // p.splits * p.n_tiles
        ctas = n16 // p.n_tiles * p.splits
        allowed = [s for s in range(1, plans.MAX_SPLITS + 1)
                   if k16 % s == 0 and k16 // s >= 2 * p.warps]
        fits = [s for s in allowed
                if k16 // s * p.n_tiles <= plans.TILES_PER_CTA * groups
                and n16 // p.n_tiles * s >= min(plans.MIN_CTAS, n16 // p.n_tiles * allowed[-1])]
        assert p.splits == (fits[0] if fits else allowed[-1]), (m, p)
        if fits:
            assert per_cta <= plans.TILES_PER_CTA * groups
            assert ctas >= min(plans.MIN_CTAS, n16 // p.n_tiles * allowed[-1])
    # The H200 measurements behind the rule (bench/results/gpu_plan_sweep_h200_2026-12-03.json;
    # 8192x28672 m = 1 took 8 splits with direct loads, now the ring plan's 1).
    assert plans.select_plan(16, 8192, 28672).splits == 4
    assert plans.select_plan(1, 4096, 1024).splits == 8
    # A GPU with twice the SMs wants twice the CTAs before it stops splitting K.
    assert plans.select_plan(1, 4096, 1024, sms=2 * plans.DEFAULT_SMS).splits == 16


@pytest.mark.parametrize("k,n", [(8192, 28672), (4096, 28672), (28672, 8192), (4096, 128256),
                                 (8192, 8320), (16384, 4096), (4096, 14336), (128, 1 << 20)])
def test_ring_plan(k, n):
    """One token past ROW_LINEAR_MAX_WEIGHTS: the ring plan (RING_SLOTS slots, RING_UNROLL-step
    chunks, at least two whole chunks per warp) with the fewest K-splits that give two waves of
    RING_CTAS_PER_SM CTAs per SM, else the most splits allowed; the row linear's sizes (and
    shapes with no whole chunks per warp) keep the direct-load plan."""
    p = plans.select_plan(1, k, n, hopper=True)
    # elsewhere (sm_120a: 100 KB of shared memory per SM) direct loads
    assert plans.select_plan(1, k, n).ring == 0
    k16, ctas = k // 16, n // 16 // p.n_tiles
    chunk = p.warps * plans.RING_UNROLL
    allowed = [s for s in range(1, plans.MAX_SPLITS + 1)
               if k16 % (s * chunk) == 0 and k16 // (s * chunk) >= 2]
    if k * n <= plans.ROW_LINEAR_MAX_WEIGHTS or not allowed:
        assert p.ring == 0 and p == dataclasses.replace(plans.select_plan(2, k, n), m=1)
        return
    assert (p.ring, p.unroll) == (plans.RING_SLOTS, plans.RING_UNROLL), p
    waves = [s for s in allowed if ctas * s >= 2 * plans.RING_CTAS_PER_SM * plans.DEFAULT_SMS]
    assert p.splits == (waves[0] if waves else allowed[-1]), p
    # measured (H100, session 24): 8192x28672 one split (896 CTAs) against 2 and 4
    assert plans.select_plan(1, 8192, 28672, hopper=True).splits == 1
    # mul1's one token group (m 2..8) takes the same ring plan; 3inst / mcg, and weights of no
    # stated codebook, keep direct loads there; two groups (m 9..16) have no ring plan
    for m in (2, 5, 8):
        assert plans.select_plan(m, k, n, hopper=True, codebook="mul1") == \
            dataclasses.replace(p, m=m)
        for cb in ("mcg", "3inst", None):
            direct = plans.select_plan(m, k, n, hopper=True, codebook=cb)
            assert direct.ring == 0 and direct == plans.select_plan(m, k, n, codebook=cb)
    assert plans.select_plan(9, k, n, hopper=True, codebook="mul1").ring == 0
    assert plans.select_plan(4, k, n, codebook="mul1").ring == 0          # Hopper only


# --- B-fragment layout of the decode kernel's activation ----------------------------------


def b_fragment_positions(m_pad, k):
    """uint32 word of every element (row, kk) by the kernel-side formula, applied to numpy
    index arrays (the same function the input-transform kernel runs on DSL integers)."""
    row, kk = np.meshgrid(np.arange(m_pad), np.arange(k), indexing="ij")
    return b_fragment_word(*b_fragment_slot(row, kk), k // 16)


def rows_from_mma_words(xw, cfg, k):
    """fp16 [m_pad, k] from the decode kernel's activation words (the inverse of
    tg.mma_input_words), traceable (the emulated kernel runs under jit)."""
    xw = jnp.asarray(xw, jnp.uint32)
    if cfg.x_layout == "rows":
        return jax.lax.bitcast_convert_type(xw, jnp.float16).reshape(cfg.m_pad, k)
    if cfg.x_layout == "token":        # the padding tokens' lanes read token 0's words
        low = xw[token_fragment_word(np.arange(k))].astype(jnp.uint16)
        return jnp.tile(jax.lax.bitcast_convert_type(low, jnp.float16)[None], (cfg.m_pad, 1))
    if cfg.x_layout == "pairs":
        halves = jax.lax.bitcast_convert_type(xw, jnp.float16).reshape(-1)
        return halves[pair_fragment_positions(cfg.m_pad, k)]
    low = xw[b_fragment_positions(cfg.m_pad, k)].astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(low, jnp.float16)


def pair_fragment_positions(m_pad, k):
    """fp16 element (2 * word + half) of every (row, kk) in the "pairs" layout, by the
    kernel-side formula on numpy index arrays."""
    row, kk = np.meshgrid(np.arange(m_pad), np.arange(k), indexing="ij")
    G, kt, i, lane, h = pair_fragment_slot(row, kk)
    return 2 * pair_fragment_word(G, kt, i, lane, k // 16) + h


def test_pair_fragment_words_match_the_kernel_formula(rng):
    # The packed B-fragment layout ("pairs"): jnp's reshape/transpose equals the formula the
    # input transform writes with, every element once, and register i of lane 4 tok + t holds
    # k rows (2t, 2t+1) + 8i of token tok (PTX m16n8k16 B), one 128-byte line per register.
    m, m_pad, k = 13, 16, 256
    xh = rng.standard_normal((m, k)).astype(np.float16)
    words = np.asarray(tg.pair_fragment_words(jnp.asarray(xh), m_pad))
    assert words.size == m_pad * k // 2
    pos = pair_fragment_positions(m_pad, k)
    assert len(np.unique(pos)) == pos.size
    want = np.zeros((m_pad, k), np.float16)
    want[:m] = xh
    np.testing.assert_array_equal(words.view(np.float16)[pos], want)
    G, kt = 1, 5
    for lane in range(32):
        tok, t = 8 * G + lane // 4, lane % 4
        for i in (0, 1):
            w = words[pair_fragment_word(G, kt, i, lane, k // 16)]
            got = np.array([w & 0xFFFF, w >> 16], np.uint16).view(np.float16)
            np.testing.assert_array_equal(got, want[tok, 16 * kt + 8 * i + 2 * t:][:2])
    # The packed MMA on these words: A packs two k rows of a weight column per register.
    Wt = rng.standard_normal((16, 16)).astype(np.float16)       # [out column, k row]
    a = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            a[lane, i] = Wt[row, col:col + 2].view(np.uint32)[0]
    b = np.stack([[words[pair_fragment_word(0, 0, i, lane, k // 16)] for i in (0, 1)]
                  for lane in range(32)])
    d = mma_m16n8k16(a, b)
    ref = Wt.astype(np.float64) @ want[:8, :16].astype(np.float64).T      # [16, 8 tokens]
    lanes = np.arange(32)
    np.testing.assert_allclose(d[:, 1], ref[lanes // 4, 2 * (lanes % 4) + 1], rtol=1e-12)
    np.testing.assert_allclose(d[:, 2], ref[lanes // 4 + 8, 2 * (lanes % 4)], rtol=1e-12)


@pytest.mark.parametrize("m,rows", [(13, 16), (1, 1)])
def test_quad_fragment_words_match_the_kernel_formula(rng, m, rows):
    # The byte-sum kernels' "quads": jnp's reshape/transpose equals the index the input
    # transform writes with, every element once (one row: row-major), and lane 4 tok + t's two
    # words of a step are x rows 4t .. 4t + 3 of its token (cute_ops.BYTESUM_ELEMENTS).
    k = 256
    xh = rng.standard_normal((m, k)).astype(np.float16)
    words = np.asarray(tg.quad_fragment_words(jnp.asarray(xh), rows))
    assert words.size == rows * k // 2
    r, c = np.meshgrid(np.arange(rows), np.arange(k), indexing="ij")
    pos = quad_fragment_index(r, c, k // 16, min(rows, 8))
    assert len(np.unique(pos)) == pos.size
    want = np.zeros((rows, k), np.float16)
    want[:m] = xh
    np.testing.assert_array_equal(words.view(np.float16)[pos], want)
    if rows == 1:
        np.testing.assert_array_equal(words.view(np.float16), want[0])
        return
    G, kt = 1, 5
    block = (G * (k // 16) + kt) * 64
    for lane in range(32):
        tok, t = 8 * G + lane // 4, lane % 4
        got = words[block + 2 * lane:][:2].view(np.float16)
        np.testing.assert_array_equal(got, want[tok, 16 * kt + 4 * t:][:4])


def test_b_fragment_words_match_the_kernel_formula(rng):
    m, m_pad, k = 11, 16, 256
    xh = rng.standard_normal((m, k)).astype(np.float16)
    words = np.asarray(tg.b_fragment_words(jnp.asarray(xh), m_pad))
    assert words.size == m_pad * k
    pos = b_fragment_positions(m_pad, k)
    assert len(np.unique(pos)) == pos.size                 # a permutation of the buffer
    want = np.zeros((m_pad, k), np.float16)
    want[:m] = xh
    assert ((words >> 16) == (words & 0xFFFF)).all()       # each value in both halves
    np.testing.assert_array_equal(words[pos].astype(np.uint16), want.view(np.uint16))
    # The MMA's view: register i = 2h + r of lane 4 tok + t, group G, step kt holds k row
    # 2t + 8r + h of the PTX m16n8k16 B layout (even-k MMA: registers 0, 1; odd-k: 2, 3).
    G, kt, lane = 1, 3, 4 * 5 + 2
    tok, t = 8 * G + lane // 4, lane % 4
    for h in (0, 1):
        for r in (0, 1):
            got = words[b_fragment_word(G, kt, 2 * h + r, lane, k // 16)]
            assert got == want[tok, 16 * kt + 2 * t + 8 * r + h].view(np.uint16)


@needs_cutlass
def test_tiles_stage_and_b_fragment_indices(rng):
    # The large-tile kernel copies row-major activation words into padded shared-memory rows
    # (stage_unit) and reads B register r of lane l, token group g, step kk at b_word: that must
    # be token 8g + l // 4, k pair 2 (l % 4) + 8 r of the step (PTX m16n8k16 B fragment).
    from exl3_jax.ffi.trellis_tiles import ROW_PAD, TileGemmConfig, b_word, stage_unit
    cfg = TileGemmConfig("mcg", 4, 1, 1024, 1024, m_tile=64, k_chunk=4).validate()
    kc = cfg.k_chunk * 16
    x = rng.integers(0, 2**16, size=(cfg.m_tile, kc)).astype(np.uint16)
    words = x.view(np.uint32)                                 # [m_tile, kc / 2]
    smem = np.full(cfg.stage_words, 0xFFFFFFFF, np.uint32)
    units = np.arange(cfg.copy_units * cfg.threads)
    row, seg = stage_unit(cfg, units)
    assert units.size == cfg.m_tile * kc // 8                 # every 16-byte unit once
    for j in range(4):
        smem[row * cfg.row_words + seg * 4 + j] = words[row, seg * 4 + j]
    assert cfg.row_words * 2 == kc + ROW_PAD
    lanes = np.arange(32)
    for g in range(cfg.m_groups):
        for kk in range(cfg.k_chunk):
            for r in range(2):
                got = smem[b_word(cfg, g, kk, lanes, r)]
                want = words[8 * g + lanes // 4, kk * 8 + lanes % 4 + 4 * r]
                np.testing.assert_array_equal(got, want)
                # and no two lanes of a load share a bank unless they read the same word
                banks = b_word(cfg, g, kk, lanes, r) % 32
                assert len(set(banks)) == 32
    with pytest.raises(ValueError, match="multiple of 16"):
        TileGemmConfig("mcg", 4, 1, 1024, 1024, m_tile=40).validate()
    with pytest.raises(ValueError, match="whole chunks"):
        TileGemmConfig("mcg", 4, 1, 1024, 1024, splits=32).validate()


def test_token_fragment_words_match_the_kernel_formula(rng):
    # One token's layout: word (kt * 4 + t) * 4 + i holds what b_fragment_slot gives register
    # i of lane t (token 0); each lane's 4 registers of a step are contiguous (one LDG.128).
    k = 512
    xh = rng.standard_normal((1, k)).astype(np.float16)
    words = np.asarray(tg.token_fragment_words(jnp.asarray(xh)))
    pos = token_fragment_word(np.arange(k))
    assert words.size == k and sorted(pos) == list(range(k))
    assert ((words >> 16) == (words & 0xFFFF)).all()
    np.testing.assert_array_equal(words[pos].astype(np.uint16), xh[0].view(np.uint16))
    full = np.asarray(tg.b_fragment_words(jnp.asarray(xh), 8))
    for c in rng.integers(0, k, 24):
        G, kt, i, lane = b_fragment_slot(0, int(c))
        assert (G, lane // 4) == (0, 0)
        assert words[(kt * 4 + lane) * 4 + i] == full[b_fragment_word(G, kt, i, lane, k // 16)]


def mma_m16n8k16(a_words, b_words):
    """NumPy model of mma.sync m16n8k16 (f16 inputs, f32 accumulate) on per-lane fragments:
    a_words uint32 [32, 4], b_words uint32 [32, 2] -> d float64 [32, 4] (PTX fragment
    layouts; g = lane // 4, t = lane % 4)."""
    def halves(w):
        w = np.asarray(w, np.uint32)
        lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
        return lo, hi
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            A[row, col], A[row, col + 1] = (v[lane] for v in halves(a_words[:, i]))
        for i, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0, g], B[k0 + 1, g] = (v[lane] for v in halves(b_words[:, i]))
    D = A @ B
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    return np.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]], 1)


def test_mul1_split_sums_of_x(rng):
    # mma_chunk's xsum for mul1 split pairs: one k16 step's B-fragment words of 8 tokens taken
    # as the A operand against B = fp16 ones; mul1_affine reads token tau's sum as d0 + d2 of
    # lane 4 tau + t (any t) and gives column 2t + h (lane 4g + t) the value of lane 8t + 4h.
    k = 32
    xh = rng.standard_normal((8, k)).astype(np.float16)
    words = np.asarray(tg.b_fragment_words(jnp.asarray(xh), 8))
    for kt in range(k // 16):
        a = np.stack([[words[b_fragment_word(0, kt, i, lane, k // 16)] for i in range(4)]
                      for lane in range(32)])
        d = mma_m16n8k16(a, np.full((32, 2), 0x3C003C00, np.uint32))
        own = (d[:, 0] + d[:, 2]) / 2
        sums = xh[:, 16 * kt:16 * kt + 16].astype(np.float64).sum(1)
        np.testing.assert_allclose(own, sums[np.arange(32) // 4], rtol=1e-12)
        lanes = np.arange(32)
        for h in (0, 1):
            np.testing.assert_allclose(own[8 * (lanes % 4) + 4 * h], sums[2 * (lanes % 4) + h],
                                       rtol=1e-12)
    # The split-pair weight MMA itself: A registers (lo, hi) of one weight each against these
    # B words gives (lo + hi) * x, one column per token (even-k MMA: registers 0, 1).
    lo_hi = rng.standard_normal((32, 4, 2)).astype(np.float16)
    a = (lo_hi[..., 0].view(np.uint16).astype(np.uint32)
         | (lo_hi[..., 1].view(np.uint16).astype(np.uint32) << 16))
    b = np.stack([[words[b_fragment_word(0, 0, i, lane, k // 16)] for i in (0, 1)]
                  for lane in range(32)])
    d = mma_m16n8k16(a, b)
    w = lo_hi.astype(np.float64).sum(-1)                      # [lane, reg]
    W = np.zeros((16, 16))
    for lane in range(32):                                   # even k rows 2t (reg 0, 2 / cols)
        g, t = divmod(lane, 4)
        for i, (row, kk) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                       (g + 8, 2 * t + 8))):
            W[row, kk] = w[lane, i]
    want = W[:, 0::2] @ xh[:, 0:16:2].astype(np.float64).T   # [16 rows, 8 tokens]
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    np.testing.assert_allclose(d[:, 0], want[g, 2 * t], rtol=1e-12)
    np.testing.assert_allclose(d[:, 3], want[g + 8, 2 * t + 1], rtol=1e-12)


@needs_cutlass
def test_hadamard_input_layout_is_checked():
    from exl3_jax.ffi.hadamard import HadamardConfig
    cfg = HadamardConfig(rows=16, valid=3, width=256, layout="fragments")
    assert cfg.out_size == 2 * 16 * 256
    with pytest.raises(ValueError, match="'b_packed' is not one of"):
        HadamardConfig(rows=16, valid=3, width=256, layout="b_packed")
    assert HadamardConfig(rows=1, valid=1, width=256, layout="token").out_size == 2 * 256
    with pytest.raises(ValueError, match="holds one row"):
        HadamardConfig(rows=8, valid=1, width=256, layout="token")


def test_hadamard_configs_split_rows_and_name_members():
    from exl3_jax.ffi.hadamard import WARPS, HadamardConfig
    dec = HadamardConfig.input(8, 1, 3 * 4096, layout="fragments", inputs=3)
    assert dec.per_warp == 1 and dec.row_ctas == 96 // WARPS and dec.in_grid == (8 * 12, 1, 1)
    assert dec.x_width == 4096 and dec.max_steps == 2           # 8-element (16-byte) steps
    assert dec.load_batch(16) == 6 and dec.load_batch(32) == 4  # LOAD_REGS 96 // regs per step
    pre = HadamardConfig.input(64, 40, 14336)                  # prefill: one CTA per row
    assert pre.row_ctas == 1 and pre.per_warp * WARPS >= 112 and pre.in_grid == (64, 1, 1)
    out = HadamardConfig(rows=3, valid=3, width=640, members=(384, 128, 128),
                         biased=(True, False, True))
    assert out.member_starts == (0, 384, 512) and out.has_bias(2) and not out.has_bias(1)
    assert HadamardConfig(rows=1, valid=1, width=256).out_members == (256,)
    with pytest.raises(ValueError, match="summing to width"):
        HadamardConfig(rows=1, valid=1, width=640, members=(384, 128))
    with pytest.raises(ValueError, match="does not match members"):
        HadamardConfig(rows=1, valid=1, width=640, members=(384, 256), biased=(True,))
    with pytest.raises(ValueError, match="at most 3"):
        HadamardConfig(rows=1, valid=1, width=512, inputs=4)


# --- plumbing with emulated kernels --------------------------------------------------------


@pytest.fixture
def emulated_kernels(monkeypatch):
    """Replace the CuTe calls by jnp code with the same contracts (flat layouts, K-split
    partials, zero padded rows, W_hat or the fp16 layer weight, transforms), so everything
    around them runs on CPU."""
    from exl3_jax.trellis import hadamard128
    calls = []

    def mma_partials_words(xw, w, plan, out_init=None):
        cfg = tg._mma_config(w, plan)
        calls.append(("decode", cfg))
        xh = rows_from_mma_words(xw, cfg, w.k)
        wh = decode_trellis(w.trellis, w.codebook).astype(jnp.float32)
        ks = w.k // cfg.splits
        parts = [jnp.matmul(xh[:, s * ks:(s + 1) * ks].astype(jnp.float32),
                            wh[s * ks:(s + 1) * ks], precision="highest")
                 for s in range(cfg.splits)]
        return jnp.stack(parts).reshape(-1)

    def mma_group_partials_words(xw, ws, plan, out_init=None):
        cfg = tg._group_config(ws, plan)
        calls.append(("group", cfg))
        xh = rows_from_mma_words(xw, cfg, cfg.x_k16 * 16)          # [m_pad, G * k]
        ks = cfg.k // cfg.splits
        parts = []
        for s in range(cfg.splits):
            cols = []
            for i, w in enumerate(ws):
                wh = decode_trellis(w.trellis, w.codebook).astype(jnp.float32)
                xi = xh[:, i * cfg.k:(i + 1) * cfg.k].astype(jnp.float32)
                cols.append(jnp.matmul(xi[:, s * ks:(s + 1) * ks], wh[s * ks:(s + 1) * ks],
                                       precision="highest"))
            parts.append(jnp.concatenate(cols, axis=1))
        return jnp.stack(parts).reshape(-1)

    def tiles_partials_words(xw, w, plan, out_init=None, scale=None):
        cfg = tg._tiles_config(w, plan)
        calls.append((plan.kind + ("+out" if plan.fused_out else ""), cfg))
        xh = jax.lax.bitcast_convert_type(jnp.asarray(xw, jnp.uint32), jnp.float16).reshape(
            cfg.m_pad, w.k).astype(jnp.float32)
        wh = decode_trellis(w.trellis, w.codebook).astype(jnp.float32)
        ks = w.k // cfg.splits
        parts = [jnp.matmul(xh[:, s * ks:(s + 1) * ks], wh[s * ks:(s + 1) * ks],
                            precision="highest") for s in range(cfg.splits)]
        if plan.fused_out:                 # the epilogue: output transform, padded rows too
            return tg.output_transform(parts[0], w.svh, w.bias, scale[:, None]).reshape(-1)
        return jnp.stack(parts).reshape(-1)

    def dequantize_f16(w, *, rotate, scale=None, out_init=None):
        cfg = tg._dequant_config(w, rotate)
        calls.append(("prefill", cfg))
        if not rotate:
            return decode_trellis(w.trellis, w.codebook)
        s = 1.0 if scale is None else jnp.asarray(scale, jnp.float32)[0]
        return (dequantize(w.trellis, w.suh, w.svh, w.codebook) * s).astype(jnp.float16)

    def hadamard_in(x, suh, m_pad, layout="rows"):
        if isinstance(suh, (list, tuple)):                              # a group's members
            suh = jnp.concatenate(suh)
        m = x.shape[0]
        scale = tg.row_scale(x, suh)                                    # [m, 1]
        x = jnp.tile(jnp.asarray(x), (1, suh.shape[0] // x.shape[1]))   # a group: one copy each
        xs = jnp.asarray(x, jnp.float32) * jnp.asarray(suh, jnp.float32) / scale
        xs = jnp.pad(xs, ((0, m_pad - m), (0, 0)))
        xh = hadamard128(xs).astype(jnp.float16)
        scale = jnp.pad(scale[:, 0], (0, m_pad - m), constant_values=1.0)
        if layout == "rows":
            return xh.reshape(-1), scale
        words = {"token": lambda: tg.token_fragment_words(xh),
                 "pairs": lambda: tg.pair_fragment_words(xh, m_pad),
                 "fragments": lambda: tg.b_fragment_words(xh, m_pad)}[layout]()
        return jax.lax.bitcast_convert_type(words, jnp.float16).reshape(-1), scale

    def hadamard_out(part, svh, bias, scale, *, m, m_pad, splits, n):
        if isinstance(svh, (list, tuple)):                              # a group's members
            bias = (None if all(b is None for b in bias) else jnp.concatenate(
                [jnp.zeros(v.shape, jnp.float16) if b is None else b for b, v in zip(bias, svh)]))
            svh = jnp.concatenate(svh)
        y = jnp.sum(part.reshape(splits, m_pad, n), axis=0)[:m]
        return tg.output_transform(y, svh, bias, None if scale is None else scale[:m, None])

    def row_linear(x2, ws, cfg, poison=False):
        # One custom call: per member, each K-split range rotated with its own power-of-two
        # scale s_c, its partial product times s_c, then the output transform (row scale 1).
        ws = list(ws) if isinstance(ws, (list, tuple)) else [ws]
        calls.append(("row", cfg))
        c = cfg.mma
        ks = c.k // c.splits
        ys = []
        for w in ws:
            x = jnp.asarray(x2, jnp.float32)
            wh = decode_trellis(w.trellis, w.codebook).astype(jnp.float32)
            y = 0.0
            for s in range(c.splits):
                seg, suh = x[:, s * ks:(s + 1) * ks], w.suh[s * ks:(s + 1) * ks]
                sc = tg.row_scale(seg, suh)                              # [1, 1]
                xh = hadamard128(seg * jnp.asarray(suh, jnp.float32) / sc).astype(jnp.float16)
                y = y + jnp.matmul(xh.astype(jnp.float32), wh[s * ks:(s + 1) * ks],
                                   precision="highest") * sc
            ys.append(tg.output_transform(y, w.svh, w.bias, None))
        return jnp.concatenate(ys, axis=1)

    monkeypatch.setattr(tg, "_cutlass_jax_ok", lambda: True)
    monkeypatch.setattr(aot, "device_arch", lambda: "sm_90a")       # the wgmma plan's check
    for name, fn in (("mma_partials_words", mma_partials_words), ("hadamard_in", hadamard_in),
                     ("row_linear", row_linear),
                     ("mma_group_partials_words", mma_group_partials_words),
                     ("hadamard_out", hadamard_out),
                     ("tiles_partials_words", tiles_partials_words),
                     ("dequantize_f16", dequantize_f16)):
        monkeypatch.setattr(tg, name, fn)
    return calls


@pytest.mark.parametrize("transforms", ["cute", "xla"])
@pytest.mark.parametrize("m,kind", [(1, "decode"), (5, "decode"), (32, "decode"),
                                    (33, "prefill"), (3, "prefill"), (70, "tiles"),
                                    (40, "tiles"), (70, "wgmma"), (300, "wgmma"),
                                    (70, "wgmma:64,2,1")])
@pytest.mark.parametrize("codebook,K", [("mul1", 3.5), ("mcg", 3)])   # packed / split B words
def test_gpu_path_plumbing(rng, emulated_kernels, m, kind, transforms, codebook, K):
    w = random_weight(rng, 512, 256, K, codebook, bias=True)
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
    plan = kind if ":" not in kind else plans.tiled_plan(kind.split(":")[0], m, 512, 256,
                                                          kind.split(":")[1])
    y = tg.trellis_matmul_gpu(x, w, plan=plan, transforms=transforms)
    ref = linear_reference(x, w.trellis, w.suh, w.svh, w.codebook, w.bias)
    assert y.shape == (m, 256) and y.dtype == jnp.float32
    rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-3                              # fp16 rounding of xh only
    # one token (cute transforms): the row linear, one custom call; a wgmma plan with one
    # K-split: the output transform in its epilogue (the xla transforms take the partials)
    row = m == 1 and kind == "decode" and transforms == "cute"
    fused = ":" in kind and transforms == "cute"
    assert emulated_kernels[-1][0] == ("row" if row else "wgmma+out" if fused else
                                       kind.split(":")[0])


def test_row_scale_is_the_smallest_power_of_two(rng):
    # The fp16 boundary of the Hadamard kernels (ffi/hadamard.py): per row the smallest power of
    # two s >= max|x * suh| / 4096 with s >= 1, the max over every member's copy for a group;
    # exponent arithmetic vs float64 NumPy, including maxima exactly on and just past 4096 * 2^j.
    k = 256
    mags = np.concatenate([[0.0, 1e-30, 1.0, 4096.0, 4097.0, 8192.0, 8192.5, 1e38],
                           10.0 ** rng.uniform(-3, 9, 24)])
    x = rng.standard_normal((mags.size, k)).astype(np.float32)
    suh = np.concatenate([rng.uniform(0.5, 2.0, k), rng.uniform(0.01, 0.5, k)]).astype(
        np.float16)
    amax_target = np.float32(mags)
    # place each row's max at one element of the first copy: |x * suh| there equals the target
    x = np.clip(x, -0.5, 0.5) * np.float32(1e-4)
    col = rng.integers(0, k, mags.size)
    col[:8] = 0                                   # suh 1 there: the boundary rows exactly
    suh[0] = 1.0
    x[np.arange(mags.size), col] = amax_target / suh[col].astype(np.float32)
    got = np.asarray(tg.row_scale(x, suh))[:, 0]
    prod = np.abs(np.tile(x.astype(np.float64), (1, 2)) * suh.astype(np.float64))
    amax = np.max(prod.astype(np.float32), axis=1).astype(np.float64)
    want = np.maximum(1.0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-300) / 4096.0)))
    np.testing.assert_array_equal(got, want)
    assert got[3] == 1 and got[4] == 2 and got[5] == 2 and got[6] == 4
    assert np.all(amax / got <= 4096) and np.all((amax / got > 2048) | (got == 1))


@pytest.mark.parametrize("amax", [0.0, 1.0, 32768.0, 32769.0, 65536.0, 65537.0, 1e6, 3e38])
def test_prefill_scale_is_the_smallest_power_of_two(rng, amax):
    # The prefill plan's one scale for the whole batch: the smallest power of two s >= max|x|
    # / 2^15 with s >= 1, so fp16(x / s) stays finite; exponent arithmetic vs float64 NumPy,
    # with the maximum placed at a random element, exactly on and just past 2^15 * 2^j.
    x = (rng.standard_normal((5, 256)) * 1e-3).astype(np.float32)
    x[rng.integers(5), rng.integers(256)] = np.float32(amax) * rng.choice([-1, 1])
    got = np.asarray(tg.prefill_scale(x))
    top = float(np.max(np.abs(x.astype(np.float64))))
    want = max(1.0, 2.0 ** np.ceil(np.log2(max(top, 1e-300) / 2.0 ** 15)))
    assert got.shape == (1,) and got[0] == want
    assert top / got[0] <= 2.0 ** 15 and np.all(np.isfinite((x / got[0]).astype(np.float16)))


@pytest.mark.parametrize("m,kind", [(3, "decode"), (3, "prefill")])
def test_gpu_path_keeps_overflowing_rows_finite(rng, emulated_kernels, m, kind):
    # Rows whose rotated fp16 operand would overflow: x * suh constant (H128 gathers 11.3x of it
    # into one element) and a bf16 row of ~1e6; the kernels' contract (row scale in, back out)
    # keeps them finite and accurate, and leaves the ordinary row's operand unscaled.
    from exl3_jax.trellis import dequantize, hadamard128
    w = random_weight(rng, 256, 128, 4, "mcg", bias=True)
    x = rng.standard_normal((m, 256))
    x[1] = 6000.0 / np.asarray(w.suh, np.float64)
    x[2] *= 1e6
    xb = jnp.asarray(x, jnp.bfloat16)
    y = np.asarray(tg.trellis_matmul_gpu(xb, w, plan=kind), np.float64)
    dense = np.asarray(dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64)
    want = np.asarray(xb, np.float64) @ dense + np.asarray(w.bias, np.float64)
    assert np.all(np.isfinite(y))
    for r in range(m):
        assert np.linalg.norm(y[r] - want[r]) / np.linalg.norm(want[r]) < 2e-3, r
    s = np.asarray(tg.row_scale(xb, w.suh))[:, 0]
    assert s[0] == 1 and s[1] == 2 and s[2] >= 2 ** 6
    unscaled = np.asarray(hadamard128(jnp.asarray(xb[1:2], jnp.float32) * w.suh.astype(
        jnp.float32)))
    assert np.max(np.abs(unscaled)) > 65504      # the case the scale is there for


def test_gpu_path_leading_axes_and_dispatch(rng, emulated_kernels, monkeypatch):
    from exl3_jax.ops import trellis_matmul
    w = random_weight(rng, 256, 384, 2, "3inst")
    w = Exl3Weight.create(w.trellis, w.suh, w.svh, "3inst", in_features=200, out_features=300)
    x = jnp.asarray(rng.standard_normal((2, 3, 200)), jnp.bfloat16)
    y = jax.jit(lambda x, w: trellis_matmul(x, w, backend="gpu"))(x, w)
    r = jax.jit(lambda x, w: trellis_matmul(x, w, backend="reference"))(x, w)
    assert y.shape == r.shape == (2, 3, 300)
    assert float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r)) < 1e-3
    assert emulated_kernels and emulated_kernels[-1][0] == "decode"   # m = 6 rows


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("codebook,K", [("mcg", 3), ("mul1", 4)])   # split / packed B words
@pytest.mark.parametrize("members", [(256, 128, 128), (384, 384)])
def test_linear_group_matches_its_members(rng, emulated_kernels, m, codebook, K, members):
    # q/k/v-like members reading one x: one input transform, one decode launch, one output
    # transform; each member's columns equal its own reference linear (member 0 has a bias).
    from exl3_jax.ops import trellis_matmul_group
    ws = [random_weight(rng, 512, n, K, codebook, bias=i == 0) for i, n in enumerate(members)]
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
    ys = jax.jit(lambda x, ws: trellis_matmul_group(x, ws, backend="gpu"))(x, ws)
    assert [c[0] for c in emulated_kernels] == ["row" if m == 1 else "group"]
    cfg = emulated_kernels[0][1]
    cfg = cfg.mma if m == 1 else cfg
    assert cfg.members == members and cfg.n == sum(members)
    assert m == 1 or cfg.x_k16 == 32 * len(members)
    for y, w in zip(ys, ws):
        ref = linear_reference(x, w.trellis, w.suh, w.svh, w.codebook, w.bias)
        assert y.shape == ref.shape
        assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-3


def _members_against_reference(rng, m, members, K, codebook):
    """A linear group of ``members`` (or one 384-wide linear for ()) with biases on a random
    [m, 512] x through the GPU dispatch (emulated kernels); each member's output within 1e-3
    of linear_reference. Returns the weights."""
    from exl3_jax.ops import trellis_matmul_group
    ws = [random_weight(rng, 512, n, K, codebook, bias=True) for n in members or (384,)]
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
    ys = (trellis_matmul_group(x, ws, backend="gpu") if members
          else [tg.trellis_matmul_gpu(x, ws[0])])
    for y, w in zip(ys, ws):
        ref = linear_reference(x, w.trellis, w.suh, w.svh, w.codebook, w.bias)
        assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-3
    return ws


@pytest.mark.parametrize("codebook,K", [("mcg", 4), ("mul1", 3)])
@pytest.mark.parametrize("members", [(), (256, 128, 128)])
def test_one_token_decode_plan(rng, emulated_kernels, monkeypatch, codebook, K, members):
    # m = 1 through the three calls (no row linear): the one-token activation words, and the
    # kernel's padding token rows (copies of row 0 there) never reach the result.
    monkeypatch.setenv(tg.ROW_LINEAR_ENV, "0")
    ws = _members_against_reference(rng, 1, members, K, codebook)
    cfg = emulated_kernels[-1][1]
    assert cfg.one_token and cfg.x_layout == "token" and cfg.m_pad == 8
    monkeypatch.setenv(tg.ONE_TOKEN_ENV, "0")
    assert not tg._mma_config(ws[0], plans.select_plan(1, 512, ws[0].n)).one_token
    cls = type(cfg)
    with pytest.raises(ValueError, match="one token tile"):      # two token tiles
        cls(codebook, K, m_blocks=2, k=512, n=256, one_token=True).validate()


@pytest.mark.parametrize("members", [(), (256, 128, 128)])
def test_pair_fragment_plumbing(rng, emulated_kernels, monkeypatch, members):
    # m = 12 (two token groups, packed: K3, where split pairs stop at one group), default
    # (EXL3_JAX_PAIR_FRAGMENTS unset: "pairs"): the input transform's "pairs" words reach the
    # kernel (emulated), the result is the reference's; EXL3_JAX_PAIR_FRAGMENTS=0: rows.
    monkeypatch.delenv(tg.PAIR_FRAGMENTS_ENV, raising=False)
    ws = _members_against_reference(rng, 12, members, 3, "mcg")
    cfg = emulated_kernels[-1][1]
    assert cfg.pair_fragments and cfg.x_layout == "pairs" and cfg.m_groups == 2
    monkeypatch.setenv(tg.PAIR_FRAGMENTS_ENV, "0")
    assert tg._mma_config(ws[0], plans.select_plan(12, 512, ws[0].n)).x_layout == "rows"


def test_linear_group_falls_back_per_member(rng, emulated_kernels, monkeypatch):
    from exl3_jax.ops import trellis_matmul_group
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    mixed_k = [random_weight(rng, 256, 128, 3, "mcg"), random_weight(rng, 256, 128, 4, "mcg")]
    ys = trellis_matmul_group(x, mixed_k, backend="gpu")
    assert [c[0] for c in emulated_kernels] == ["decode", "decode"]
    for y, w in zip(ys, mixed_k):
        ref = linear_reference(x, w.trellis, w.suh, w.svh, w.codebook)
        assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-3
    # Above the decode plan's rows each member runs alone, on the plan auto gives it: wgmma on
    # Hopper for up to 128 rows, prefill elsewhere; a group of 25..32 rows stays on the decode
    # group kernel on Hopper too.
    x40 = jnp.asarray(rng.standard_normal((40, 256)), jnp.float32)
    x28 = x40[:28]
    same = [mixed_k[0], mixed_k[0]]
    for arch, kind in (("sm_90a", "wgmma"), ("sm_120a", "prefill")):
        monkeypatch.setattr(aot, "device_arch", lambda arch=arch: arch)
        emulated_kernels.clear()
        ys = trellis_matmul_group(x40, same, backend="gpu")
        assert [c[0].split("+")[0] for c in emulated_kernels] == [kind, kind]
        ref = linear_reference(x40, same[0].trellis, same[0].suh, same[0].svh, "mcg")
        assert all(float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-3 for y in ys)
        emulated_kernels.clear()
        trellis_matmul_group(x28, same, backend="gpu")
        assert [c[0] for c in emulated_kernels] == ["group"]


def test_models_project_their_shared_inputs_as_groups(rng, emulated_kernels, monkeypatch):
    # The Flax modules route q/k/v and gate/up through one group each (nn.linear.project); with
    # the GPU backend (emulated kernels) the MLP equals its reference-backend result.
    from exl3_jax.nn.linear import Exl3Linear, project
    from exl3_jax.nn.mlp import GatedMLP
    x = jnp.asarray(rng.standard_normal((1, 3, 256)), jnp.bfloat16)
    mlp = GatedMLP(*(Exl3Linear(random_weight(rng, k, n, 4, "mcg"))
                     for k, n in ((256, 384), (256, 384), (384, 256))))
    monkeypatch.setenv("EXL3_JAX_BACKEND", "reference")
    want = mlp(x)
    monkeypatch.setenv("EXL3_JAX_BACKEND", "gpu")
    got = mlp(x)
    assert [c[0] for c in emulated_kernels] == ["group", "decode"]      # gate/up, then down
    rel = float(jnp.linalg.norm((got - want).astype(jnp.float32)) /
                jnp.linalg.norm(want.astype(jnp.float32)))
    assert got.dtype == jnp.bfloat16 and rel < 1e-2                    # bf16 outputs
    emulated_kernels.clear()
    qkv = [Exl3Linear(random_weight(rng, 256, n, 3, "mcg")) for n in (256, 128, 128)]
    ys = project(x, qkv)
    assert [c[0] for c in emulated_kernels] == ["group"]
    assert [y.shape for y in ys] == [(1, 3, 256), (1, 3, 128), (1, 3, 128)]
    qkv[1].cache_dequantized()               # a member with a dense cache: each one alone
    emulated_kernels.clear()
    project(x, qkv)
    assert [c[0] for c in emulated_kernels] == ["decode", "decode"]


def test_row_linear_shared_memory_is_b_fragment_order():
    # The row linear keeps its rotated k range in shared memory; the k loop of lane t reads
    # step kt's register i at (kt * 4 + i) * 4 + t. For split pairs that must be the element
    # b_fragment_slot gives register i of lanes t (token 0) and every element exactly once.
    # (Packed kernels store row order: hadamard.store_rotated's base + c.)
    n = 256
    slots = [row_fragment_slot(c) for c in range(n)]
    assert sorted(slots) == list(range(n))
    for c in range(n):
        G, kt, i, lane = b_fragment_slot(0, c)
        assert G == 0 and lane < 4 and slots[c] == (kt * 4 + i) * 4 + lane


@needs_cutlass
def test_row_linear_config(rng, monkeypatch):
    # One token of a decode plan runs as the row linear when a row tiling fits (whole
    # 128-blocks per K-split, each member's columns a multiple of the CTA's); anything else
    # keeps the three calls, and EXL3_JAX_ROW_LINEAR=0 turns it off.
    from exl3_jax.ffi import trellis_linear
    from exl3_jax.ffi.trellis_linear import MAX_SPLITS, row_plan
    w = random_weight(rng, 512, 256, 4, "mcg", bias=True)
    cfg = tg._row_linear_config(w, plans.select_plan(1, 512, 256, force="decode"))
    c = cfg.mma
    assert (c.k, c.n, c.members, c.warps) == (512, 256, (), 8) and cfg.pdl
    assert (cfg.out.rows, cfg.out.width, cfg.out.splits, cfg.out.part_rows) == (
        1, 256, c.splits, 1) and cfg.out.biased == (True,)
    assert tg._row_linear_config(w, plans.select_plan(2, 512, 256, force="decode")) is None
    assert tg._row_linear_config(w, plans.select_plan(1, 512, 256, force="prefill")) is None
    ws = [w, random_weight(rng, 512, 128, 4, "mcg")]
    g = tg._row_linear_config(ws, plans.select_plan(1, 512, 384, force="decode"))
    assert g.mma.members == (256, 128) and g.out.members == (256, 128)
    assert g.out.biased == (True, False)
    # Every plan: whole 128-blocks per split, each warp a whole number of chunks, each member
    # whole CTAs, the grid filled or K split as far as it goes.
    for k, n, members in ((4096, 6144, (4096, 1024, 1024)), (14336, 4096, ()),
                          (4096, 14336, ()), (4096, 2048, ()), (2048, 5120, (4096, 512, 512)),
                          (768, 2048, ()), (512, 384, (256, 128))):
        p = row_plan("mcg", 4, k, n, members, sms=132)
        assert p is not None and p.splits <= MAX_SPLITS
        assert (p.k_per_split * 16) % 128 == 0
        assert p.k_per_split % (p.warps_k * p.unroll) == 0
        assert all(n16 % p.cta_n16 == 0 for _, n16 in p.member_tiles)
        assert p.grid[0] * p.grid[1] >= 264 or p.k_per_split == p.warps_k * p.unroll
    assert row_plan("mcg", 4, 128, 256) is None                 # k = 128: no whole chunk row
    assert row_plan("mcg", 4, 8192, 28672) is None              # > MAX_WEIGHTS: three calls
    assert row_plan("mcg", 4, 4096, 28672, (14336, 14336)) is None
    assert row_plan("mcg", 4, 256, 272, (256, 16)) is None      # a member of one n16 tile
    monkeypatch.setenv(tg.ROW_LINEAR_ENV, "0")
    assert tg._row_linear_config(w, plans.select_plan(1, 512, 256, force="decode")) is None
    # "all": no size gate (what the validation and A/B runs use past MAX_WEIGHTS)
    assert row_plan("mcg", 4, 8192, 28672, max_weights=None).splits > 1
    big = random_weight(rng, 256, 128, 4, "mcg")
    monkeypatch.setattr(trellis_linear, "MAX_WEIGHTS", 256 * 64)
    assert tg._row_linear_config(big, plans.select_plan(1, 256, 128, force="decode")) is None
    monkeypatch.setenv(tg.ROW_LINEAR_ENV, "all")
    assert tg._row_linear_config(big, plans.select_plan(1, 256, 128, force="decode")) is not None


def test_group_config_checks():
    from exl3_jax.ffi.trellis_mma import MmaConfig
    base = dict(codebook="mcg", K=4, m_blocks=1, k=256, n=512, unroll=2)
    assert MmaConfig(**base, members=(256, 128, 128)).validate().member_tiles == \
        ((0, 16), (16, 8), (24, 8))
    with pytest.raises(ValueError, match="summing to n=512"):
        MmaConfig(**base, members=(256, 128)).validate()
    with pytest.raises(ValueError, match="2..3 members"):
        MmaConfig(**base, members=(128,) * 4).validate()
    with pytest.raises(ValueError, match="multiple of 16 \\* n_tiles"):
        MmaConfig(**base, members=(496, 16)).validate()


def test_ring_config_layouts():
    # The cp.async ring takes B words in a fragment order ("fragments", "pairs", "token"), whose
    # k16 steps are contiguous per token group; row-major pairs are refused by name.
    from exl3_jax.ffi.trellis_mma import MmaConfig
    from exl3_jax.ffi.trellis_geometry import LANES, P_REGS, lane_geometry
    base = dict(codebook="mul1", K=3, m_blocks=1, k=1024, n=256, m_tile=16, unroll=2, ring=3)
    pairs = MmaConfig(**base, pair_fragments=True).validate()
    assert pairs.x_layout == "pairs" and pairs.x_step_words == LANES * P_REGS
    assert pairs.ring_slot_words == (pairs.unroll * pairs.n_tiles * lane_geometry(3).words
                                     + 2 * pairs.unroll * LANES * P_REGS)
    with pytest.raises(ValueError, match="fragment order, got ring=3, layout 'rows'"):
        MmaConfig(**base).validate()


def test_trellis_words_is_the_spec_pairing(rng):
    t = rng.integers(-32768, 32768, size=(2, 3, 48), dtype=np.int64).astype(np.int16)
    u = t.view(np.uint16).astype(np.uint32)
    want = (u[..., 0::2] | (u[..., 1::2] << 16)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(tg.trellis_words(jnp.asarray(t))), want)


# --- compile-only (CuTe DSL -> cubin) and export lowering ---------------------------------

# Every template parameter value at least once per arch: each rate K (2..8, 2.5, 3.5), each
# codebook, both plan kinds, each decode token tile (m_tile 8 / 16 / 24 / 32), each load unroll
# (1 / 2 / 4 / 8) and K-splits > 1 (the last two cases; the plan picks them from the shape);
# the dequantize kernel's other form (rotation off, W_hat) in test_compile_only_other_forms.
COMPILE_CASES = [
    ("3inst", 2, 1, "decode"), ("mcg", 3, 16, "decode"), ("mul1", 4, 32, "decode"),
    ("mcg", 5, 7, "decode"), ("3inst", 6, 40, "prefill", 8192, 28672), ("mul1", 7, 2, "decode"),
    ("mcg", 8, 64, "prefill"), ("mul1", 2.5, 1, "decode"),
    ("mul1", 3.5, 33, "prefill", 8192, 28672), ("3inst", 4, 128, "prefill"),
    ("mcg", 2, 100, "prefill", 8192, 28672), ("mul1", 3, 24, "decode"),
    ("mul1", 4, 1, "decode", 4096, 8192), ("mcg", 3, 8, "decode", 4096, 1024),
    # one token past the row linear's size: the decode kernel's cp.async ring (K8: 4-step chunks)
    ("mcg", 4, 1, "decode", 8192, 8320), ("mul1", 8, 1, "decode", 8192, 8320),
    # linear groups (q/k/v-like, gate/up-like): split and packed B words
    ("mcg", 4, 1, "decode", 512, 512, (256, 128, 128)), ("mul1", 3, 12, "decode", 256, 512,
                                                          (256, 256)),
]


def test_compile_cases_cover_the_plan_parameters():
    # as sm_90a plans them (the ring plan is Hopper's; sm_120a compiles it in the emulated
    # ring test)
    seen = [plans.select_plan(c[2], *(c[4:6] if len(c) > 4 else (256, 256)), force=c[3],
                              hopper=True)
            for c in COMPILE_CASES]
    dec = [p for p in seen if p.kind == "decode"]
    assert {p.m_tile for p in dec} == {8, 16, 24, 32}
    assert {p.unroll for p in dec} == {1, 2, 4, 8}
    assert any(p.splits > 1 for p in dec)
    assert {p.ring for p in dec} == {0, plans.RING_SLOTS}
    assert {c[1] for c in COMPILE_CASES} == {2, 2.5, 3, 3.5, 4, 5, 6, 7, 8}
    assert {c[0] for c in COMPILE_CASES} == {"3inst", "mcg", "mul1"}


# The kernels' other forms, in one process: the mul1 decode kernels' (EXL3_JAX_MUL1_BYTESUM,
# trellis_gemm.MUL1_BYTESUM_ENV: one token through the ring, one token group's and three token
# groups' direct loads, a half rate) and, with the jnp transforms (EXL3_JAX_TRANSFORMS=xla),
# the dequantize kernel with its rotation off (W_hat: the transforms' prefill path and the GPU
# validation's decode check); no spills.
OTHER_FORM_CASES = [("mul1", 4, 1, "decode", 8192, 8320), ("mul1", 3, 24, "decode"),
                    ("mul1", 2.5, 7, "decode"), ("mcg", 4, 40, "prefill")]


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compile_only_other_forms(arch, tmp_path):
    other = "0" if tg._mul1_bytesum() else "1"
    env = {"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           tg.MUL1_BYTESUM_ENV: other, tg.TRANSFORMS_ENV: "xla"}
    rows = check_rows("exl3_jax.ffi.aot", OTHER_FORM_CASES, arch, timeout=600, env=env)
    assert rows[-1]["kernels"] == ["_trellis_dequant_kernel"], rows[-1]
    if helpers_sass.nvdisasm() is not None:
        assert helpers_sass.spilling_cubins(tmp_path) == {}


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compile_only(arch, tmp_path):
    # had_in, GEMM kernel, had_out; one token up to ROW_LINEAR_MAX_WEIGHTS (each case has a
    # row tiling): the row linear's one call of two kernels; prefill: the dequantize kernel
    # alone (the rotations are in the weight it writes, XLA runs the dot). No kernel spills
    # registers to local memory (a register cap or a layout change that does is a slowdown no
    # other CPU check shows).
    from exl3_jax.ffi.trellis_linear import row_plan
    keep = {"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    rows = check_rows("exl3_jax.ffi.aot", COMPILE_CASES, arch, timeout=900, env=keep)
    if helpers_sass.nvdisasm() is not None:
        assert len(list(tmp_path.glob("*.cubin"))) >= len(COMPILE_CASES)
        assert helpers_sass.spilling_cubins(tmp_path) == {}
    for row in rows:
        members = tuple(row.get("members", ()))
        one = (row["m"] == 1 and row["plan"] == "decode"
               and row["k"] * row["n"] <= plans.ROW_LINEAR_MAX_WEIGHTS)
        assert not one or row_plan(row["codebook"], row["K"], row["k"], row["n"], members)
        prefill = row["plan"] == "prefill"
        assert row["custom_call"] and row["calls"] == (1 if one or prefill else 3), row
        if one:
            assert row["kernels"] == ["_hadamard_out_kernel", "_row_gemm_kernel"], row
        if prefill:
            assert row["kernels"] == ["_trellis_dequant_kernel"], row


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compile_only_tiles_kernels(arch):
    # The large-token-tile plan (forced): both token tiles, packed pairs of every codebook.
    cases = [("mcg", 4, 128, "tiles", 1024, 512), ("mul1", 3, 40, "tiles", 512, 1024),
             ("3inst", 2, 200, "tiles", 512, 256)]
    for row in check_rows("exl3_jax.ffi.aot", cases, arch):
        assert row["calls"] == 3 and "_trellis_tiles_kernel" in row["kernels"], row


@needs_cutlass
def test_compile_only_wgmma_kernels(tmp_path):
    # The warpgroup-MMA plan (forced, sm_90a only): every token tile (32 .. 256), one and two
    # token tiles, packed pairs of every codebook, a half-integer rate. Then its SASS: wgmma
    # reads A registers and writes the accumulators after issue, so a compiled schedule that
    # rewrites an A register, or touches an accumulator, before the WARPGROUP.DEPBAR retiring
    # that HGMMA, or stores a stage without the async-proxy fence before the barrier, would be
    # silently wrong on the GPU (helpers_sass).
    from exl3_jax.ffi import trellis_wgmma as tw
    cases = [("mcg", 4, 128, "wgmma", 1024, 512), ("mul1", 3.5, 40, "wgmma", 512, 1024),
             ("3inst", 2, 300, "wgmma", 512, 256), ("mcg", 6, 4096, "wgmma", 1024, 256),
             ("mcg", 3, 1024, "wgmma", 4096, 1024),           # 64 chunks: the loop's back edge
             ("mcg", 4, 1024, "wgmma:128,2,1,0", 4096, 1024), ("mul1", 2, 64, "wgmma:64,1,2"),
             ("mul1", 4, 200, "wgmma:256,2,1,1", 512, 256),        # fused, padded rows
             ("mcg", 3, 16, "wgmma", 1024, 512),                     # m_tile 32
             # weight rings of 3 and 6 chunk slots per warp
             ("mcg", 4, 128, "wgmma:128,2,1,0,3", 2048, 512),
             ("mul1", 3.5, 64, "wgmma:64,2,2,0,6", 1024, 768),
             ("mul1", 3, 40, "wgmma:64,2,2,0,3", 1024, 768)]
    rows = check_rows("exl3_jax.ffi.aot", cases, "sm_90a",
                      env={"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)})
    for case, row in zip(cases, rows):
        k, n = case[4:6] if len(case) > 4 else (256, 256)
        plan = aot.resolve_plan(case[2], k, n, case[3])
        # one K-split: the output transform is the kernel's epilogue (no output kernel)
        assert row["calls"] == (2 if plan.fused_out else 3), row
        assert "_trellis_wgmma_kernel" in row["kernels"], row
    if helpers_sass.nvdisasm() is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    kernels = [code for code in (helpers_sass.disassemble(str(p))
                                 for p in sorted(tmp_path.glob("*.cubin")))
               if any("HGMMA" in ins for _, ins in code)]
    assert len(kernels) == len(cases)
    for code in kernels:
        hgmma = [ins for _, ins in code if "HGMMA" in ins]
        # A from registers (no descriptor for A) in every HGMMA
        assert len(hgmma) >= 4 and not any("gdesc" in ins.split(", ")[1] for ins in hgmma)
        # the loop's waits leave one batch of STEP_BATCH HGMMAs in flight (one commit group),
        # ptxas kept them (no serialising wait after every HGMMA)
        waits = {int(ins.split(",")[-1], 16) for _, ins in code
                 if "WARPGROUP.DEPBAR.LE" in ins} - {0}
        assert waits == {1}, waits
        assert ["gsb0" in ins for ins in hgmma[:tw.STEP_BATCH]] == [False] * (
            tw.STEP_BATCH - 1) + [True]
        assert helpers_sass.async_register_breaches(code) == []
        assert helpers_sass.unfenced_shared_stores(code) == []
        assert helpers_sass.unwaited_async_copies(code) == []
        assert not [ins for _, ins in code if ins.startswith(("STL", "LDL"))]    # no spills


LOCAL_MEMORY_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry local_array(.param .u64 out)
{
  .local .align 4 .b8 buf[64];
  .reg .b32 r<4>;
  .reg .b64 rd<4>;
  mov.u32 r1, %tid.x;
  and.b32 r2, r1, 15;
  shl.b32 r2, r2, 2;
  mov.u64 rd1, buf;
  cvt.u64.u32 rd2, r2;
  add.u64 rd1, rd1, rd2;
  st.local.u32 [rd1], r1;
  ld.local.u32 r3, [rd1];
  ld.param.u64 rd3, [out];
  st.global.u32 [rd3], r3;
  ret;
}
"""


def test_spill_check_sees_local_memory(tmp_path):
    # spilling_cubins on a kernel that does use local memory (a run-time indexed array, what a
    # spill compiles to as well): it must report it.
    import shutil
    import subprocess
    if shutil.which("ptxas") is None or helpers_sass.nvdisasm() is None:
        pytest.skip("needs ptxas and nvdisasm")
    (tmp_path / "k.ptx").write_text(LOCAL_MEMORY_PTX)
    subprocess.run(["ptxas", "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o",
                    str(tmp_path / "k.cubin")], check=True, timeout=60)
    found = helpers_sass.spilling_cubins(tmp_path)
    assert list(found) == ["k.cubin"] and found["k.cubin"] >= 1


def test_sass_checks_catch_breaches():
    # The checks above on hand-written schedules: each breach is reported, the safe one is not.
    ok = [("", "WARPGROUP.ARRIVE"), ("", "HGMMA.64x64x16.F32 R24, R96, gdesc[UR4], R24, gsb0"),
          ("", "WARPGROUP.DEPBAR.LE gsb0, 0x0"), ("", "IMAD R96, R1, 0x2, RZ"),
          ("", "STS.128 [R2+UR4], R4"), ("", "FENCE.VIEW.ASYNC.S"),
          ("", "BAR.SYNC.DEFER_BLOCKING 0x0"), ("", "STG.E desc[UR6][R8.64], R24")]
    assert helpers_sass.async_register_breaches(ok) == []
    assert helpers_sass.unfenced_shared_stores(ok) == []
    early_a = ok[:2] + [("", "IMAD R97, R1, 0x2, RZ")] + ok[2:]
    early_acc = ok[:2] + [("", "FADD R3, R55, R1")] + ok[2:]
    refill = ("", "HGMMA.64x64x16.F32 R24, R96, gdesc[UR4], R24, gsb0")   # no ARRIVE before
    no_fence = ok[:4] + [refill] + ok[2:]
    assert helpers_sass.async_register_breaches(early_a) == ["IMAD R97, R1, 0x2, RZ"]
    assert helpers_sass.async_register_breaches(early_acc) == ["FADD R3, R55, R1"]
    assert helpers_sass.async_register_breaches(no_fence) == [refill[1]]
    # stores handed to a later HGMMA need the fence; an epilogue's (after the last) do not
    stage = ok[4:7]
    assert helpers_sass.unfenced_shared_stores(stage + ok[:4]) == []
    assert helpers_sass.unfenced_shared_stores(stage[:1] + stage[2:] + ok[:4]) == [stage[0][1]]
    assert helpers_sass.unfenced_shared_stores(ok[:5] + ok[6:]) == []
    copied = [("", "LDGSTS.E.BYPASS.128 [R25], desc[UR14][R4.64]"), ("", "LDGDEPBAR"),
              ("", "DEPBAR.LE SB0, 0x1")]
    assert helpers_sass.unfenced_shared_stores(copied + ok[5:6] + ok[6:7] + ok[:4]) == []
    assert helpers_sass.unfenced_shared_stores(copied + ok[6:7] + ok[:4]) == [
        "DEPBAR.LE SB0, 0x1"]
    # cp.async copies still landing when the epilogue stores or the CTA exits
    tail = [("", "STS [R3], R24"), ("", "EXIT")]
    assert helpers_sass.unwaited_async_copies(copied + [("", "DEPBAR.LE SB0, 0x0")] + tail) == []
    assert helpers_sass.unwaited_async_copies(copied + tail) == [t[1] for t in tail]
    # a loop: the write at the top of the body hits the HGMMA issued at its bottom (pending
    # across the back edge)
    loop = [("", "WARPGROUP.ARRIVE"), (".L_x_0", "IMAD R96, R1, 0x2, RZ"),
            ("", "WARPGROUP.ARRIVE"), ("", "HGMMA.64x64x16.F32 R24, R96, gdesc[UR4], R24, gsb0"),
            ("", "@P0 BRA `(.L_x_0)"), ("", "WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert helpers_sass.async_register_breaches(loop) == ["IMAD R96, R1, 0x2, RZ"] * 2
    # commit groups of two: DEPBAR.LE 1 keeps the whole last group (both HGMMAs) in flight, so
    # rewriting the first one's A registers then is a breach; after the next group it is not
    pair = [("", "WARPGROUP.ARRIVE"), ("", "HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24"),
            ("", "HGMMA.64x64x16.F32 R24, R92, gdesc[UR4], R24, gsb0")]
    early = pair + [("", "WARPGROUP.DEPBAR.LE gsb0, 0x1"), ("", "IMAD R88, R1, 0x2, RZ"),
                    ("", "WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert helpers_sass.async_register_breaches(early) == ["IMAD R88, R1, 0x2, RZ"]
    retired = pair + [("", "WARPGROUP.ARRIVE"),
                      ("", "HGMMA.64x64x16.F32 R24, R96, gdesc[UR4], R24"),
                      ("", "HGMMA.64x64x16.F32 R24, R100, gdesc[UR4], R24, gsb0"),
                      ("", "WARPGROUP.DEPBAR.LE gsb0, 0x1"), ("", "IMAD R88, R1, 0x2, RZ"),
                      ("", "WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert helpers_sass.async_register_breaches(retired) == []


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compile_only_row_pair_kernels(arch, monkeypatch):
    # EXL3_JAX_PAIR_FRAGMENTS=0: packed kernels of 2+ token groups read row-major pairs (the
    # opt-out of the default "pairs" layout; single linear and group; mcg and mul1).
    monkeypatch.setenv(tg.PAIR_FRAGMENTS_ENV, "0")
    cases = [("mcg", 4, 12, "decode", 1024, 512), ("mul1", 3, 30, "decode", 512, 512,
                                                   (256, 128, 128))]
    for row in check_rows("exl3_jax.ffi.aot", cases, arch):
        assert row["calls"] == 3 and row["kernels"][0] == "_hadamard_in_kernel", row


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compile_only_one_token_decode_kernels(arch, monkeypatch):
    # m = 1 through the three calls (what linears past the row linear's size gate run): the
    # one-token layout ("token" 16-byte loads, split pairs; mul1 with its affine epilogue), and
    # mul1 split pairs over several tokens (B-fragment order, the epilogue's shuffles).
    monkeypatch.setenv(tg.ROW_LINEAR_ENV, "0")
    cases = [("mcg", 4, 1, "decode", 1024, 512), ("mul1", 3, 1, "decode", 512, 512),
             ("3inst", 2, 1, "decode", 512, 512, (256, 128, 128)),
             ("mul1", 2.5, 5, "decode", 512, 512)]
    for row in check_rows("exl3_jax.ffi.aot", cases, arch):
        assert row["calls"] == 3 and row["kernels"][0] == "_hadamard_in_kernel", row


DISPATCH_EXPORT = """
import jax, jax.numpy as jnp
from jax import export
from exl3_jax.ffi import aot
from exl3_jax.ops import trellis_matmul
from exl3_jax.trellis import Exl3Weight

def f(x, trellis, suh, svh):
    w = Exl3Weight(trellis, suh, svh, None, "mcg", 4, 200, 100)
    return trellis_matmul(x, w, backend="gpu")

sds = jax.ShapeDtypeStruct
exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=aot.disabled_checks())(
    sds((2, 3, 200), jnp.bfloat16), sds((16, 8, 64), jnp.int16), sds((256,), jnp.float16),
    sds((128,), jnp.float16))
back = export.deserialize(exp.serialize())
print(aot.CUSTOM_CALL_PREFIX in exp.mlir_module(), back.out_avals[0].shape,
      sorted(aot.cubin_sms(exp.mlir_module_serialized)))
"""


@needs_cutlass
def test_dispatch_lowers_for_cuda():
    # The jitted dispatch op (what Exl3Linear calls) exports for CUDA from this CPU machine, with
    # padding (200 -> 256 in) and trimming (128 -> 100 out), and survives serialization.
    assert last_line_of_script(DISPATCH_EXPORT) == "True (2, 3, 100) [13, 90]"


def test_cubin_sm_parser():
    import struct
    hdr = bytearray(64)
    hdr[:4] = b"\x7fELF"
    hdr[4] = 2
    struct.pack_into("<H", hdr, 18, 190)
    struct.pack_into("<I", hdr, 48, 0x5A0D5A)
    from exl3_jax.ffi.aot import cubin_sms
    assert 90 in cubin_sms(b"junk" + bytes(hdr))
    assert cubin_sms(b"no elf here") == set()


def test_bench_timer_and_weights(monkeypatch):
    # The benchmark's timing loop and weight factory run on any backend (numbers only mean
    # something on the GPU; bench/NOTES.md).
    from exl3_jax.ffi import bench
    x = jnp.ones((4, 128), jnp.bfloat16)
    w = jnp.ones((128, 128), jnp.bfloat16)
    t = bench.time_in_loop(lambda x, w: jnp.dot(x, w), (x, w), iters=16, reps=1)
    assert 0 < t < 1.0
    # L2-cold timing: the calls cycle through distinct copies of the weights (a pytree too):
    # each unrolled call's barrier takes the loop argument of copy j % 4 (the jaxpr of the loop
    # loop_timer compiles, its copies captured) ...
    dot = lambda x, w: jnp.dot(x, w.trellis)                             # noqa: E731
    wt = bench.random_weight(128, 128, 4, "mcg")
    wt = type(wt)(jnp.ones((128, 128), jnp.bfloat16), wt.suh, wt.svh, None, "mcg", 4, 128, 128)
    loops = []
    real = bench.timing_loop

    def capture(op, trips, unroll, copies):
        loop = real(op, trips, unroll, copies)
        return lambda x, rests: (loops.append((loop, x, rests)), loop(x, rests))[1]
    monkeypatch.setattr(bench, "timing_loop", capture)
    assert 0 < bench.time_in_loop(dot, (x, wt), iters=16, reps=1, copies=4) < 1.0
    loop, x0, rests = loops[0]
    assert len(rests) == 4 and len({r[0].trellis.unsafe_buffer_pointer() for r in rests}) == 4
    outer = jax.make_jaxpr(loop)(x0, rests).jaxpr.eqns[0].params["jaxpr"].jaxpr
    scan = next(e for e in outer.eqns if e.primitive.name in ("scan", "while"))
    body = (scan.params.get("jaxpr") or scan.params["body_jaxpr"]).jaxpr
    leaves = len(jax.tree_util.tree_leaves(rests[0]))
    barriers = [e for e in body.eqns if e.primitive.name == "optimization_barrier"]
    firsts = [outer.invars.index(scan.invars[body.invars.index(e.invars[1])]) for e in barriers]
    assert firsts == [1 + leaves * (j % 4) for j in range(8)], firsts
    # ... together with the chained x, after the chain's add: a barrier between y[0] and
    # x + 0 * y[0] keeps XLA from fusing them and costs each call one more kernel (call 88)
    producer = {v: e for e in body.eqns for v in e.outvars}
    assert all(producer[e.invars[0]].primitive.name == "add" for e in barriers)
    assert all(e.invars[0].aval.shape == x0.shape for e in barriers)
    with pytest.raises(ValueError, match="must divide unroll"):
        bench.time_in_loop(dot, (x, wt), iters=16, copies=3)
    l2 = bench.L2_BYTES
    assert [bench.cold_copies(b) for b in (3 * l2, 2 * l2, l2, l2 // 2, 1)] == [1, 2, 4, 8, 8]
    assert (bench.weight_copies(l2, "cold"), bench.weight_copies(l2, "warm")) == (4, 1)
    with pytest.raises(ValueError, match="l2 must be one of"):
        bench.weight_copies(l2, "hot")


def test_bench_rows_time_the_op_and_bf16_in_alternating_rounds(monkeypatch):
    # bench linear times each row's op and its bf16 dot in alternation (rounds, medians), each
    # loop compiled once (loop_timer): both sides see the same clock at the power cap.
    from exl3_jax.ffi import bench
    from exl3_jax.ffi import trellis_gemm as tg
    calls = []
    values = {"op": iter([30.0, 10.0, 20.0]), "bf16": iter([40.0, 60.0, 45.0])}

    def fake_timer(op, args, **kw):
        kind = ("op" if isinstance(args[1], type(bench.random_weight(128, 128, 4, "mcg")))
                else "bf16") if len(args) > 1 else "overhead"
        calls.append(("build", kind))

        def seconds():
            calls.append(("time", kind))
            return 1e-6 * (next(values[kind]) if kind != "overhead" else 1.0)
        return seconds
    monkeypatch.setattr(bench, "loop_timer", fake_timer)
    monkeypatch.setattr(tg, "trellis_matmul_gpu", lambda x, w: x)
    row, = bench.bench([(128, 128)], [4], ["mcg"], [1], log=lambda *_: None, rounds=3)
    timed = [kind for what, kind in calls if what == "time" and kind != "overhead"]
    assert timed == ["op", "bf16"] * 3          # no timing outside the rounds (session 41)
    assert [kind for what, kind in calls if what == "build"].count("op") == 1
    assert row["us_rounds"] == [30.0, 10.0, 20.0] and row["us"] == pytest.approx(20.0)
    assert row["bf16_us_rounds"] == [40.0, 60.0, 45.0]
    assert row["bf16_us"] == pytest.approx(45.0) and row["error"] is None
    assert row["speedup_vs_bf16"] == pytest.approx(45.0 / 20.0)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench.bench([(128, 128)], [4], ["mcg"], [1], log=lambda *_: None, rounds=0)


def test_loop_timer_compiles_once_and_times_again():
    from exl3_jax.ffi import bench
    traced = []
    x = jnp.ones((4, 128), jnp.bfloat16)
    timer = bench.loop_timer(lambda x, w: (traced.append(1), jnp.dot(x, w))[1], (x, x.T),
                             iters=16, reps=1)
    n_traced = len(traced)
    assert all(0 < timer() < 1.0 for _ in range(3)) and len(traced) == n_traced


def test_timing_loop_keeps_work_on_fixed_arguments_inside():
    # XLA hoists work that depends only on loop-invariant values out of the while loop: a
    # dequantize of the weights alone (the prefill plan's W_hat form until session 39) or a
    # MoE layer's route packing with fixed ids would go uncounted. timing_loop passes each
    # call's arguments after x through an optimization barrier with the chained x, so work on
    # them stays in the loop body; ids an op closes over (the MoE validation's
    # profiles) are tied to the chained x by routes_of_call (per-route plans, with no packing
    # ops, keep their ids as they are).
    import re

    from exl3_jax.ffi import bench
    from exl3_jax.ops.moe_plans import moe_plan
    from exl3_jax.ops.moe_routing import pack_routes
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 16, (64, 4)), jnp.int32)
    x = jnp.zeros((64, 32), jnp.float32)
    sorted_plan = moe_plan(64, 4, 16, 256, 256, kind="prefill")
    per_route = moe_plan(1, 2, 64, 256, 256)
    assert (sorted_plan.packing, per_route.packing) == ("sorted", "per_route")

    def body_ops(op, rests):
        hlo = bench.timing_loop(op, 2, 2, 1).lower(x, rests).compile().as_text()
        body = re.search(r"body=(%[\w.\-]+)", hlo).group(1)
        return re.search(re.escape(body) + r" [^\n]*\{\n(.*?)\n\}", hlo, re.S).group(1)

    def packed(x, ids):
        return x * pack_routes(ids, 16, 16).row_token[0].astype(x.dtype)

    def weight_only(x, w):                      # a transform of the weight alone, then a dot
        return x @ jnp.cos(w)
    w = jnp.ones((32, 8), jnp.float32)
    assert "cosine" in body_ops(weight_only, [(w,)])
    # closed over, the weight is a constant: its cosine leaves the body (hoisted or folded)
    assert "cosine" not in body_ops(lambda x: x @ jnp.cos(w), [()])
    assert "scatter" in body_ops(packed, [(ids,)])
    for plan in (sorted_plan, None):
        assert "scatter" in body_ops(lambda x: packed(x, bench.routes_of_call(x, ids, plan)),
                                     [()])
    assert "scatter" not in body_ops(lambda x: packed(x, bench.routes_of_call(x, ids, per_route)),
                                     [()])
    assert bench.routes_of_call(x, ids, per_route) is ids


def test_bench_moe_cold_loop_routes_to_other_experts(monkeypatch):
    # bench moe's plumbing on any backend, the fused layer replaced by a recorder: with
    # l2="cold" the loop's 8 unrolled calls route to 8 different expert sets (routed_variants,
    # the same shape), and the ragged baseline is timed too; "warm" keeps one routing.
    from exl3_jax.ffi import bench
    from exl3_jax.ffi import trellis_moe as tm
    monkeypatch.setattr(bench, "MOE_GEOMETRIES", {"tiny": (256, 128, 16, 2)})
    seen = set()

    def fake_moe(x, ids, w, a, b, fused=True):      # records each call's routing as it runs
        jax.debug.callback(lambda v: seen.add(np.asarray(v).tobytes()), ids)
        return x.astype(jnp.float32) * jnp.sum(ids).astype(jnp.float32)
    monkeypatch.setattr(tm, "moe_gpu", fake_moe)
    ids = jnp.asarray([[3, 15], [0, 7]], jnp.int32)
    variants = bench.routed_variants(ids, 16)
    assert [np.asarray(v).tolist() for v in variants[:2]] == [[[3, 15], [0, 7]],
                                                             [[5, 1], [2, 9]]]
    for l2, distinct in (("cold", 8), ("warm", 1)):
        seen.clear()
        rows = bench.bench_moe(ms=[2], K=4, l2=l2, log=lambda *_: None)
        assert [(r["l2"], r["m"]) for r in rows] == [(l2, 2)] and rows[0]["us"] > 0
        assert rows[0]["ragged_us"] > 0 and "error" not in rows[0], rows[0]
        assert len(seen) == distinct                        # the routings the calls ran
        assert rows[0]["packing"] == "per_route" and rows[0]["pack_us"] == 0.0, rows[0]
    # A sorted plan's packing timed alone (XLA's here: the kernel needs a GPU)
    monkeypatch.setenv(tm.PACK_ENV, "xla")
    row, = bench.bench_moe(ms=[8], K=4, l2="warm", baseline=False, log=lambda *_: None)
    assert row["packing"] == "sorted" and row["pack_us"] > 0 and "pack_error" not in row, row
    with pytest.raises(ValueError, match="l2 must be"):
        bench.bench_moe(ms=[2], l2="hot")
    # K3 + K4 tiers: experts dealt round-robin to two slabs, one moe_tiered call per layer
    moe_mod = importlib.import_module("exl3_jax.ops.moe")
    tiered = []

    def fake_tiered(x, ids, w, slabs, expert_tier, expert_slot, backend=None, glue=None):
        tiered.append(([(a.K, a.stack_shape, b.stack_shape) for a, b in slabs],
                       np.asarray(expert_tier).tolist(), np.asarray(expert_slot).tolist(),
                       backend, glue is not None))
        return x.astype(jnp.float32)
    monkeypatch.setattr(moe_mod, "moe_tiered", fake_tiered)
    rows = bench.bench_moe(ms=[2], K=(3, 4), l2="warm", baseline=False, log=lambda *_: None)
    assert rows[0]["K"] == (3, 4) and rows[0]["us"] > 0 and "error" not in rows[0], rows[0]
    assert tiered[0] == ([(3, (2, 8), (8,)), (4, (2, 8), (8,))], [0, 1] * 8,
                         [e // 2 for e in range(16)], "gpu", True)
    wt = bench.random_weight(256, 128, 2.5, "mul1")
    assert wt.trellis.shape == (16, 8, 40) and wt.K == 2.5


@needs_cutlass
@pytest.mark.parametrize("per_route,planes", [(8, 2), (16, 1), (0, 2), (0, 1)])
def test_moe_glue_grids_visit_each_read_row_once(per_route, planes):
    """rotate_in / activation CTAs of a per-route layer take each block's row 0 (the only row
    FC1 and FC2 read under one_row), one CTA each, plane by plane; sorted layers every row."""
    from exl3_jax.ffi.trellis_moe import _per_row
    blocks, block_m = 5, per_route or 16
    cfg = _per_row(planes * blocks * block_m, 256, planes=planes, experts=4, per_route=per_route)
    rows = range(0, blocks * block_m, block_m) if per_route else range(blocks * block_m)
    assert [cfg.live_row(c) for c in range(cfg.in_grid[0])] == [
        (p, r) for p in range(planes) for r in rows]


@needs_cutlass
def test_fc1_rotation_cluster_choice_and_its_checks(monkeypatch):
    """FC1's rotation cluster: "auto" takes the largest of 8, 4, 2 dividing both the n-tile
    CTAs and the row's 128-blocks (the three bench geometries: 8, 4, 8), the default is none
    until it is timed, and a size that does not fit, or a cluster without rotate_in, is
    refused by name."""
    import dataclasses

    from exl3_jax.ffi import trellis_moe as tm
    from exl3_jax.ops.moe_plans import moe_plan

    def fc1(H, I, E=128, top_k=8):
        plan = moe_plan(1, top_k, E, H, I, kind="decode")
        gp = plan.fc1
        return tm.GroupedMmaConfig(codebook="mcg", K=4, experts=E, planes=2, k=H, n=I,
                                   block_m=8, blocks=top_k, n_tiles=gp.n_tiles,
                                   warps=gp.warps, splits=gp.splits, unroll=gp.unroll,
                                   rotate_in=True, top_k=top_k)

    monkeypatch.delenv(tm.CLUSTER_ENV, raising=False)
    qwen3, air, glm = fc1(2048, 768), fc1(4096, 1408), fc1(6144, 512, 256)
    assert tm.rotation_cluster(qwen3).cluster == 1          # the default: off
    got = [tm.rotation_cluster(c, "auto") for c in (qwen3, air, glm)]
    assert [c.cluster for c in got] == [8, 4, 8]
    for c in got:
        assert c.grid[0] % c.cluster == 0 and (c.k // 128) % c.cluster == 0
    monkeypatch.setenv(tm.CLUSTER_ENV, "auto")
    assert tm.rotation_cluster(qwen3).cluster == 8
    assert tm.rotation_cluster(fc1(384, 256), "auto").cluster == 1    # 3 blocks: none fits
    with pytest.raises(ValueError, match="cluster 8: .*n-tile CTAs \\(44\\)"):
        tm.rotation_cluster(air, "8")
    with pytest.raises(ValueError, match="needs rotate_in"):
        dataclasses.replace(qwen3, rotate_in=False, cluster=2).validate()
    with pytest.raises(ValueError, match="EXL3_JAX_MOE_CLUSTER='big'"):
        tm.rotation_cluster(qwen3, "big")
