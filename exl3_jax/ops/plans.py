"""Static launch plans of the GPU Trellis GEMM, picked at trace time from shapes only.

A plan depends on (m, k, n, K, codebook) and the device's SM count, all static under jit, so a
jit-compiled decode loop (fixed m per step) never recompiles. Pure Python: importable and testable
without a GPU or cutlass.

Plan kinds:
  * "decode"  (m <= DECODE_MAX_M): the decode+MMA kernel with one CTA token tile covering all m
    rows (m_tile = m rounded up to 8), so every weight tile is decoded exactly once.
  * "tiles" (forced only: slower than prefill and wgmma on the H200, session 20; the sm_120a
    path for 32 < m once measured there): the large-token-tile MMA kernel
    (ffi/trellis_tiles.py): each weight tile decoded once per 64 or 128 tokens.
  * "wgmma" (Hopper, WGMMA_MIN_M <= m <= WGMMA_MAX_M, or WGMMA_WIDE_MAX_M for weights up to
    WGMMA_WIDE_MAX_WEIGHTS): the same decode-once-per-token-tile scheme on the warpgroup MMA
    (ffi/trellis_wgmma.py), token tiles of 32-256.
  * "prefill" (m > DECODE_MAX_M, and past the wgmma range on Hopper): the dequantize kernel
    writes the layer's weight (fp16, the rotations folded in) and XLA runs the GEMM on
    fp16(x / s). At m >= 1024 it beat the token-tile kernels on the H200
    (0.7x bf16 against 0.4-0.5x, with the transforms still separate; bench/NOTES.md, session
    20).
"""

from __future__ import annotations

import dataclasses

DECODE_MAX_M = 32
DEFAULT_SMS = 132          # H200
TILES_PER_CTA = 128        # decode plan: weight tiles per CTA and token group (see decode_plan)
MIN_CTAS = 256             # decode plan: smallest grid worth splitting K for, on DEFAULT_SMS SMs
MAX_SPLITS = 16
PLAN_KINDS = ("decode", "prefill", "tiles", "wgmma")
TILES_MAX_SPLITS = 16
# Auto takes the wgmma plan on Hopper for these m (H200, bench/NOTES.md session 20, K4 mcg and
# mul1): at m = 32 it ran 24-35% under the decode plan, whose m_tile of 32 costs the same from
# m = 25 (m = 16: decode 31.5 vs 36.0 us, so decode keeps m <= 24); at m = 64 and 128 it tied
# or beat the prefill plan by up to 16%; at m = 1024 prefill was 1.5x faster.
WGMMA_MIN_M, WGMMA_MAX_M = 25, 128
# ... and up to WGMMA_WIDE_MAX_M rows for weights of at most WGMMA_WIDE_MAX_WEIGHTS (H100,
# session 30, K4 mcg, against the prefill plan with its rotations folded: 4096x4096, 4096x14336
# and 14336x4096 -10 to -25% at m = 192 and 256, +2 to +20% at 384, +7 to +14% at 512;
# 8192x28672 +22 to +34% at every m from 192, so larger weights hand over at 128; session 31:
# 8192x8192, 67 M weights, -21 to -24% at 160-256, and K3 mcg / K4 mul1 on the 59 M shapes -3 to
# -27%; the bound sits between 67 M and 235 M, unmeasured, so at about their geometric mean).
WGMMA_WIDE_MAX_M, WGMMA_WIDE_MAX_WEIGHTS = 256, 128 << 20
# One token (m = 1): linears of up to ROW_LINEAR_MAX_WEIGHTS weights run the row linear
# (ffi/trellis_linear.py: the input rotation in the decode kernel's prologue); larger ones the
# decode kernel with its loads through a cp.async ring of RING_SLOTS chunk slots per warp and
# RING_UNROLL k16 steps per chunk (H100, session 24, against direct loads: 8192x28672 K4 mcg
# -10%, mul1 -4%; K3 with 4-step chunks mcg +1%, mul1 -3%; bench/NOTES.md). Hopper only: its
# 60 KB per CTA would leave sm_120a's 100 KB of shared memory per SM one CTA (not measured).
ROW_LINEAR_MAX_WEIGHTS = 1 << 26
RING_SLOTS, RING_UNROLL = 3, 8
RING_CTAS_PER_SM = 3       # the ring's resident CTAs at K4 (60 KB of shared memory each)


@dataclasses.dataclass(frozen=True)
class TrellisPlan:
    kind: str                  # "decode" | "prefill" | "tiles" | "wgmma"
    m: int                     # valid rows
    # decode (MMA kernel) parameters
    m_tile: int = 0
    n_tiles: int = 0
    warps: int = 0
    splits: int = 0
    unroll: int = 0
    min_ctas: int = 0          # CTAs per SM the compiler must fit (caps registers); 0 = no cap
    ring: int = 0              # decode: chunk slots of each warp's cp.async ring; 0 = none
    # wgmma: with one K-split, the output transform in the kernel's epilogue (fused_out); the
    # chunk slots of each warp's weight ring (trellis_wgmma.WgmmaGemmConfig.weight_ring; 0: the
    # kernel's default)
    fused_out: bool = False
    weight_ring: int = 0


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def decode_plan(m: int, k: int, n: int, *, sms: int = DEFAULT_SMS,
                ring: bool = True, codebook: str | None = None) -> TrellisPlan:
    """MMA-kernel plan for 1 <= m <= 32 (``ring``: False gives the direct-load plan past
    ROW_LINEAR_MAX_WEIGHTS, for A/B runs; ``codebook``: the weight's, None for one whose plan
    does not depend on it)."""
    if not 1 <= m <= DECODE_MAX_M:
        raise ValueError(f"decode plan needs 1 <= m <= {DECODE_MAX_M}, got {m}")
    k16, n16 = k // 16, n // 16
    m_tile = -(-m // 8) * 8
    n_tiles = 2 if n16 % 2 == 0 else 1
    warps = 8 if k16 >= 16 else k16 // 2       # k = 128 has only 8 k16 tiles
    ctas = n16 // n_tiles
    # K-splits, measured on the H200 (bench/results/gpu_plan_sweep_h200_2026-12-03.json, 8
    # shapes, m = 1 and 16): the fastest split leaves each CTA about TILES_PER_CTA weight tiles
    # per token group (k16 tiles per split x n_tiles; m = 17..32 not measured, held at the
    # m = 16 size) in a grid of at least MIN_CTAS CTAs.
    # Longer CTAs leave a tail in the last wave (8192x28672, 1 split: 896 CTAs = 1.13 waves at
    # 6 CTAs/SM, 117 us; 8 splits: 82 us); shorter ones pay the warp fold and the fp32
    # partials once more per split. Each split keeps >= 2 k16 tiles per warp.
    # The grid bound scales with the device's SM count (measured on the H200's 132).
    min_ctas = MIN_CTAS * sms // DEFAULT_SMS
    allowed = [s for s in _divisors(k16) if s <= MAX_SPLITS and k16 // s >= 2 * warps]
    splits = next((s for s in allowed
                   if (k16 // s) * n_tiles <= TILES_PER_CTA * min(m_tile // 8, 2)
                   and ctas * s >= min(min_ctas, ctas * allowed[-1])), allowed[-1])
    # Loads of `unroll` k16 steps are issued together (memory-level parallelism); it must divide
    # each warp's share of the split.
    # 8 steps per chunk with one and two token groups: two groups ran 2-step chunks until
    # session 25 (H100, L2-cold, 8192x28672 and 4096x14336 m = 16: 8 steps -7/-8% K4 mcg,
    # -19/-20% K4 mul1, 0% K3 mcg, -3% K3 mul1; 70-78 registers for mcg, 52-61 for mul1, the
    # same CTAs per SM as 2 steps; 14336x4096 -11 to -18%). Three groups 2 steps (session 26,
    # m = 24 against 1 / 4 / 8: K3 mul1 -10 / -13%, the rest -4 to +2%); four groups one
    # step (H200, bench/NOTES.md; Hopper runs m >= 25 on wgmma).
    per_warp = k16 // splits // warps
    want = {8: 8, 16: 8, 24: 2}.get(m_tile, 1)
    unroll = next(u for u in (8, 4, 2, 1) if u <= want and per_warp % u == 0)
    # The ring past 2^26 weights: one token, and mul1's one token group (m 2..8; H100, session
    # 26, 8192x28672 and 4096x28672 m = 4 / 8 against direct loads: K4 -1 to -7%, K3 -11 to
    # -15%; mcg lost 1-9% there, and keeps direct loads). Linear groups take the same plans
    # (session 26, one token, ring against direct loads: 4096x14336+14336 K4 mcg +2.6%, K4
    # mul1 -1.4%, K3 -1 / -4%; 8192x28672+28672 -1 to -7%).
    if ring and (m == 1 or (m_tile == 8 and codebook == "mul1")) \
            and k * n > ROW_LINEAR_MAX_WEIGHTS:
        ring_splits = _ring_plan(k16, warps, ctas, sms)
        if ring_splits is not None:
            return TrellisPlan("decode", m, m_tile=m_tile, n_tiles=n_tiles, warps=warps,
                               splits=ring_splits, unroll=RING_UNROLL, ring=RING_SLOTS)
    return TrellisPlan("decode", m, m_tile=m_tile, n_tiles=n_tiles, warps=warps, splits=splits,
                       unroll=unroll)


def _ring_plan(k16: int, warps: int, ctas: int, sms: int) -> int | None:
    """K-splits of the one-token ring plan, or None where no split gives every warp at least
    two whole chunks: the fewest that give two full waves of RING_CTAS_PER_SM CTAs per SM
    (long CTAs keep the ring streaming; 8192x28672: one split, 896 CTAs, measured best against
    2 and 4), else the most allowed."""
    chunk = warps * RING_UNROLL
    allowed = [s for s in _divisors(k16) if s <= MAX_SPLITS and k16 % (s * chunk) == 0
               and k16 // (s * chunk) >= 2]
    if not allowed:
        return None
    return next((s for s in allowed if ctas * s >= 2 * RING_CTAS_PER_SM * sms), allowed[-1])


def prefill_plan(m: int, k: int, n: int, *, sms: int = DEFAULT_SMS) -> TrellisPlan:
    """Dequantize + XLA dot plan (any m; used for m > 32). Nothing to choose:
    the dequantize kernel's grid is fixed (one CTA per 128 x 128 block,
    ffi/trellis_dequant.py) and XLA tiles the dot."""
    return TrellisPlan("prefill", m)


def _token_tile_splits(m: int, k16: int, n16: int, m_tile: int, chunk: int, ctas: int,
                       cta_n16: int = 8) -> int:
    """The fewest K-splits (whole chunks of ``chunk`` k16 steps each, at most TILES_MAX_SPLITS)
    that give a token-tile plan's grid (CTAs of ``cta_n16`` n16 tiles, 128 columns by default,
    x token tiles) ``ctas`` CTAs, else the most allowed."""
    grid = (n16 // cta_n16) * -(-m // m_tile)
    allowed = [s for s in _divisors(k16) if s <= TILES_MAX_SPLITS and (k16 // s) % chunk == 0]
    return next((s for s in allowed if grid * s >= ctas), allowed[-1])


def tiles_plan(m: int, k: int, n: int, *, sms: int = DEFAULT_SMS,
               tiling: tuple | None = None) -> TrellisPlan:
    """Large-token-tile MMA plan (ffi/trellis_tiles.py; any m, meant for 32 < m): token tiles
    of 64 (m <= 64) or 128, 8 warps of one n16 tile each (128 columns per CTA), chunks of 4 k16
    steps (``unroll``), and the fewest K-splits (whole chunks, at most TILES_MAX_SPLITS) that
    give a grid of two CTAs per SM. Only used when forced. ``tiling``:
    (m_tile, n_tiles, warps, splits, chunk) instead (a tuning aid)."""
    k16, n16 = k // 16, n // 16
    if tiling:
        m_tile, n_tiles, warps, splits, chunk = tiling
        return TrellisPlan("tiles", m, m_tile=m_tile, n_tiles=n_tiles, warps=warps,
                           splits=splits, unroll=chunk)
    m_tile = 64 if m <= 64 else 128
    chunk = 4
    splits = _token_tile_splits(m, k16, n16, m_tile, chunk, 2 * sms)
    return TrellisPlan("tiles", m, m_tile=m_tile, n_tiles=1, warps=8, splits=splits,
                       unroll=chunk)


def wgmma_plan(m: int, k: int, n: int, *, sms: int = DEFAULT_SMS,
               tiling: tuple | None = None) -> TrellisPlan:
    """Warpgroup-MMA plan (ffi/trellis_wgmma.py; Hopper only): token tiles of 32 (m <= 32), 64
    (m <= 64), 128 (m <= 2048) or 256 (wgmma's N; m_tile / 2 accumulators per lane), two
    warpgroups of 64 columns per CTA (``warps`` = 8), and the fewest K-splits (whole chunks of
    4 k16 steps, at most TILES_MAX_SPLITS) that give a grid of one CTA per SM; with one split
    the output transform runs in the kernel's epilogue (``fused_out``: no fp32 partials pass).
    Auto takes it on Hopper in plan_kind's range. ``tiling``: (m_tile, warpgroups,
    splits[, fused_out[, weight_ring]]) instead (a tuning aid; fused_out defaults to
    splits == 1 with two warpgroups; 0 for the ring: the kernel's default)."""
    k16, n16 = k // 16, n // 16
    if tiling:
        if not 3 <= len(tiling) <= 5:
            raise ValueError(f"a wgmma tiling is m_tile,warpgroups,splits[,fused_out[,ring]], "
                             f"got {tiling}")
        m_tile, warpgroups, splits, *rest = tiling
        fused = bool(rest[0]) if rest else splits == 1 and warpgroups == 2
        return TrellisPlan("wgmma", m, m_tile=m_tile, warps=4 * warpgroups, splits=splits,
                           fused_out=fused, weight_ring=rest[1] if len(rest) > 1 else 0)
    m_tile = 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 2048 else 256
    splits = _token_tile_splits(m, k16, n16, m_tile, 4, sms)
    return TrellisPlan("wgmma", m, m_tile=m_tile, warps=8, splits=splits,
                       fused_out=splits == 1)


def tiled_plan(kind: str, m: int, k: int, n: int, tiling: str) -> TrellisPlan:
    """A token-tile plan ("tiles" or "wgmma") with an explicit tiling given as text, "128,1,8,
    14,4" (tiles_plan) or "128,2,1[,1[,6]]" (wgmma_plan): the EXL3_JAX_TILES / EXL3_JAX_WGMMA
    tuning aids and the "kind:tiling" plan names of exl3_jax.ffi.aot's export checks."""
    makers = {"tiles": tiles_plan, "wgmma": wgmma_plan}
    if kind not in makers:
        raise ValueError(f"plan kind {kind!r} takes no tiling; only {sorted(makers)} do")
    return makers[kind](m, k, n, tiling=tuple(int(v) for v in tiling.split(",")))


def plan_kind(m: int, force: str | None = None, kinds: tuple = PLAN_KINDS, *,
              hopper: bool = False, weights: int = 0) -> str:
    """``force`` if given (checked against ``kinds``), else "wgmma" on Hopper (``hopper``) for
    WGMMA_MIN_M <= m <= WGMMA_MAX_M rows, or WGMMA_WIDE_MAX_M for a weight of 1 to
    WGMMA_WIDE_MAX_WEIGHTS ``weights`` (k * n; 0: not known), "decode" for m <= DECODE_MAX_M
    and "prefill" above; shared by the dense and the MoE plans (which have neither "tiles" nor
    "wgmma" and pass no ``hopper``)."""
    wide = 0 < weights <= WGMMA_WIDE_MAX_WEIGHTS
    if force:
        kind = force
    elif hopper and WGMMA_MIN_M <= m <= (WGMMA_WIDE_MAX_M if wide else WGMMA_MAX_M):
        kind = "wgmma"
    else:
        kind = "decode" if m <= DECODE_MAX_M else "prefill"
    if kind not in kinds:
        raise ValueError(f"unknown plan kind {kind!r}; expected one of {kinds}")
    return kind


def select_plan(m: int, k: int, n: int, *, sms: int = DEFAULT_SMS,
                force: str | None = None, hopper: bool = False,
                codebook: str | None = None) -> TrellisPlan:
    """The plan for an [m, k] @ [k, n] Trellis GEMM on a device of ``sms`` SMs, Hopper
    (sm_90a) or not (``hopper``: auto may pick wgmma), of weights in ``codebook`` (the decode
    plan's ring depends on it; None: the codebook-independent plan). ``force`` picks a kind
    ("decode" only valid for m <= 32; "wgmma" only on Hopper)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if k % 128 or n % 128:
        raise ValueError(f"k={k}, n={n} must be multiples of 128")
    kind = plan_kind(m, force, hopper=hopper, weights=k * n)
    if kind == "decode":
        return decode_plan(m, k, n, sms=sms, ring=hopper, codebook=codebook)
    if kind == "tiles":
        return tiles_plan(m, k, n, sms=sms)
    if kind == "wgmma":
        return wgmma_plan(m, k, n, sms=sms)
    return prefill_plan(m, k, n, sms=sms)
