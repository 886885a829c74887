"""Trellis dequantize kernel: native EXL3 tiles -> W_hat^T as fp16, for the prefill plan.

    wt[n, k] = W_hat[k, n]      (rotated basis, bit-exact with exl3_jax.trellis.decode_trellis)

The prefill plan then runs one XLA dot xh @ W_hat (fp16 operands, fp32 accumulation), which is
as fast as a bf16 GEMM for large m, plus this kernel's cost (decode ALU + 2 bytes/weight written).

Why W_hat^T: a lane's decoded pairs (t = 8l+2p, 8l+2p+1) are two consecutive input rows r0, r0+1
of one output column (exl3_format.md 2.4), i.e. one aligned 32-bit word of the transposed
matrix, so every store is a full f16x2 word and the 4 lanes sharing a column fill 16 contiguous
bytes; XLA's dot takes the [n, k] operand with contracting dims on its last axis at no cost.

Layout contract (flat row-major, sizes static):
  tw:  uint32 [k/16, n/16, W/2]  trellis words
  out: uint32 [n, k/2]            f16x2 pairs of W_hat^T (bitcast to fp16 [n, k] by the caller)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute

from .cute_ops import decode_words, lane_funnels, load_tile_words
from .trellis_geometry import KSplitShape, lane_geometry


@dataclasses.dataclass(frozen=True)
class DequantConfig(KSplitShape):
    codebook: str
    K: float
    k: int
    n: int
    warps: int = 8         # warps per CTA
    k_tiles: int = 4       # consecutive k16 tiles per warp (same n16 column: contiguous rows)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n16, self.k16 // (self.k_tiles * self.warps), 1)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def validate(self) -> "DequantConfig":
        if self.k % 128 or self.n % 128:
            raise ValueError(f"k={self.k}, n={self.n} must be multiples of 128")
        if self.k16 % (self.k_tiles * self.warps):
            raise ValueError(f"k16={self.k16} not a multiple of k_tiles*warps")
        if self.k16 * self.n16 * lane_geometry(self.K).words >= 2**31 or self.k * self.n >= 2**32:
            raise ValueError("tensor too large for 32-bit indexing")
        return self


@cute.kernel
def _trellis_dequant_kernel(tw: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    geo = lane_geometry(cfg.K)
    tid, _, _ = cute.arch.thread_idx()
    bx, by, _ = cute.arch.block_idx()
    lane = tid % 32
    warp = tid // 32
    funnels = lane_funnels(geo, lane)
    kw = cfg.k // 2
    tn = bx
    # Output words of this lane inside a tile: column c0 = lane//4 (+8), row pair r0/2 = lane%4
    # (+4 for rows r0+8, r0+9).
    col_base = (tn * 16 + lane // 4) * kw + lane % 4
    # All loads first: the stores below may alias the loads as far as the compiler knows, so
    # it would not hoist a later tile's loads above an earlier tile's stores by itself.
    tk0 = (by * cfg.warps + warp) * cfg.k_tiles
    words = [load_tile_words(tw, ((tk0 + i) * cfg.n16 + tn) * geo.words, funnels, geo)
             for i in range(cfg.k_tiles)]
    for i in cutlass.range_constexpr(cfg.k_tiles):
        h = decode_words(words[i], funnels, geo, cfg.codebook)
        base = col_base + (tk0 + i) * 8
        out[base] = h[0]                 # rows r0, r0+1,  column c0
        out[base + 4] = h[1]             # rows r0+8, r0+9, column c0
        out[base + 8 * kw] = h[2]        # rows r0, r0+1,  column c0 + 8
        out[base + 8 * kw + 4] = h[3]    # rows r0+8, r0+9, column c0 + 8


@cute.jit
def launch_trellis_dequant(stream, tw: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    _trellis_dequant_kernel(tw, out, cfg).launch(grid=cfg.grid, block=(cfg.threads, 1, 1),
                                                 stream=stream)
