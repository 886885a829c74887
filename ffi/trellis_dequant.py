"""Trellis dequantize kernel for the prefill plan: native EXL3 tiles -> a plain fp16 weight.

    rotate:     w[k, n] = s * suh[k] * svh[n] * (H128 W_hat H128)[k, n] / 128
    not rotate: w[k, n] = W_hat[k, n]        (bit-exact with exl3_jax.trellis.decode_trellis)

H128 is the unnormalised Sylvester Hadamard matrix on each 128-block of k and of n, so the
rotated weight is the layer's own weight W = diag(suh) had(W_hat) diag(svh) (two normalised
Hadamards make the 1/128) times s, a power of two chosen by the caller. With it the prefill plan
is one XLA dot of fp16(x / s) against w and nothing else: no input or output transform pass over
the [m, k] and [m, n] activations (the output transform's fp32 read and write alone cost ~180 us
at m = 4096 x 14336 on the H200, bench/NOTES.md).

Why this shape of kernel (one CTA of 8 warps per 128 x 128 block of w):
  * H128 = H8 (x) H16 on index bits (6..4, 3..0) (Sylvester), so each side is a 16-point
    transform inside a 16 x 16 tile, done by one tensor-core product with a constant +-1 operand,
    and an 8-point one across 8 tiles, done by fp16 butterflies (add.f16x2) on the operands in
    registers. Emulated weight error (relative L2 to the fp32 dequantized weight): 6.2e-4; fp32
    butterflies on the products instead cost 2.9e-4 (both phases) or 4.9e-4 (phase 1) but
    78 registers (3 CTAs per SM against 4) and +96 or +192 instructions per warp, and this
    kernel is issue and latency bound (bench/NOTES.md, session 23).
  * Phase 1, warp w owns the block's n16 tile w and its 8 k16 tiles t (H8 across them first):
    the decoded tile is the B operand of W_hat's 16 x 16 tile as it stands (the EXL3 in-tile
    order is the m16n8k16 fragment order, trellis_geometry.A_OPERAND_PAIRS), so H16 (rows k',
    2^-4 folded in) @ tile transforms k with the product's pairs running along n. Those go to
    shared memory (fp16, [128 k][128 n + 8]: the 8 halves of padding make each store and load
    conflict-free).
  * Phase 2, warp w owns k16 tile w and the 8 n16 tiles: its A operands are 4-byte words of
    that shared block (pairs along n); H8 across them, then @ H16 diag(svh) transform n (each B
    register is +-svh of one output column: exact fp16 products), and the products' pairs are
    again pairs along n; after one multiply by suh * s / 8 they return to the warp's rows of
    the shared block and leave as whole 256-byte rows (16-byte stores).
  * fp16 intermediates hold at most 64x the largest codebook value (2^-4 in phase 1's operand
    offsets its 16-term sums).
  * With rotate off, the constant operands are the identity and the butterflies are skipped:
    the same data path then moves W_hat exactly (x 1 products, + 0 sums), which the GPU
    validation compares bit for bit with decode_trellis.

Layout contract (flat row-major, sizes static):
  tw:    uint32 [k/16, n/16, W/2]   trellis words
  suh:   fp16 [k]                   (read with rotate only, as svh_words and scale)
  svh_words: uint32 [n/2]           svh's fp16 pairs
  scale: float32 [1]                s (read with rotate only)
  out:   uint32 [k, n/2]            f16x2 pairs of w (bitcast to fp16 [k, n] by the caller)
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .cute_ops import (_asm_u32, cta_thread_ids, decode_words, inline_ptx, lane_funnels,
                       load_shared_words_v4, load_tile_words, mma_m16n8k16_f16_f32,
                       permute_bytes, store_words_v4)
from .trellis_geometry import KSplitShape, lane_geometry

BLOCK = 128                 # a Hadamard block: one CTA covers BLOCK x BLOCK weights
WARPS = BLOCK // 16         # one warp per n16 tile (phase 1) and per k16 tile (phase 2)
ROW_WORDS = BLOCK // 2 + 4  # shared row of 128 fp16 + 8 halves of padding, in 4-byte words
PHASE1_SCALE_LOG2 = -4      # folded into phase 1's H16 operand
PHASE2_SCALE_LOG2 = -3      # into phase 2's: with phase 1's, the two transforms' 1/128
F16_ONE = 0x3C00
F16_SIGN = 0x8000


@dataclasses.dataclass(frozen=True)
class DequantConfig(KSplitShape):
    codebook: str
    K: float
    k: int
    n: int
    rotate: bool = True

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n // BLOCK, self.k // BLOCK, 1)

    @property
    def threads(self) -> int:
        return 32 * WARPS

    def validate(self) -> "DequantConfig":
        if self.k % BLOCK or self.n % BLOCK:
            raise ValueError(f"k={self.k}, n={self.n} must be multiples of {BLOCK}")
        if self.k16 * self.n16 * lane_geometry(self.K).words >= 2**31 or self.k * self.n >= 2**32:
            raise ValueError("tensor too large for 32-bit indexing")
        return self


@dsl_user_op
def _f16x2_add(a, b, *, loc=None, ip=None) -> Uint32:
    return _asm_u32([Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
                    "add.rn.f16x2 $0, $1, $2;", loc, ip)


@dsl_user_op
def _f16x2_sub(a, b, *, loc=None, ip=None) -> Uint32:
    return _asm_u32([Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
                    "sub.rn.f16x2 $0, $1, $2;", loc, ip)


@dsl_user_op
def _f16x2_of(lo, hi, *, loc=None, ip=None) -> Uint32:
    """fp16(lo) in the low half, fp16(hi) in the high half (round to nearest)."""
    res = llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip),
                                    Float32(lo).ir_value(loc=loc, ip=ip)],
                          "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(res)


def _f16_butterflies8(regs):
    """Unnormalised 8-point Walsh-Hadamard transform across 8 tiles' f16x2 registers
    (regs[t][r]), stages on t's bits 0..2 (lo' = lo + hi, hi' = lo - hi), add.f16x2 /
    sub.f16x2. In place."""
    for b in range(3):
        for t in range(8):
            if not t & (1 << b):
                u = t | (1 << b)
                for r in range(len(regs[t])):
                    lo, hi = regs[t][r], regs[u][r]
                    regs[t][r] = _f16x2_add(lo, hi)
                    regs[u][r] = _f16x2_sub(lo, hi)


def _signed_pair(g, c, magnitude: int):
    """f16x2 (H16[g][c], H16[g][c + 1]) * 2^e as bits (magnitude: the fp16 bits of 2^e; 0: the
    sign bits alone), c even: H16[i][j] = (-1)^popcount(i & j)."""
    def sign(j):
        v = g & j
        return ((v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1) * F16_SIGN
    return Uint32((magnitude | sign(c)) | ((magnitude | sign(c + 1)) << 16))


def _identity_pair(g, c):
    """f16x2 (I[g][c], I[g][c + 1]) as bits, c even."""
    lo = cutlass.select_(g == c, Uint32(F16_ONE), Uint32(0))
    hi = cutlass.select_(g == c + 1, Uint32(F16_ONE << 16), Uint32(0))
    return lo | hi


def _f16_bits(log2: int) -> int:
    return (15 + log2) << 10


@cute.kernel
def _trellis_dequant_kernel(tw: cute.Tensor, suh: cute.Tensor, svh_words: cute.Tensor,
                            scale: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    geo = lane_geometry(cfg.K)
    tid, lane, warp, (bn, bk, _) = cta_thread_ids()
    g = lane // 4
    q = lane % 4
    funnels = lane_funnels(geo, lane)
    zero = Uint32(0)
    # The constant operands: H16 scaled by a power of two, or I16. For H16 the A fragment
    # (rows g, g+8; columns 2q, 2q+8) is (h, h, h, -h) and the B fragments of its two n8 halves
    # have the signs of (h, h) and (h, -h), h = (H[g][2q], H[g][2q+1]), since H[r][c + 8] =
    # H[r][c] * (-1)^bit3(r) and r, c < 8 here; phase 2 puts svh under those signs.
    if cutlass.const_expr(cfg.rotate):
        h1 = _signed_pair(g, 2 * q, _f16_bits(PHASE1_SCALE_LOG2))
        a_const = [h1, h1, h1, h1 ^ Uint32(0x80008000)]
        signs = _signed_pair(g, 2 * q, 0)          # phase 2's B: +-svh
        half = Uint32(0x1010) + Uint32(g & 1) * Uint32(0x2222)   # svh[n'] is pair n' / 2's
        sv_base = g // 2                                          # low (n' even) or high half
    else:
        e = _identity_pair(g, 2 * q)
        a_const = [e, zero, zero, e]
        b_const = [[e, zero], [zero, e]]
    smem = cutlass.memory.SmemAllocator()
    block = smem.allocate_tensor(Uint32, cute.make_layout(BLOCK * ROW_WORDS), 16)
    # The block's svh pairs go to shared memory with phase 1's loads, and each lane's two suh
    # values to registers, so phase 2 starts with no global load in its way.
    svh_block = smem.allocate_tensor(Uint32, cute.make_layout(BLOCK // 2), 16)
    kr = bk * BLOCK + warp * 16 + g
    su = [Float32(1.0), Float32(1.0)]
    if cutlass.const_expr(cfg.rotate):
        if tid < BLOCK // 2:
            svh_block[tid] = svh_words[bn * (BLOCK // 2) + tid]
        s = scale[0] * Float32(2.0 ** PHASE2_SCALE_LOG2)
        su = [Float32(suh[kr]) * s, Float32(suh[kr + 8]) * s]

    # Phase 1: n16 tile `warp` of the block, its 8 k16 tiles. All loads first (memory-level
    # parallelism), then decode: the B fragments of W_hat's tile (rows k, columns n) are the
    # decoded pairs (e0 e1 | e2 e3) for columns g and (e4 e5 | e6 e7) for g + 8.
    tn = bn * WARPS + warp
    words = [load_tile_words(tw, ((bk * WARPS + t) * cfg.n16 + tn) * geo.words, funnels, geo)
             for t in range(WARPS)]
    tiles = [list(decode_words(words[t], funnels, geo, cfg.codebook)) for t in range(WARPS)]
    if cutlass.const_expr(cfg.rotate):
        _f16_butterflies8(tiles)                  # H8 over the k16 tiles
    for t in cutlass.range_constexpr(WARPS):
        for j in cutlass.range_constexpr(2):      # n8 half: columns 8j + g
            # (k' = g, n = 8j + 2q, +1) and (k' = g + 8, same n) of H16 @ tile t
            d = mma_m16n8k16_f16_f32(a_const, tiles[t][2 * j:2 * j + 2], [Float32(0.0)] * 4)
            col = warp * 8 + j * 4 + q
            block[(t * 16 + g) * ROW_WORDS + col] = _f16x2_of(d[0], d[1])
            block[(t * 16 + g + 8) * ROW_WORDS + col] = _f16x2_of(d[2], d[3])
    cute.arch.sync_threads()

    # Phase 2: k16 tile `warp` of the block (rows k = 16 * warp + g, +8), its 8 n16 tiles as A
    # operands (rows k, columns n); H8 over them (fp16), then @ H16 diag(svh) on n: the B
    # fragments are +-svh[n'] of one output column n' = 8j + g each (exact fp16 products),
    # so only suh * s * 2^-3 is left for the fp32 products.
    row0 = (warp * 16 + g) * ROW_WORDS
    row1 = row0 + 8 * ROW_WORDS
    a = [[block[row0 + 8 * t + q], block[row1 + 8 * t + q],
          block[row0 + 8 * t + 4 + q], block[row1 + 8 * t + 4 + q]] for t in range(WARPS)]
    nw = cfg.n // 2
    if cutlass.const_expr(cfg.rotate):
        _f16_butterflies8(a)                      # H8 over the n16 tiles
    # The products go back into this warp's own 16 rows of the shared block (its A operands
    # are all loaded: the butterflies and products need every one), then out as whole rows:
    # one 16-byte store per lane, two 256-byte rows per instruction. (Stored straight from the
    # fragments, each instruction would write 8 rows x 16 bytes: twice the L2 requests per
    # sector, 8x per line.)
    inline_ptx("bar.warp.sync -1;")
    for t in cutlass.range_constexpr(WARPS):
        for j in cutlass.range_constexpr(2):
            if cutlass.const_expr(cfg.rotate):
                pair = svh_block[sv_base + t * 8 + j * 4]
                sv = permute_bytes(pair, pair, half)          # svh[n'] in both halves
                b = [sv ^ signs, sv ^ (signs ^ Uint32(0x80008000 * j))]
            else:
                b = b_const[j]
            d = mma_m16n8k16_f16_f32(a[t], b, [Float32(0.0)] * 4)
            # d: (k = g, n' = 16t + 8j + 2q, +1) and (k = g + 8, same n')
            col = 8 * t + 4 * j + q
            block[row0 + col] = _f16x2_of(d[0] * su[0], d[1] * su[0])
            block[row1 + col] = _f16x2_of(d[2] * su[1], d[3] * su[1])
    inline_ptx("bar.warp.sync -1;")
    half_warp = lane // 16
    word = 4 * (lane % 16)
    for i in cutlass.range_constexpr(8):
        r = warp * 16 + 2 * i + half_warp
        v = load_shared_words_v4(block, r * ROW_WORDS + word)
        store_words_v4(out, (bk * BLOCK + r) * nw + bn * (BLOCK // 2) + word, v)


@cute.jit
def launch_trellis_dequant(stream, tw: cute.Tensor, suh: cute.Tensor, svh_words: cute.Tensor,
                           scale: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    """cutlass_call entry (suh, svh_words and scale are read only with cfg.rotate)."""
    _trellis_dequant_kernel(tw, suh, svh_words, scale, out, cfg).launch(
        grid=cfg.grid, block=(cfg.threads, 1, 1), stream=stream)


__all__ = ["BLOCK", "DequantConfig", "launch_trellis_dequant"]
