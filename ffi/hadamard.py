"""Hadamard-128 transform kernels around the Trellis GEMM (one warp per 128-element block).

    input:   xh[r, :]  = fp16( H128(x[r, :] * suh) )       rows r >= m are written as zeros
             (row-major, or in the decode kernel's B-fragment order: ``layout``)
    output:  y[r, :]   = H128( sum_s part[s, r, :] ) * svh + bias

H128 is applied per contiguous 128-block of the feature axis with the reference order of fp32
butterflies and one multiply by fp32(0x3DB504F3) (exl3_format.md 4.2); ``x * suh`` stays fp32
(more accurate than exllamav3's fp16 product; exl3-jax compares with tolerances after decode).

Why kernels rather than jnp: a Hadamard as an fp32 HIGHEST matmul costs 256 FLOP per element on
the CUDA cores and several XLA launches around the GEMM; here each transform is one memory-bound
launch, and the output kernel also sums the GEMM's K-split partials and applies svh and bias.

Layout contract (flat row-major, sizes static):
  input:  x [m, k] (f32 / bf16 / f16), suh f16 [k] -> xh f16: "rows" [m_pad, k], or
          "fragments" [2 * m_pad * k], the decode kernel's split-pair B-fragment words
          (trellis_geometry.b_fragment_slot; each fp16 zero-extended to a uint32); for a
          group of G linears (``inputs`` = G) suh is [G * k] and xh is that of the row
          [x, x, ..., x] (G * k wide), each copy rotated with its own suh
  output: part f32 [splits, m_pad, n], svh f16 [n], bias f16 [n] -> y f32 [m, n]
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32

from .cute_ops import block_row_col, hadamard128_lane, warp_task
from .trellis_geometry import b_fragment_slot, b_fragment_word

SCALE = 0.0883883461356163          # fp32(0x3DB504F3), the reference kernel's 1/sqrt(128)
WARPS = 8
LAYOUTS = ("rows", "fragments")     # input transform outputs (see the layout contract)


@dataclasses.dataclass(frozen=True)
class HadamardConfig:
    rows: int          # rows processed (m_pad for the input transform, m for the output)
    valid: int         # rows < valid are real (input transform zero-fills the rest)
    width: int         # feature size (k or n), multiple of 128
    splits: int = 1    # output transform: number of K-split partials to sum
    part_rows: int = 0  # output transform: rows per partial (m_pad)
    layout: str = "rows"  # input transform output: one of LAYOUTS
    inputs: int = 1    # input transform of a linear group: x is width / inputs wide and read once
                       # per member, each copy with its own suh segment (suh [width])

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Hadamard input layout {self.layout!r} is not one of {LAYOUTS}")
        if self.width % (128 * self.inputs):
            raise ValueError(f"width {self.width} is not {self.inputs} segments of whole "
                             f"128-blocks")

    @property
    def x_width(self) -> int:
        """Row length of the input transform's x."""
        return self.width // self.inputs

    @property
    def out_size(self) -> int:
        """fp16 elements of the input transform's output."""
        return self.rows * self.width * (2 if self.layout == "fragments" else 1)

    @property
    def blocks(self) -> int:
        return self.rows * (self.width // 128)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (-(-self.blocks // WARPS), 1, 1)


@cute.kernel
def _hadamard_in_kernel(x: cute.Tensor, suh: cute.Tensor, out: cute.Tensor,
                        cfg: cutlass.Constexpr):
    lane, blk = warp_task(WARPS)
    if blk < cfg.blocks:
        row, col = block_row_col(blk, cfg.width, lane)
        # Padding rows read row valid-1 and are zeroed by a factor: no divergent branch around
        # the warp shuffles, and x needs no padded copy.
        xcol = col if cutlass.const_expr(cfg.inputs == 1) else col % cfg.x_width
        src = cutlass.min(row, cfg.valid - 1) * cfg.x_width + xcol
        keep = cutlass.select_(row < cfg.valid, Float32(1.0), Float32(0.0))
        v = [Float32(x[src + e]) * Float32(suh[col + e]) * keep for e in range(4)]
        v = hadamard128_lane(v, lane)
        for e in cutlass.range_constexpr(4):
            h16 = Float16(v[e] * Float32(SCALE))
            if cutlass.const_expr(cfg.layout == "rows"):
                out[row * cfg.width + col + e] = h16
            else:
                G, kt, i, ln = b_fragment_slot(row, col + e)
                word = b_fragment_word(G, kt, i, ln, cfg.width // 16)
                out[2 * word] = h16
                out[2 * word + 1] = Float16(0.0)


@cute.kernel
def _hadamard_out_kernel(part: cute.Tensor, svh: cute.Tensor, bias: cute.Tensor, y: cute.Tensor,
                         cfg: cutlass.Constexpr):
    lane, blk = warp_task(WARPS)
    if blk < cfg.blocks:
        row, col = block_row_col(blk, cfg.width, lane)
        v = [part[row * cfg.width + col + e] for e in range(4)]
        for s in cutlass.range_constexpr(1, cfg.splits):
            base = (s * cfg.part_rows + row) * cfg.width + col
            v = [v[e] + part[base + e] for e in range(4)]
        v = hadamard128_lane(v, lane)
        for e in cutlass.range_constexpr(4):
            y[row * cfg.width + col + e] = (v[e] * Float32(SCALE) * Float32(svh[col + e])
                                            + Float32(bias[col + e]))


@cute.jit
def launch_hadamard_in(stream, x: cute.Tensor, suh: cute.Tensor, out: cute.Tensor,
                       cfg: cutlass.Constexpr):
    _hadamard_in_kernel(x, suh, out, cfg).launch(grid=cfg.grid, block=(32 * WARPS, 1, 1),
                                                 stream=stream)


@cute.jit
def launch_hadamard_out(stream, part: cute.Tensor, svh: cute.Tensor, bias: cute.Tensor,
                        y: cute.Tensor, cfg: cutlass.Constexpr):
    _hadamard_out_kernel(part, svh, bias, y, cfg).launch(grid=cfg.grid, block=(32 * WARPS, 1, 1),
                                                         stream=stream)
