"""Hadamard-128 transform kernels around the Trellis GEMM (one warp per 128-element block).

    input:   s[r]      = row scale of x[r, :] (the fp16 boundary, below)
             xh[r, :]  = fp16( H128(x[r, :] * suh) / s[r] )   rows r >= m are written as zeros
             (row-major, or in the decode kernel's B-fragment order: ``layout``)
    output:  y[r, :]   = H128( sum_s part[s, r, :] ) * svh * s[r] + bias

H128 is applied per contiguous 128-block of the feature axis with the reference order of fp32
butterflies and one multiply by fp32(0x3DB504F3) (exl3_format.md 4.2); ``x * suh`` stays fp32
(more accurate than exllamav3's fp16 product; exl3-jax compares with tolerances after decode).

The fp16 boundary: the GEMM's operand is the rotated row, and one rotated element can reach
sqrt(128) * max|x * suh| (11.3x). Each row is therefore divided by the smallest power of two
s >= max|x * suh| / 4096 (s >= 1; trellis_gemm.ROW_LIMIT_LOG2 = 12), so no rotated element exceeds
11.32 * 4096 = 46341 < 65504, and the output kernel multiplies s back before the bias. A power
of two is exact both ways, so rows in range (s = 1, nearly all) are untouched; for a scaled row
only elements below 2^-14 * s turn into fp16 subnormals, 2^-25 of the row's max or less.
Non-finite inputs stay non-finite. This replaces an XLA amax/divide before and a multiply after
every linear (nn.numerics); each CTA computes its row's max itself from x and suh.

Layout contract (flat row-major, sizes static):
  input:  x [m, k] (f32 / bf16 / f16), suh_g f16 [k] for each of the G members of a linear group
          (G = 1 for one linear; unused slots of the MAX_MEMBERS pointers repeat a member) ->
          (xh f16, s f32 [m_pad]): xh "rows" [m_pad, G * k], or "fragments"
          [2 * m_pad * G * k], the decode kernel's split-pair B-fragment words
          (trellis_geometry.b_fragment_slot; each fp16 in both halves of a uint32), or "token"
          [2 * G * k] (m = m_pad = 1: one token's such words, token_fragment_word), or "pairs"
          [m_pad * G * k] (packed kernels' B fragments, two fp16 per word, pair_fragment_word),
          or "quads" [m_pad * G * k] (the byte-sum kernels', quad_fragment_index; one row
          (m_pad = 1): row-major),
          of the row [x, x, ..., x] (G * k wide), copy g rotated with suh_g; one s per row,
          the max over every copy; s[r] = 1 for r >= m
  output: part f32 [splits, m_pad, n], per member svh_g f16 [n_g] and, where ``biased[g]``,
          bias_g f16 [n_g] (n = sum n_g, member g's columns after those of members < g),
          s f32 [m_pad] -> y f32 [m, n]
The members' vectors are separate pointers, not one concatenation: inside a jitted decode loop XLA
re-ran such concatenations every step (four per layer, 0.2 ms of a 4.4 ms step, measured).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .cute_ops import (block_row_col, cta_thread_ids, fp16_in_both, hadamard128_lane,
                       ld_global_v4, st_cluster_v4, st_global_v4, warp_task)
from .trellis_gemm import ROW_LIMIT_LOG2
from .trellis_geometry import (b_fragment_slot, b_fragment_word, pair_fragment_slot,
                               pair_fragment_word, quad_fragment_index, token_fragment_word)
from .trellis_mma import MAX_MEMBERS     # the kernels below take this many vector pointers

SCALE = 0.0883883461356163          # fp32(0x3DB504F3), the reference kernel's 1/sqrt(128)
WARPS = 8
THREADS = 32 * WARPS
LOAD_REGS = 96                      # row-max load registers (x and suh words) in flight per
                                    # thread (with addresses and unpacking, <= 128 registers)
STEP = 8                            # row-max elements per thread and step: one 16-byte word
                                    # of suh and of a 2-byte x (two words of an f32 x)
# input transform outputs (layout contract)
LAYOUTS = ("rows", "fragments", "token", "pairs", "quads")
SPLIT_ROWS = 32                     # input transforms of up to this many rows split each row


@dataclasses.dataclass(frozen=True)
class HadamardConfig:
    rows: int          # rows processed (m_pad for the input transform, m for the output)
    valid: int         # rows < valid are real (input transform zero-fills the rest)
    width: int         # feature size (k or n), multiple of 128
    splits: int = 1    # output transform: number of K-split partials to sum
    part_rows: int = 0  # output transform: rows per partial (m_pad)
    layout: str = "rows"  # input transform output: one of LAYOUTS
    inputs: int = 1    # input transform of a linear group: x is width / inputs wide and read once
                       # per member, each copy with its own suh_g
    members: tuple = ()  # output transform: each member's columns (sum = width; () = one member)
    biased: tuple = ()   # output transform: which members have a bias (() = none)
    per_warp: int = 1  # input transform: 128-blocks each warp rotates. 1 spreads a row over
                       # row_blocks / WARPS CTAs, each reducing the row's max again (decode: few
                       # rows, latency); row_blocks / WARPS makes one CTA per row (prefill)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Hadamard input layout {self.layout!r} is not one of {LAYOUTS}")
        if self.layout == "token" and self.rows != 1:
            raise ValueError(f"the token layout holds one row, got rows={self.rows}")
        if self.width % (128 * self.inputs):
            raise ValueError(f"width {self.width} is not {self.inputs} segments of whole "
                             f"128-blocks")
        if self.per_warp < 1:
            raise ValueError(f"per_warp must be >= 1, got {self.per_warp}")
        if not 1 <= self.inputs <= MAX_MEMBERS:
            raise ValueError(f"{self.inputs} inputs; at most {MAX_MEMBERS}")
        if self.members and (sum(self.members) != self.width or len(self.members) > MAX_MEMBERS
                             or any(n % 128 for n in self.members)):
            raise ValueError(f"members {self.members} are not <= {MAX_MEMBERS} whole 128-blocks "
                             f"summing to width {self.width}")
        if self.biased and len(self.biased) != len(self.out_members):
            raise ValueError(f"biased {self.biased} does not match members {self.out_members}")

    @classmethod
    def input(cls, rows: int, valid: int, width: int, *, layout: str = "rows",
              inputs: int = 1) -> "HadamardConfig":
        """The input transform of ``rows`` rows: split rows while there are few of them."""
        per_warp = 1 if rows <= SPLIT_ROWS else -(-width // (128 * WARPS))
        return cls(rows=rows, valid=valid, width=width, layout=layout, inputs=inputs,
                   per_warp=per_warp)

    @property
    def out_members(self) -> tuple:
        """Output transform: each member's columns."""
        return self.members or (self.width,)

    def has_bias(self, g: int) -> bool:
        return bool(self.biased) and bool(self.biased[g])

    @property
    def member_starts(self) -> tuple:
        return tuple(sum(self.out_members[:g]) for g in range(len(self.out_members)))

    @property
    def x_width(self) -> int:
        """Row length of the input transform's x."""
        return self.width // self.inputs

    @property
    def out_size(self) -> int:
        """fp16 elements of the input transform's output."""
        return self.rows * self.width * (2 if self.layout in ("fragments", "token") else 1)

    @property
    def row_blocks(self) -> int:
        return self.width // 128

    @property
    def blocks(self) -> int:
        return self.rows * self.row_blocks

    @property
    def row_ctas(self) -> int:
        """Input transform: CTAs per row."""
        return -(-self.row_blocks // (WARPS * self.per_warp))

    @property
    def max_steps(self) -> int:
        """Input transform: row-max steps of each thread, STEP consecutive x elements each (as
        16-byte vector loads: 8x fewer load instructions than one element per load)."""
        return -(-self.x_width // (STEP * THREADS))

    def load_batch(self, x_bits: int) -> int:
        """Input transform: row-max steps whose loads are issued together, for an x of ``x_bits``
        bits per element: a step holds STEP * x_bits / 32 registers of x and 4 of each suh.
        All of them (one memory round trip) for x rows up to 24576 wide (2-byte x, one member)
        or 12288 (a group of three)."""
        return max(1, LOAD_REGS // (STEP * x_bits // 32 + 4 * self.inputs))

    @property
    def in_grid(self) -> tuple[int, int, int]:
        return (self.rows * self.row_ctas, 1, 1)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (-(-self.blocks // WARPS), 1, 1)


_ROW_SCALE_ASM = f"""{{
.reg .b32 t;
    mov.b32 t, $1;
    add.u32 t, t, 0x7FFFFF;
    and.b32 t, t, 0x7F800000;
    sub.s32 t, t, {ROW_LIMIT_LOG2 << 23};
    max.s32 t, t, 0x3F800000;
    mov.b32 $0, t;
}}"""  # smallest power of two >= amax / 2^ROW_LIMIT_LOG2, at least 1 (trellis_gemm.row_scale)


@dsl_user_op
def row_scale(amax, *, loc=None, ip=None) -> Float32:
    """s = the smallest power of two >= amax / 2^ROW_LIMIT_LOG2, at least 1 (amax >= 0; inf ->
    2^116)."""
    res = llvm.inline_asm(T.f32(), [Float32(amax).ir_value(loc=loc, ip=ip)], _ROW_SCALE_ASM,
                          "=f,f", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Float32(res)


@dsl_user_op
def power_of_two_inverse(s, *, loc=None, ip=None) -> Float32:
    """1 / s for a power of two s in [1, 2^126], exactly (exponent arithmetic)."""
    res = llvm.inline_asm(T.f32(), [Float32(s).ir_value(loc=loc, ip=ip)],
                          "{\n.reg .b32 t, c;\n    mov.b32 c, 0x7F000000;\n    mov.b32 t, $1;\n"
                          "    sub.s32 t, c, t;\n    mov.b32 $0, t;\n}", "=f,f", has_side_effects=False,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Float32(res)


def cta_max(v, warp, warps: int = WARPS):
    """Maximum of the Float32 ``v`` over the CTA's ``warps`` warps (every thread gets it): butterfly
    shuffles in each warp, then one value per warp through shared memory (every lane stores
    the same value: no branch, which plain Python helpers cannot hold). Inlined at trace time;
    every thread of the CTA must reach it."""
    for b in range(5):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1 << b))
    smem = cutlass.memory.SmemAllocator()
    red = smem.allocate_tensor(Float32, cute.make_layout(warps), 16)
    red[warp] = v
    cute.arch.sync_threads()
    for w in range(warps):
        v = cute.arch.fmax(v, red[w])
    return v


def row_blocks(width: int, warp, warps: int = WARPS):
    """The 128-column blocks of a row of ``width`` this warp handles when a CTA of ``warps``
    warps owns the row: for i < ceil(width / (128 * warps)), (whether block i * warps + warp
    exists, its first column, clamped to the last block so every index is in bounds). A warp
    past the last block re-computes the last one, which leaves the row max unchanged, and does
    not store it. Plain Python inlined at trace time."""
    nb = width // 128
    out = []
    for i in range(-(-nb // warps)):
        blk = i * warps + warp
        out.append((blk < nb, cutlass.min(blk, nb - 1) * 128))
    return out


def rotation_inputs(x, suh, src, srow, keep, blocks):
    """(vals, amax): x * suh * keep (fp32) at this lane's 4 columns of each block (x row at
    ``src``, suh row at ``srow``, both + 4 * lane), every load issued before the first use, and
    their max |.|. The input transform's arithmetic (_block_inputs), shared by the MoE's
    rotate_in kernel, FC1's prologue and the row linear's (trellis_linear), so all give the
    same bits. Plain Python inlined at trace time."""
    vals = [[Float32(x[src + c0 + j]) * Float32(suh[srow + c0 + j]) * keep for j in range(4)]
            for _, c0 in blocks]
    amax = Float32(0.0)
    for v in vals:
        amax = abs_max(amax, v)
    return vals, amax


def rotated_fp16(v, inv, lane, convert=Float16):
    """fp16(H128(v * inv)) of this lane's 4 values (inv: 1 / the row's power-of-two scale),
    each rounded by ``convert`` (Float16, or cute_ops.fp16_in_both for the word of both
    halves): what store_rotated and store_rotated_cluster store (_rotate_store's arithmetic,
    written there inline: routing it through this helper changed the input kernel's FMA
    contraction pairs). Plain Python inlined at trace time."""
    h = hadamard128_lane([vi * inv for vi in v], lane)
    return [convert(hi * Float32(SCALE)) for hi in h]


@cute.jit
def store_rotated(vals: list, blocks: list, inv, lane, dst, base,
                  fragments: cutlass.Constexpr = None):
    """rotated_fp16 of each real block of ``blocks`` (row_blocks; vals as rotation_inputs
    returns them) into ``dst``: column c (this lane's 4 of each block) at base + c, or with
    ``fragments`` (a word-slot function of trellis_geometry: row_fragment_slot,
    token_fragment_word) in both halves of uint32 word fragments(c) (fp16 elements base +
    2 * slot and + 1). The store shared by the MoE glue, FC1's prologue and the row linear."""
    for i in cutlass.range_constexpr(len(blocks)):
        real, c0 = blocks[i]
        if real:
            f16 = rotated_fp16(vals[i], inv, lane)
            for j in cutlass.range_constexpr(4):
                c = c0 + 4 * lane + j
                if cutlass.const_expr(fragments is not None):   # both halves of word slot(c)
                    dst[base + 2 * fragments(c)] = f16[j]
                    dst[base + 2 * fragments(c) + 1] = f16[j]
                else:
                    dst[base + c] = f16[j]


@cute.jit
def store_rotated_cluster(vals: list, blocks: list, inv, lane, warp, rank, xs_address,
                          width: cutlass.Constexpr, warps: cutlass.Constexpr,
                          cluster: cutlass.Constexpr):
    """store_rotated's "token" store (fragments = token_fragment_word) shared by the
    ``cluster`` CTAs of a thread-block cluster that all need the same row: cluster rank r
    rotates only blocks r * per .. r * per + per - 1 (per = width / 128 / cluster; a block is
    one warp's, so ``per`` warps of each CTA rotate) and stores each rotated word into every
    CTA's shared memory at xs_address + 4 * word (the same offset in each: every CTA allocates
    the same shared layout). Same words as store_rotated (the rotation is rotated_fp16's).

    Column c's word is token_fragment_word(c): a lane's 4 columns (quarter q = lane % 4 of a
    k16 step) are words 8 (q % 2) + q // 2 + {0, 2, 4, 6} of the step's 16, so lanes q and
    q ^ 2 swap two words (one shuffle each) and each then holds 4 consecutive words: one
    16-byte store per CTA of the cluster. The caller orders the stores: a cluster barrier
    before (every CTA has started) and one after (release / acquire) the reads."""
    per = width // 128 // cluster
    q = lane % 4
    upper = (q // 2) == 1
    for i in cutlass.range_constexpr(len(blocks)):
        real, c0 = blocks[i]
        if real & ((i * warps + warp) // per == rank):
            w = rotated_fp16(vals[i], inv, lane, convert=fp16_in_both)
            # The lower lane keeps words j = 0, 1 and sends 2, 3; the upper the reverse.
            send = [cutlass.select_(upper, w[j], w[j + 2]) for j in range(2)]
            got = [cute.arch.shuffle_sync_bfly(v, offset=2) for v in send]
            out = [cutlass.select_(upper, got[0], w[0]), cutlass.select_(upper, w[2], got[0]),
                   cutlass.select_(upper, got[1], w[1]), cutlass.select_(upper, w[3], got[1])]
            word = ((c0 + 4 * lane) // 16) * 16 + 8 * (q % 2) + 4 * (q // 2)
            for r in cutlass.range_constexpr(cluster):
                st_cluster_v4(xs_address + 4 * word, r, out)


def abs_max(amax, v):
    """amax folded with max|v_i| (Float32 list). Plain Python inlined at trace time."""
    for x in v:
        amax = cute.arch.fmax(amax, cute.arch.fmax(x, -x))
    return amax


def _block_inputs(x, suhs, src, blk, lane, cfg):
    """(first column, this lane's 4 fp32 values x * suh) of 128-block ``blk`` of the row at
    ``src`` (member blk // (x_width / 128); the member's suh chosen by select, every member's
    index being in bounds). Plain Python inlined at trace time."""
    col = blk * 128 + 4 * lane
    member = blk // (cfg.x_width // 128)
    xcol = col - member * cfg.x_width
    suh4 = [Float32(suhs[0][xcol + e]) for e in range(4)]
    for h in range(1, cfg.inputs):
        suh4 = [cutlass.select_(member == h, Float32(suhs[h][xcol + e]), suh4[e])
                for e in range(4)]
    return col, [Float32(x[src + xcol + e]) * suh4[e] for e in range(4)]


@dsl_user_op
def _barrier_zero(*, loc=None, ip=None) -> Uint32:
    """0, as the thread count of a CTA barrier (bar.red.popc of false). The row max ORs it into
    every loaded word: ptxas moves neither a memory load below a barrier nor a use of the
    barrier's result above it, so all loads of a batch are issued before the first use (left
    alone, ptxas interleaved the 16-byte loads with the max at 34 registers: a memory round
    trip per step or two). Every thread of the CTA must reach it."""
    res = llvm.inline_asm(T.i32(), [], "{\n.reg .pred f;\n    setp.ne.u32 f, 0, 0;\n"
                          "    bar.red.popc.u32 $0, 0, f;\n}", "=r", has_side_effects=True,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(res)


@dsl_user_op
def _load_f16x4(addr, *, loc=None, ip=None) -> list:
    """fp32 of the 4 fp16 at the 8-byte aligned global address ``addr`` (Int64): one 8-byte
    read-only load (a layer's svh / bias table) and 4 exact conversions."""
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4),
                          [Int64(addr).ir_value(loc=loc, ip=ip)],
                          "{\n.reg .b16 h0, h1, h2, h3;\n"
                          "    ld.global.nc.v4.b16 {h0, h1, h2, h3}, [$4];\n"
                          "    cvt.f32.f16 $0, h0;\n    cvt.f32.f16 $1, h1;\n"
                          "    cvt.f32.f16 $2, h2;\n    cvt.f32.f16 $3, h3;\n}",
                          "=f,=f,=f,=f,l", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


_UNPACK_ASM = {                  # (word | zero) -> fp32 of its elements (exact), element order
    BFloat16: "{\n.reg .b32 t, l, h;\n    or.b32 t, $2, $3;\n    shl.b32 l, t, 16;\n"
              "    and.b32 h, t, 0xFFFF0000;\n    mov.b32 $0, l;\n    mov.b32 $1, h;\n}",
    Float16: "{\n.reg .b32 t;\n.reg .b16 l, h;\n    or.b32 t, $2, $3;\n"
             "    mov.b32 {l, h}, t;\n    cvt.f32.f16 $0, l;\n    cvt.f32.f16 $1, h;\n}",
    Float32: "{\n.reg .b32 t;\n    or.b32 t, $1, $2;\n    mov.b32 $0, t;\n}",
}


@dsl_user_op
def _unpack(word, zero, dtype, *, loc=None, ip=None) -> list:
    """The fp32 values of the ``dtype`` elements (bf16 / f16: 2, f32: 1) of one loaded word,
    after ORing in ``zero`` (``_barrier_zero``)."""
    n = 32 // dtype.width
    res = llvm.inline_asm(
        T.f32() if n == 1 else llvm.StructType.get_literal([T.f32()] * n),
        [Uint32(word).ir_value(loc=loc, ip=ip), Uint32(zero).ir_value(loc=loc, ip=ip)],
        _UNPACK_ASM[dtype], ",".join(["=f"] * n + ["r", "r"]), has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    if n == 1:
        return [Float32(res)]
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


def _rotate_store(v, factor, row, col, lane, out, cfg):
    """Scale, H128 across the warp and the fp16 stores of one 128-block (layout contract).
    Plain Python inlined at trace time."""
    v = hadamard128_lane([v[e] * factor for e in range(4)], lane)
    for e in range(4):
        h16 = Float16(v[e] * Float32(SCALE))
        if cfg.layout == "rows":
            out[row * cfg.width + col + e] = h16
        elif cfg.layout == "token":             # one row (HadamardConfig checks rows == 1)
            word = token_fragment_word(col + e)
            out[2 * word] = h16
            out[2 * word + 1] = h16
        elif cfg.layout == "quads":
            out[quad_fragment_index(row, col + e, cfg.width // 16, min(cfg.rows, 8))] = h16
        elif cfg.layout == "pairs":
            G, kt, q, ln, h = pair_fragment_slot(row, col + e)
            out[2 * pair_fragment_word(G, kt, q, ln, cfg.width // 16) + h] = h16
        else:
            G, kt, q, ln = b_fragment_slot(row, col + e)
            word = b_fragment_word(G, kt, q, ln, cfg.width // 16)
            out[2 * word] = h16
            out[2 * word + 1] = h16


@cute.kernel
def _hadamard_in_kernel(x: cute.Tensor, suh0: cute.Tensor, suh1: cute.Tensor, suh2: cute.Tensor,
                        out: cute.Tensor, scale: cute.Tensor, cfg: cutlass.Constexpr):
    suhs = [suh0, suh1, suh2][:cfg.inputs]
    tid, lane, warp, (bx, _, _) = cta_thread_ids()
    row = bx // cfg.row_ctas
    chunk = bx % cfg.row_ctas
    # Padding rows read row valid-1 and are zeroed by a factor: no divergent branch around
    # the warp shuffles, and x needs no padded copy.
    src = cutlass.min(row, cfg.valid - 1) * cfg.x_width
    keep = cutlass.select_(row < cfg.valid, Float32(1.0), Float32(0.0))

    # Every load is issued before the first is used: each dependent round trip to memory costs
    # ~0.7 us here (suh comes from HBM), which is what made a first version of this kernel
    # 5-7 us long (measured). One block per warp (decode): its own inputs first, at a clamped
    # block index (in bounds; stored only when real).
    blk1 = chunk * WARPS + warp
    if cutlass.const_expr(cfg.per_warp == 1):
        col1, v1 = _block_inputs(x, suhs, src, cutlass.min(blk1, cfg.row_blocks - 1), lane, cfg)

    # The row's max|x * suh_g| over every member (a clamped step re-reads the last STEP
    # elements, which leaves the max unchanged), then the CTA's max through shared memory.
    # Padding rows (7 of 8 at m = 1) skip it: their scale is 1 and their output zeros. Step u
    # of a thread is elements STEP * u .. STEP * u + 7 of the row, as 16-byte words (one
    # LDG.128 each; rows and suh are 16-byte aligned: x_width is a multiple of 128): at decode
    # every CTA of a row re-reads the whole row, and one load per element made this loop
    # load-instruction bound (ncu, bench/NOTES.md). Exact unpacking, fp32 products and an
    # exact max: the same s as one element per load. Each batch ends in a barrier
    # (_barrier_zero), which every thread reaches: row < valid is the same for the whole CTA.
    amax = Float32(0.0)
    if row < cfg.valid:
        x_bytes = x.element_type.width // 8
        x_row = (x.iterator.toint()
                 + Int64(cutlass.min(row, cfg.valid - 1)) * (cfg.x_width * x_bytes))
        suh_at = [sg.iterator.toint() for sg in suhs]
        row_steps = cfg.x_width // STEP
        batch = cfg.load_batch(x.element_type.width)
        for j0 in cutlass.range_constexpr(0, cfg.max_steps, batch):
            # tid < THREADS: only a step that can pass the row's end needs the clamp
            steps = [tid + j * THREADS if (j + 1) * THREADS <= row_steps
                     else cutlass.min(tid + j * THREADS, row_steps - 1)
                     for j in range(j0, min(j0 + batch, cfg.max_steps))]
            x_batch = [[w for h in range(x_bytes // 2)
                        for w in ld_global_v4(x_row + Int64(u) * (STEP * x_bytes) + 16 * h)]
                       for u in steps]
            suh_batch = [[ld_global_v4(a + Int64(u) * (2 * STEP)) for u in steps]
                         for a in suh_at]
            zero = _barrier_zero()
            for j in cutlass.range_constexpr(len(steps)):
                xv = [v for w in x_batch[j] for v in _unpack(w, zero, x.element_type)]
                for gm in cutlass.range_constexpr(cfg.inputs):
                    sv = [v for w in suh_batch[gm][j] for v in _unpack(w, zero, Float16)]
                    for e in cutlass.range_constexpr(STEP):
                        p = xv[e] * sv[e]
                        amax = cute.arch.fmax(amax, cute.arch.fmax(p, -p))
    s = cutlass.select_(row < cfg.valid, row_scale(cta_max(amax, warp)), Float32(1.0))
    if tid + chunk == 0:                  # one writer per row
        scale[row] = s
    factor = keep * power_of_two_inverse(s)

    if cutlass.const_expr(cfg.per_warp == 1):
        if blk1 < cfg.row_blocks:
            _rotate_store(v1, factor, row, col1, lane, out, cfg)
    else:
        for i in cutlass.range_constexpr(cfg.per_warp):
            blk = (chunk * cfg.per_warp + i) * WARPS + warp       # 128-block within the row
            if blk < cfg.row_blocks:
                col, v = _block_inputs(x, suhs, src, blk, lane, cfg)
                _rotate_store(v, factor, row, col, lane, out, cfg)


@cute.kernel
def _hadamard_out_kernel(part: cute.Tensor, svh0: cute.Tensor, svh1: cute.Tensor,
                         svh2: cute.Tensor, bias0: cute.Tensor, bias1: cute.Tensor,
                         bias2: cute.Tensor, scale: cute.Tensor, y: cute.Tensor,
                         cfg: cutlass.Constexpr):
    svhs, biases = [svh0, svh1, svh2], [bias0, bias1, bias2]
    lane, blk = warp_task(WARPS)
    if blk < cfg.blocks:
        row, col = block_row_col(blk, cfg.width, lane)
        # svh and bias of the member owning these columns: each member's value at a clamped
        # (in-bounds) index, the owner's kept by select (no block straddles two members).
        # They are the layer's own tables, so they load before the wait for the partials (a
        # programmatic dependent launch behind the GEMM: trellis_linear; else a no-op). A
        # lane's 4 columns are contiguous and 16-byte aligned (width and members are whole
        # 128-blocks): one 8-byte load per table, one 16-byte load per partial, one 16-byte
        # store (4 scalar accesses each made the prefill-size transform LSU-bound).
        n0 = cfg.out_members[0]
        gcol = cutlass.min(col, n0 - 4)
        sv = _load_f16x4(svhs[0].iterator.toint() + Int64(gcol) * 2)
        bv = [Float32(0.0)] * 4
        if cutlass.const_expr(cfg.has_bias(0)):
            bv = _load_f16x4(biases[0].iterator.toint() + Int64(gcol) * 2)
        for g in cutlass.range_constexpr(1, len(cfg.out_members)):
            own = col >= cfg.member_starts[g]
            gcol = cutlass.min(cutlass.max(col - cfg.member_starts[g], 0),
                               cfg.out_members[g] - 4)
            svg = _load_f16x4(svhs[g].iterator.toint() + Int64(gcol) * 2)
            sv = [cutlass.select_(own, svg[e], sv[e]) for e in range(4)]
            if cutlass.const_expr(cfg.has_bias(g)):
                bg = _load_f16x4(biases[g].iterator.toint() + Int64(gcol) * 2)
                bv = [cutlass.select_(own, bg[e], bv[e]) for e in range(4)]
            else:
                bv = [cutlass.select_(own, Float32(0.0), bv[e]) for e in range(4)]
        cute.arch.griddepcontrol_wait()
        part_at = part.iterator.toint()
        parts = [ld_global_v4(part_at + Int64((s * cfg.part_rows + row) * cfg.width + col) * 4,
                               Float32)
                 for s in range(cfg.splits)]        # every split's load before the first add
        v = parts[0]
        for s in cutlass.range_constexpr(1, cfg.splits):
            v = [v[e] + parts[s][e] for e in range(4)]
        v = hadamard128_lane(v, lane)
        rs = scale[row]
        st_global_v4(y.iterator.toint() + Int64(row * cfg.width + col) * 4,
                     [v[e] * Float32(SCALE) * sv[e] * rs + bv[e] for e in range(4)], Float32)


@cute.jit
def launch_hadamard_in(stream, x: cute.Tensor, suh0: cute.Tensor, suh1: cute.Tensor,
                       suh2: cute.Tensor, out: cute.Tensor, scale: cute.Tensor,
                       cfg: cutlass.Constexpr):
    _hadamard_in_kernel(x, suh0, suh1, suh2, out, scale, cfg).launch(
        grid=cfg.in_grid, block=(THREADS, 1, 1), stream=stream)


@cute.jit
def launch_hadamard_out(stream, part: cute.Tensor, svh0: cute.Tensor, svh1: cute.Tensor,
                        svh2: cute.Tensor, bias0: cute.Tensor, bias1: cute.Tensor,
                        bias2: cute.Tensor, scale: cute.Tensor, y: cute.Tensor,
                        cfg: cutlass.Constexpr):
    _hadamard_out_kernel(part, svh0, svh1, svh2, bias0, bias1, bias2, scale, y, cfg).launch(
        grid=cfg.grid, block=(THREADS, 1, 1), stream=stream)
