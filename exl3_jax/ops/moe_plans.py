"""Static launch plans of the grouped Trellis MoE kernels (pure Python, no cutlass).

A plan fixes, from static shapes only, the route block size (block_m rows per block, each block
served by one expert) and the grouped GEMM's CTA shape for one projection (FC1 gate+up, or FC2).

  * "decode" (T <= DECODE_MAX_M tokens): the kernel parameters that set the accumulation order
    (warps, unroll, K-splits) depend on (k, n, planes, top_k) only, never on T or block_m, so a
    token's result is bitwise the same in an m-token batch as alone (the issue's decode test).
  * "prefill" (T > DECODE_MAX_M, up to ``capacity`` tokens per call; larger batches run in
    capacity-sized slices): bigger blocks (up to 64 rows, fewer re-decodes of each expert's
    weights), fewer loads in flight per warp (register pressure), no K-split.
  * "wgmma" (Hopper, a prefill plan whose blocks hold at least WGMMA_MIN_BLOCK_M rows): blocks
    of 32, 64 or 128 rows (wgmma's N; WGMMA_BLOCK_M_CHOICES from the average routes per expert,
    as the other plans choose theirs) on the grouped form of the dense wgmma kernel
    (ffi/trellis_wgmma.py): each CTA decodes its 128 columns of its block's expert once per
    block into wgmma's A registers, with the block's rows staged in shared memory, where the
    mma.sync kernel re-reads every activation fragment per warp and n-tile pair.
"""

from __future__ import annotations

import dataclasses

from .moe_routing import WGMMA_BLOCK_M_CHOICES, max_blocks, select_block_m
from .plans import (DECODE_MAX_M, DEFAULT_SMS, PLAN_KINDS,   # the dense GEMM's plan vocabulary
                    plan_kind)

DEFAULT_CAPACITY = 4096
# Auto takes wgmma where the prefill blocks hold >= 16 rows (more than 8 routes per expert): on
# Qwen3-30B-A3B (H100, call 57) wgmma's 32-row blocks ran 12 and 16 routes per expert 13% and 23%
# faster than the mma.sync kernel's 16-row blocks, and 8 routes 24% slower than its 8-row ones.
WGMMA_MIN_BLOCK_M = 16
# Whether auto takes the wgmma plan on Hopper (exl3_jax.ffi.trellis_moe.plan_for). On since
# session 32's calls 56-57 (H100, against the mma.sync prefill plan: Qwen3-30B-A3B m = 1024
# 1629 -> 806 us, 4096 4408 -> 1995; GLM-4.5-Air 4652 -> 2027, 13390 -> 5080; bench/NOTES.md).
# Mixed-bitrate layers take it too (one wgmma launch per tier slab; call 59, Qwen3-30B-A3B K3 +
# K4 tiers: 1627 -> 899 us at m = 1024, 4513 -> 2146 at 4096).
WGMMA_AUTO = True
# Up to how many routes (tokens x top_k) the GPU path packs the sorted plans' routes in one
# kernel (ffi/route_pack.py, one CTA) instead of XLA's counting sort (moe_routing.pack_routes);
# the tables are the same bit for bit. Call 64 (H200): packing 6-10 us against 12-16 from 64
# to 1024 routes, 17 against 24 at 4096; the Qwen3-30B-A3B layer 8 us faster at m = 8 and 13
# at m = 128. One CTA's time grows with the routes, and past 4096 XLA's wins (call 66, H100:
# 27 / 45 / 81 us against 15-21 at 8192 / 16384 / 32768 routes).
# EXL3_JAX_MOE_PACK=kernel | xla forces either.
PACK_KERNEL_MAX_ROUTES = 4096
PACKINGS = ("sorted", "per_route")
PER_ROUTE_RATIO = 4        # per-route blocks when routes <= experts / 4 (Qwen3-30B: m <= 4)


@dataclasses.dataclass(frozen=True)
class MoeGemmPlan:
    """CTA shape of one grouped Trellis GEMM (one projection)."""
    n_tiles: int      # n16 tiles per warp
    warps: int        # warps per CTA, interleaved over k16 tiles
    splits: int       # K-splits across CTAs
    unroll: int       # k16 steps whose loads are issued together


@dataclasses.dataclass(frozen=True)
class MoePlan:
    kind: str               # "decode" | "prefill" | "wgmma"
    tokens: int             # T of this call (<= capacity)
    top_k: int
    experts: int            # E of the stack (local)
    block_m: int
    blocks: int             # static block count (capacity bound of pack_routes)
    fc1: MoeGemmPlan
    fc2: MoeGemmPlan
    packing: str = "sorted"     # "sorted" (pack_routes) | "per_route" (pack_routes_per_route)

    @property
    def rows(self) -> int:
        return self.blocks * self.block_m


def _gemm_plan(kind: str, k: int, n: int, planes: int, top_k: int, block_m: int,
               sms: int) -> MoeGemmPlan:
    k16, n16 = k // 16, n // 16
    n_tiles = 2 if n16 % 2 == 0 else 1
    # Decode: at least 8 k16 tiles per warp (GLM-5.2 TP4's FC2, k = 512: 4 warps of 8 tiles
    # instead of 8 of 4 took its layer from 43.0 to 39.6 us in session 14's H200 sweep).
    least = 8 if kind == "decode" else 2
    warps = next((w for w in (8, 4, 2) if k16 % w == 0 and k16 // w >= least), 1)
    splits = 1
    if kind == "decode":
        # Fill the GPU at m = 1 (top_k blocks), independent of T: split K only while there are
        # fewer CTAs than SMs. (Splitting GLM-5.2 TP4's FC1 from 256 to 512 CTAs, as a rule of
        # ~2 CTAs per SM did, cost 3.5-5 us per layer on the H200: more than one wave, and
        # the activation sums the splits.)
        ctas = (n16 // n_tiles) * planes * top_k
        for s in (2, 4, 8):
            if ctas * splits >= sms or k16 % s or (k16 // s) % warps or k16 // s < 2 * warps:
                break
            splits = s
        want = 4
    else:
        want = 2 if block_m <= 16 else 1
    per_warp = k16 // splits // warps
    unroll = next(u for u in (4, 2, 1) if u <= want and per_warp % u == 0)
    return MoeGemmPlan(n_tiles=n_tiles, warps=warps, splits=splits, unroll=unroll)


def moe_plan(tokens: int, top_k: int, experts: int, hidden: int, inter: int, *,
             kind: str | None = None, block_m: int | None = None, packing: str | None = None,
             sms: int = DEFAULT_SMS, hopper: bool = False) -> MoePlan:
    """Plan for one MoE call of ``tokens`` tokens (padded sizes: hidden H and intermediate I
    multiples of 128); ``hopper``: auto may pick the "wgmma" plan (the device has wgmma and
    WGMMA_AUTO is on: the caller's decision)."""
    if tokens < 1 or top_k < 1 or experts < 1:
        raise ValueError(f"bad MoE call: tokens={tokens}, top_k={top_k}, experts={experts}")
    if hidden % 128 or inter % 128:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of 128")
    forced = kind
    kind = plan_kind(tokens, kind, kinds=("decode", "prefill", "wgmma"))
    routes = tokens * top_k
    bm = block_m or select_block_m(routes, experts)
    if kind == "decode":
        bm = min(bm, 32)          # the decode kernel keeps <= 4 token groups in registers
    if kind == "prefill" and hopper and not forced and bm >= WGMMA_MIN_BLOCK_M:
        kind = "wgmma"
    if kind == "wgmma":
        bm = block_m or select_block_m(routes, experts, WGMMA_BLOCK_M_CHOICES)
    # Few routes over many experts rarely share one: give each route its own 8-row block and
    # skip the sort (see pack_routes_per_route); same kernels, same per-row results.
    packing = packing or ("per_route" if kind == "decode" and block_m is None
                          and routes * PER_ROUTE_RATIO <= experts else "sorted")
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; expected one of {PACKINGS}")
    if packing == "per_route":
        bm, blocks = 8, routes
    else:
        blocks = max_blocks(routes, experts, bm)
    return MoePlan(kind=kind, tokens=tokens, top_k=top_k, experts=experts, block_m=bm,
                   blocks=blocks, fc1=_gemm_plan(kind, hidden, inter, 2, top_k, bm, sms),
                   fc2=_gemm_plan(kind, inter, hidden, 1, top_k, bm, sms), packing=packing)


__all__ = ["DECODE_MAX_M", "DEFAULT_CAPACITY", "MoeGemmPlan", "MoePlan", "PACKINGS", "PLAN_KINDS",
           "PACK_KERNEL_MAX_ROUTES", "WGMMA_AUTO", "WGMMA_MIN_BLOCK_M", "moe_plan"]
