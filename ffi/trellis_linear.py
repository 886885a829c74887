"""One token's EXL3 linear (or linear group) as one custom call: the decode kernel with the input
rotation in its prologue, and the output transform chained behind it.

    part[s] = fp16(H128(x * suh) / s_c) @ W_hat[K-split s] * s_c
    y = H128(sum_s part[s]) * svh + bias

  1. _row_gemm_kernel (grid: column blocks x K-splits): each CTA rotates its own k range of
     the row (x * suh of its group member, the range's power-of-two fp16-boundary scale s_c,
     H128, fp16; hadamard.py's arithmetic element for element) into shared memory in the order
     the k loop reads its B fragments, runs trellis_mma's decode + MMA loop on it, and stores
     token row 0 of its fp32 partials times s_c (exact: a power of two).
  2. hadamard.py's output transform (split sum, H128, svh, bias; row scale 1), a programmatic
     dependent launch: it loads svh and bias while the GEMM runs, then waits for the partials.

Tiling (RowGemmConfig, row_plan): the CTA's warps_n x warps_k warps cover warps_n * n_tiles n16
tiles (128 columns) and interleave over its k range in warps_k groups. Every CTA rotates its k
range once for all its columns, so wide CTAs keep that redundant work small: with trellis_mma's
tiling (32 columns per CTA, all warps over k) the rotation made 8192x28672 K4 mcg m = 1 13%
slower (H200, session 15).

Against the three calls of the decode plan (input transform, decode kernel, output transform)
this drops one kernel and one XLA op boundary per linear. Each CTA reads the row segment it
multiplies (x and suh: 4 bytes per k element) from L2 instead of a rotated copy; a range's
scale can be smaller than the whole row's, which changes nothing but the rounding of values that
are fp16 subnormals after division by the larger one.

Layout contract (flat): x [k] (fp32 / bf16 / fp16); suh0..2 [k] fp16 (a group's members'; one
linear repeats its own); tw0..2 the members' native trellis words; part fp32 [splits, n];
y fp32 [n]. Shared memory per CTA: 2 bytes per k element of one split (4 with split pairs: each
fp16 in both halves of a B word).
"""

from __future__ import annotations

import dataclasses
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Uint32

from exl3_jax.ops.plans import DEFAULT_SMS, ROW_LINEAR_MAX_WEIGHTS

from .cute_ops import cta_thread_ids, lane_funnels
from .hadamard import (HadamardConfig, _hadamard_out_kernel, cta_max, power_of_two_inverse,
                       rotation_inputs, row_blocks, row_scale, store_rotated)
from .hadamard import THREADS as OUT_THREADS
from .trellis_geometry import lane_geometry, row_fragment_slot
from .trellis_mma import (MmaTiling, check_group_members, fold_warp_partials,
                          fragments_of_words, launch_bounds, load_chunk_weights,
                          load_chunk_x_words, member_tile_ranges, mma_chunk, mul1_affine,
                          mul1_sums, zero_accumulators)

MAX_SPLITS = 32          # the output transform sums this many partials per element at most
# Larger linears keep the three calls: their decode kernel outweighs the saved launch, and the
# row GEMM ran ~10% slower per weight than trellis_mma's at 8192x28672 (77.9 vs 69.2 us, K4 mcg;
# 4096x14336: 23.8 vs 23.9; 14336x4096: 25.3 vs 26.7; H200, session 15, bench/NOTES.md); since
# session 24 their decode kernel streams its loads through a cp.async ring (plans.decode_plan).
MAX_WEIGHTS = ROW_LINEAR_MAX_WEIGHTS      # larger linears: the decode plan's ring (plans.py)
MIN_CTAS_PER_SM = 2      # split K further while the grid is smaller
CTAS_PER_SM = 5          # resident CTAs of the row GEMM (44-58 registers x 256 threads, sm_90a)


@dataclasses.dataclass(frozen=True)
class RowGemmConfig(MmaTiling):
    """Every compile-time parameter of the row GEMM kernel (one token tile of 8 rows, of which
    row 0 is the token)."""
    codebook: str
    K: float
    k: int
    n: int
    members: tuple = ()     # a linear group's members' n (as MmaConfig.members)
    n_tiles: int = 2        # n16 tiles per warp
    warps_n: int = 4        # warps side by side over columns
    warps_k: int = 2        # warps interleaved over the k range (their sums folded)
    splits: int = 1
    unroll: int = 8
    min_ctas: int = 0

    m_tile = 8
    mul1_split = True       # _member_row_gemm applies mul1_affine

    @property
    def warps(self) -> int:
        return self.warps_n * self.warps_k

    @property
    def cta_n16(self) -> int:
        return self.warps_n * self.n_tiles

    @property
    def member_tiles(self) -> tuple:
        """(first n16 tile, n16 tiles) of each member (one linear: itself)."""
        return member_tile_ranges(self.members or (self.n,))

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n16 // self.cta_n16, self.splits, 1)

    def check_tiling(self) -> None:
        if self.k % 128 or self.n % 128:
            raise ValueError(f"k={self.k}, n={self.n} must be multiples of 128")
        if self.k16 % self.splits or (self.k_per_split * 16) % 128:
            raise ValueError(f"{self.splits} K-splits of k={self.k} are not whole 128-blocks")
        if self.k_per_split % (self.warps_k * self.unroll):
            raise ValueError(f"k16 per split {self.k_per_split} is not a multiple of "
                             f"warps_k*unroll={self.warps_k * self.unroll}")
        if any(n16 % self.cta_n16 for _, n16 in self.member_tiles):
            raise ValueError(f"every member's n16 must be a multiple of the CTA's "
                             f"{self.cta_n16} tiles; members {self.members or (self.n,)}")

    def validate(self) -> "RowGemmConfig":
        self.check_tiling()
        if self.members:
            check_group_members(self.members, self.n)
        if self.splits > MAX_SPLITS:
            raise ValueError(f"{self.splits} K-splits; the output transform takes <= "
                             f"{MAX_SPLITS}")
        return self


def row_plan(codebook: str, K, k: int, n: int, members: tuple = (), *,
             sms: int = DEFAULT_SMS, max_weights: int | None = MAX_WEIGHTS
             ) -> RowGemmConfig | None:
    """The row GEMM's tiling for [1, k] @ [k, n], or None if none fits (the decode plan's three
    calls run then, as for more than ``max_weights`` weights; None: no size gate): 8 warps of
    n_tiles 2 and unroll 8; the widest CTA (warps_n 4, 2, 1) that every member's columns
    divide; K-splits of 1 or 2 chunks per warp (whole 128-blocks, at most MAX_SPLITS): a grid
    of at least MIN_CTAS_PER_SM CTAs per SM where k allows, then the fuller last wave
    (CTAS_PER_SM resident), then fewer splits."""
    if max_weights is not None and k * n > max_weights:
        return None
    unroll = 8
    for warps_n in (4, 2, 1):
        if all((m // 16) % (2 * warps_n) == 0 for m in (members or (n,))):
            break
    else:
        return None
    warps_k = 8 // warps_n
    k16 = k // 16
    step = warps_k * unroll                         # k16 of one chunk of every k warp (>= 8)
    fits = [kps for kps in range(step, min(k16, 2 * step) + 1, step)
            if k16 % kps == 0 and k16 // kps <= MAX_SPLITS]
    if not fits:
        return None
    columns = n // (16 * 2 * warps_n)

    def rank(kps):
        ctas = columns * (k16 // kps)
        waves = ctas / (CTAS_PER_SM * sms)
        return (ctas >= MIN_CTAS_PER_SM * sms, round(waves / math.ceil(waves), 2), kps)
    kps = max(fits, key=rank)
    try:
        return RowGemmConfig(codebook=codebook, K=K, k=k, n=n, members=tuple(members),
                             warps_n=warps_n, warps_k=warps_k, splits=k16 // kps,
                             unroll=unroll).validate()
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class RowLinearConfig:
    """The custom call's two kernels: the row GEMM's tiling and the output transform's
    HadamardConfig; pdl: the output transform is a programmatic dependent launch."""
    mma: RowGemmConfig
    out: HadamardConfig
    pdl: bool = True


@cute.jit
def _member_row_gemm(x, suh, tw, xs, acc, tl0, n16: cutlass.Constexpr, k0, wk, lane, warp,
                     funnels: list, cfg: cutlass.Constexpr):
    """One member's part of the row GEMM for the CTA (this warp's n16 tiles start at tl0 of the
    member's n16): rotation prologue into xs, then the warp's k chunks into acc. Returns the
    range's scale."""
    geo = lane_geometry(cfg.K)
    # The k loop is trellis_mma's dense one (load a chunk, decode it): the grids are several
    # waves deep, so resident CTAs hide each other's rotation and loads. (Issuing the first
    # chunk's loads before the rotation held 32 more registers: 64-71 instead of 32-55.)
    blocks = row_blocks(cfg.k_per_split * 16, warp, cfg.warps)
    vals, amax = rotation_inputs(x, suh, k0 * 16 + 4 * lane, k0 * 16 + 4 * lane, Float32(1.0),
                                 blocks)
    s = row_scale(cta_max(amax, warp, cfg.warps))
    inv = power_of_two_inverse(s)
    store_rotated(vals, blocks, inv, lane, xs, 0,
                  row_fragment_slot if cfg.split_pairs else None)
    cute.arch.sync_threads()
    # Split pairs: 4 words per k16 step, each fp16 in both halves of its register; packed: 2
    # fp16 pairs (row order). base folds in the range's first step.
    xsrc = cute.recast_tensor(xs, Uint32)
    base = lane % 4 - k0 * (16 if cfg.split_pairs else 8)
    xsum = mul1_sums(cfg)
    for c0 in cutlass.range(k0 + wk * cfg.unroll, k0 + cfg.k_per_split,
                            cfg.warps_k * cfg.unroll):
        wbuf = load_chunk_weights(tw, c0, tl0, funnels, geo, cfg, n16)
        bfrag = fragments_of_words(load_chunk_x_words(xsrc, c0, base, cfg, lanes=4), cfg)
        mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
    mul1_affine(acc, xsum, cfg)
    return s


@cute.kernel
def _row_gemm_kernel(x: cute.Tensor, suh0: cute.Tensor, suh1: cute.Tensor, suh2: cute.Tensor,
                     tw0: cute.Tensor, tw1: cute.Tensor, tw2: cute.Tensor, out: cute.Tensor,
                     cfg: cutlass.Constexpr):
    tid, lane, warp, (bx, by, _) = cta_thread_ids()
    cute.arch.griddepcontrol_launch_dependents()       # the output transform may start loading
    wn = warp % cfg.warps_n
    wk = warp // cfg.warps_n
    ct0 = bx * cfg.cta_n16                              # the CTA's first n16 tile
    tn0 = ct0 + wn * cfg.n_tiles                        # this warp's
    k0 = by * cfg.k_per_split
    funnels = lane_funnels(lane_geometry(cfg.K), lane)
    acc = zero_accumulators(cfg)
    xs = cutlass.memory.SmemAllocator().allocate_tensor(
        Float16, cute.make_layout(cfg.k_per_split * 16 * (2 if cfg.split_pairs else 1)), 16)
    suhs, tws = (suh0, suh1, suh2), (tw0, tw1, tw2)
    s = Float32(1.0)
    if cutlass.const_expr(len(cfg.member_tiles) == 1):
        s = _member_row_gemm(x, suh0, tw0, xs, acc, tn0, cfg.n16, k0, wk, lane, warp, funnels,
                             cfg)
    else:
        # The CTA's tiles lie in one member (as in trellis_mma's group kernel): one copy of the
        # prologue and k loop per member, behind a branch uniform over the CTA.
        for i in cutlass.range_constexpr(len(cfg.member_tiles)):
            t0, n16 = cfg.member_tiles[i]
            if ct0 >= t0:
                if ct0 < t0 + n16:
                    s = _member_row_gemm(x, suhs[i], tws[i], xs, acc, tn0 - t0, n16, k0, wk,
                                         lane, warp, funnels, cfg)

    # Token row 0 of the D fragments (registers 0 and 2 of lanes 4q: columns q and q + 8 of
    # each n16 tile), summed over this warp column's warps_k warps, times s.
    nacc = cfg.acc_regs
    if cutlass.const_expr(cfg.warps_k > 1):
        red = fold_warp_partials(acc, warp, lane, cfg)
        for i in cutlass.range_constexpr(0, nacc, 2):
            for q in cutlass.range_constexpr(1, cfg.warps_k):
                acc[i] = acc[i] + red[((q * cfg.warps_n + wn) * nacc + i) * 32 + lane]
    if (wk == 0) & (lane % 4 == 0):
        for i in cutlass.range_constexpr(0, nacc, 2):
            col = (tn0 + i // 4) * 16 + lane // 4 + 8 * ((i % 4) // 2)
            out[by * cfg.n + col] = acc[i] * s


@cute.jit
def launch_row_linear(stream, x: cute.Tensor, suh0: cute.Tensor, suh1: cute.Tensor,
                      suh2: cute.Tensor, tw0: cute.Tensor, tw1: cute.Tensor, tw2: cute.Tensor,
                      svh0: cute.Tensor, svh1: cute.Tensor, svh2: cute.Tensor,
                      bias0: cute.Tensor, bias1: cute.Tensor, bias2: cute.Tensor,
                      ones: cute.Tensor, part: cute.Tensor, y: cute.Tensor,
                      cfg: cutlass.Constexpr):
    """cutlass_call entry: the row GEMM (an ordinary launch: nothing starts before the inputs
    are complete) and the output transform behind it (ones: the row scale 1; unused member
    slots repeat the last member's pointers; a missing bias passes svh, never read)."""
    _row_gemm_kernel(x, suh0, suh1, suh2, tw0, tw1, tw2, part, cfg.mma).launch(
        grid=cfg.mma.grid, block=(cfg.mma.threads, 1, 1), stream=stream,
        **launch_bounds(cfg.mma.min_ctas))
    _hadamard_out_kernel(part, svh0, svh1, svh2, bias0, bias1, bias2, ones, y, cfg.out).launch(
        grid=cfg.out.grid, block=(OUT_THREADS, 1, 1), stream=stream, use_pdl=cfg.pdl)


__all__ = ["MAX_SPLITS", "RowGemmConfig", "RowLinearConfig", "launch_row_linear",
           "row_plan"]
