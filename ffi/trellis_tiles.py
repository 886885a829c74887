"""Trellis GEMM with large token tiles: each weight tile decoded once per CTA and multiplied into
up to 128 tokens whose activation rows are staged in shared memory (the "tiles" plan, 32 < m).

    partial[s, m, n] = sum over split s's k16 steps of  xh[m, k16 step] @ W_hat[k16 step, n]

Why: the decode kernel (trellis_mma) holds its B fragments in registers and re-decodes every
weight tile once per 32 tokens, and the prefill plan writes W_hat^T (2 bytes per weight) before an
XLA dot; at m = 128 both are slower than a bf16 GEMV-like dot, which is still memory bound
there (bench/NOTES.md). Here the tensor core does 16 MMAs (128 tokens) per decoded tile, so the
decode's ALU cost is amortised 16x and the kernel reads the compressed weights once.

Tiling (TileGemmConfig): a CTA owns warps * n_tiles * 16 output columns (each warp its own
n_tiles n16 tiles over the CTA's whole K-split range: no warp fold), m_tile tokens and one
K-split. The activation rows of a chunk of k_chunk k16 steps are copied into one of two shared
memory buffers while the other is multiplied (rows padded by 8 fp16, so the 8 token rows a B
fragment load touches fall into distinct banks); the weight words of the next chunk are loaded
with it. Weights take the A operand (packed pairs, trellis_geometry.A_OPERAND_PAIRS), tokens
the B operand, as in trellis_mma.

Layout contract (flat, sizes static):
  xw:  uint32 [m_pad, k/2]        fp16 pairs of xh, row-major, zero padded rows (the input
                                  transform's "rows" layout)
  tw:  uint32 [k/16, n/16, W/2]   the trellis words
  out: float32 [splits, m_pad, n] K-split partial sums (the output transform sums them)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Uint32

from .cute_ops import (cta_thread_ids, decode_words, lane_funnels, load_tile_words, load_words_v4,
                       mma_m16n8k16_f16_f32)
from .trellis_geometry import A_OPERAND_PAIRS, KSplitShape, lane_geometry
from .trellis_mma import zero_accumulators

ROW_PAD = 8            # fp16 per staged row beyond k_chunk * 16: a 16-byte row shift, 4 banks


class TokenTiles(KSplitShape):
    """Derived sizes and checks shared by the token-tile kernels (TileGemmConfig here,
    trellis_wgmma.WgmmaGemmConfig); needs fields K, m_blocks, k, n, m_tile, splits and
    properties cta_n16 (n16 tiles per CTA), chunk_steps (k16 steps per shared-memory stage) and
    threads."""

    fused_out = False      # the kernel writes K-split partials (WgmmaGemmConfig's field: or y)
    # One dense weight (WgmmaGemmConfig's fields: a grouped stack of ``experts`` weights per
    # plane, ``planes`` x m_blocks token tiles, activations and partials per plane).
    experts = 0
    planes = 1

    @property
    def m_pad(self) -> int:
        return self.m_blocks * self.m_tile

    @property
    def chunks(self) -> int:
        return self.k_per_split // self.chunk_steps

    @property
    def stage_units(self) -> int:
        """16-byte activation units of a stage (two per token and k16 step)."""
        return self.m_tile * self.chunk_steps * 2

    @property
    def copy_units(self) -> int:
        """16-byte activation units each thread copies per stage."""
        return self.stage_units // self.threads

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n16 // self.cta_n16, self.splits, self.planes * self.m_blocks)

    def check_token_tiling(self) -> None:
        """k, n multiples of 128; whole CTAs over n; whole chunks per K-split; a stage's units
        spread evenly over the threads; 32-bit indexing."""
        if self.k % 128 or self.n % 128:
            raise ValueError(f"k={self.k}, n={self.n} must be multiples of 128")
        if self.n16 % self.cta_n16:
            raise ValueError(f"n16={self.n16} is not a multiple of the CTA's {self.cta_n16} tiles")
        if self.k16 % self.splits or self.k_per_split % self.chunk_steps:
            raise ValueError(f"{self.splits} K-splits of k16={self.k16} are not whole chunks of "
                             f"{self.chunk_steps} k16 steps")
        if self.stage_units % self.threads:
            raise ValueError(f"a stage's {self.stage_units} 16-byte units do not divide over "
                             f"{self.threads} threads")
        words = self.planes * max(self.experts, 1) * self.k16 * self.n16 \
            * lane_geometry(self.K).words
        if max(words, self.planes * self.m_pad * self.k // 2,
               self.splits * self.planes * self.m_pad * self.n) >= 2**31:
            raise ValueError("tensor too large for 32-bit indexing")


@dataclasses.dataclass(frozen=True)
class TileGemmConfig(TokenTiles):
    """Every compile-time parameter of the large-token-tile Trellis GEMM."""
    codebook: str
    K: float
    m_blocks: int          # CTA token tiles (grid z)
    k: int
    n: int
    m_tile: int = 128      # tokens per CTA, a multiple of 16
    warps: int = 8         # warps side by side over columns
    n_tiles: int = 1       # n16 tiles per warp
    splits: int = 1        # K-splits (grid y)
    k_chunk: int = 4       # k16 steps per shared-memory stage

    @property
    def m_groups(self) -> int:
        return self.m_tile // 8

    @property
    def cta_n16(self) -> int:
        return self.warps * self.n_tiles

    @property
    def chunk_steps(self) -> int:
        return self.k_chunk

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def acc_regs(self) -> int:
        return self.m_groups * self.n_tiles * 4

    @property
    def row_words(self) -> int:
        """uint32 words per staged activation row (k_chunk * 16 fp16 + ROW_PAD)."""
        return (self.k_chunk * 16 + ROW_PAD) // 2

    @property
    def stage_words(self) -> int:
        return self.m_tile * self.row_words

    def validate(self) -> "TileGemmConfig":
        if self.m_tile % 16 or not 16 <= self.m_tile <= 128:
            raise ValueError(f"m_tile {self.m_tile} must be a multiple of 16 in 16..128")
        self.check_token_tiling()
        return self


def stage_unit(cfg: TileGemmConfig, unit):
    """(row, 16-byte segment) of copy unit ``unit`` of a stage: rows of k_chunk * 16 fp16 are
    2 * k_chunk segments. Plain integer arithmetic (DSL integers in the kernel, numpy in the
    tests)."""
    per_row = 2 * cfg.k_chunk
    return unit // per_row, unit % per_row


def b_word(cfg: TileGemmConfig, g, kk, lane, r):
    """Shared-memory word (within a stage) of B register r of ``lane`` for token group g and
    k16 step kk of the chunk: token 8g + lane // 4, k pair (lane % 4) + 4r of the step (the
    m16n8k16 B fragment: k rows 2t, 2t + 1 and 2t + 8, 2t + 9)."""
    return (8 * g + lane // 4) * cfg.row_words + kk * 8 + lane % 4 + 4 * r


def _load_stage(xw, m0, kc0, tid, cfg):
    """This thread's copy units of the chunk starting at k16 step kc0: 4 words each, one
    16-byte load per unit."""
    words = []
    for i in range(cfg.copy_units):
        row, seg = stage_unit(cfg, tid + i * cfg.threads)
        words += load_words_v4(xw, (m0 + row) * (cfg.k // 2) + kc0 * 8 + seg * 4)
    return words


def _store_stage(xs, buf, words, tid, cfg):
    for i in range(cfg.copy_units):
        row, seg = stage_unit(cfg, tid + i * cfg.threads)
        base = buf * cfg.stage_words + row * cfg.row_words + seg * 4
        for j in range(4):
            xs[base + j] = words[4 * i + j]


def _chunk_weight_words(tw, kc0, tn0, funnels, geo, cfg):
    """Weight words of the warp's tiles (kc0 + kk, tn0 + j), kk < k_chunk, j < n_tiles."""
    return [load_tile_words(tw, ((kc0 + kk) * cfg.n16 + tn0 + j) * geo.words, funnels, geo)
            for kk in range(cfg.k_chunk) for j in range(cfg.n_tiles)]


@cute.kernel
def _trellis_tiles_kernel(xw: cute.Tensor, tw: cute.Tensor, out: cute.Tensor,
                          cfg: cutlass.Constexpr):
    geo = lane_geometry(cfg.K)
    tid, lane, warp, (bx, by, bz) = cta_thread_ids()
    tn0 = (bx * cfg.warps + warp) * cfg.n_tiles
    m0 = bz * cfg.m_tile
    k0 = by * cfg.k_per_split
    funnels = lane_funnels(geo, lane)
    acc = zero_accumulators(cfg)
    xs = cutlass.memory.SmemAllocator().allocate_tensor(
        Uint32, cute.make_layout(2 * cfg.stage_words), 16)
    nw = cfg.k_chunk * cfg.n_tiles * geo.groups * 2
    wreg = cute.make_rmem_tensor((nw,), Uint32)      # the chunk's weight words, across steps

    # Stage 0 (activations into buffer 0, the first chunk's weights into registers).
    _store_stage(xs, 0, _load_stage(xw, m0, k0, tid, cfg), tid, cfg)
    for i, v in enumerate(v for t in _chunk_weight_words(tw, k0, tn0, funnels, geo, cfg)
                          for pair in t for v in pair):
        wreg[i] = v
    cute.arch.sync_threads()
    for c in cutlass.range(cfg.chunks):
        buf = c % 2
        # The next chunk's loads (the last chunk re-loads itself: in bounds, never stored).
        kn = k0 + cutlass.min(c + 1, cfg.chunks - 1) * cfg.k_chunk
        xnext = _load_stage(xw, m0, kn, tid, cfg)
        wnext = [v for t in _chunk_weight_words(tw, kn, tn0, funnels, geo, cfg)
                 for pair in t for v in pair]
        g2 = geo.groups * 2
        for kk in cutlass.range_constexpr(cfg.k_chunk):
            # The step's n_tiles tiles decoded first, so each B fragment (shared-memory
            # traffic: 256 bytes per fragment) serves all of them.
            a = []
            for j in cutlass.range_constexpr(cfg.n_tiles):
                t = kk * cfg.n_tiles + j
                words = [(wreg[t * g2 + 2 * q], wreg[t * g2 + 2 * q + 1])
                         for q in range(geo.groups)]
                h = decode_words(words, funnels, geo, cfg.codebook)
                a.append([h[p[0] // 2] for p in A_OPERAND_PAIRS])
            for g in cutlass.range_constexpr(cfg.m_groups):
                b = [xs[buf * cfg.stage_words + b_word(cfg, g, kk, lane, r)] for r in range(2)]
                for j in cutlass.range_constexpr(cfg.n_tiles):
                    i0 = (g * cfg.n_tiles + j) * 4
                    d = mma_m16n8k16_f16_f32(a[j], b, [acc[i0 + r] for r in range(4)])
                    for r in cutlass.range_constexpr(4):
                        acc[i0 + r] = d[r]
        # Every warp is done with the other buffer (read in the previous chunk, behind the
        # barrier that ended it): fill it, then wait for all copies.
        for i in cutlass.range_constexpr(nw):
            wreg[i] = wnext[i]
        _store_stage(xs, 1 - buf, xnext, tid, cfg)
        cute.arch.sync_threads()

    # D fragments: regs (0, 1) at column lane // 4, tokens 2 (lane % 4) + (0, 1); (2, 3) at
    # column lane // 4 + 8.
    for g in cutlass.range_constexpr(cfg.m_groups):
        for j in cutlass.range_constexpr(cfg.n_tiles):
            for r in cutlass.range_constexpr(4):
                col = (tn0 + j) * 16 + lane // 4 + 8 * (r // 2)
                tok = m0 + 8 * g + 2 * (lane % 4) + r % 2
                out[(by * cfg.m_pad + tok) * cfg.n + col] = acc[(g * cfg.n_tiles + j) * 4 + r]


@cute.jit
def launch_trellis_tiles(stream, xw: cute.Tensor, tw: cute.Tensor, out: cute.Tensor,
                         cfg: cutlass.Constexpr):
    """cutlass_call entry (as trellis_mma.launch_trellis_mma)."""
    _trellis_tiles_kernel(xw, tw, out, cfg).launch(grid=cfg.grid, block=(cfg.threads, 1, 1),
                                                   stream=stream)


__all__ = ["ROW_PAD", "TileGemmConfig", "TokenTiles", "b_word", "launch_trellis_tiles", "stage_unit"]
