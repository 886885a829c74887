"""Device-side building blocks (CuTe DSL, inline PTX) shared by the Trellis kernels.

Only SM80-level PTX is used (mul/lop3/prmt/dp4a, f16x2 add/fma, mma.sync m16n8k16), so every kernel
built from these compiles unchanged for sm_90a (H200) and sm_120a (RTX PRO 6000).

Importing this module imports cutlass; keep it out of CPU-only import paths.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from exl3_jax.format.spec import MCG_MULTIPLIER, MUL1_MULTIPLIER

from .trellis_geometry import LaneGeometry, lane_funnel

THREEINST_MULTIPLIER = 89226354
THREEINST_ADDEND = 64248484

# Two states -> two codebook values packed as f16x2 (first state in the low half, which is the
# lower-indexed element of an MMA register pair). One asm block per pair keeps the f16x2 path
# (prmt + one add.f16x2 / fma.f16x2 per two weights) that the spec's arithmetic allows exactly:
#  * 3inst / mcg: x = state * a (+ b); x = (x & 0x8FFF8FFF) ^ 0x3B603B60 (lop3 0x6A);
#    value = fp16(lo16) + fp16(hi16), one RNE rounding (exl3_format.md 3.1/3.2).
#  * mul1: x = state * 0x83DCD12D; h = fp16 bits 0x6400 + bytesum(x) (= 1024 + sum exactly);
#    value = fma.rn.f16(h, 0x1EEE, 0xC931) (exl3_format.md 3.3).
_LOP3_TAIL = """
    lop3.b32 xa, xa, 0x8FFF8FFF, 0x3B603B60, 0x6A;
    lop3.b32 xb, xb, 0x8FFF8FFF, 0x3B603B60, 0x6A;
    prmt.b32 lo, xa, xb, 0x5410;
    prmt.b32 hi, xa, xb, 0x7632;
    add.rn.f16x2 $0, lo, hi;
}"""
_DECODE_PAIR_ASM = {
    "mcg": "{\n.reg .b32 xa, xb, lo, hi;\n"
           f"    mul.lo.u32 xa, $1, {MCG_MULTIPLIER};\n"
           f"    mul.lo.u32 xb, $2, {MCG_MULTIPLIER};" + _LOP3_TAIL,
    "3inst": "{\n.reg .b32 xa, xb, lo, hi;\n"
             f"    mad.lo.u32 xa, $1, {THREEINST_MULTIPLIER}, {THREEINST_ADDEND};\n"
             f"    mad.lo.u32 xb, $2, {THREEINST_MULTIPLIER}, {THREEINST_ADDEND};" + _LOP3_TAIL,
    "mul1": "{\n.reg .b32 xa, xb, ones, h, kinv, kbias;\n"
            f"    mul.lo.u32 xa, $1, {MUL1_MULTIPLIER};\n"
            f"    mul.lo.u32 xb, $2, {MUL1_MULTIPLIER};\n"
            "    mov.b32 ones, 0x01010101;\n"
            "    dp4a.u32.u32 xa, xa, ones, 0x6400;\n"
            "    dp4a.u32.u32 xb, xb, ones, 0x6400;\n"
            "    prmt.b32 h, xa, xb, 0x5410;\n"
            "    mov.b32 kinv, 0x1EEE1EEE;\n"
            "    mov.b32 kbias, 0xC931C931;\n"
            "    fma.rn.f16x2 $0, h, kinv, kbias;\n"
            "}",
}


@dsl_user_op
def decode_pair(state_a, state_b, codebook: str, *, loc=None, ip=None) -> Uint32:
    """Codebook values of two 16-bit states (upper bits must be zero) as one f16x2 word."""
    res = llvm.inline_asm(
        T.i32(),
        [Uint32(state_a).ir_value(loc=loc, ip=ip), Uint32(state_b).ir_value(loc=loc, ip=ip)],
        _DECODE_PAIR_ASM[codebook],
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Uint32(res)


# One state -> one weight, unpacked (split pairs): for 3inst / mcg the register is left as the
# lop3 made it, the codebook value's two fp16 summands (lo16, hi16), and the MMA does the sum
# against a B word that holds the activation in both halves: lo*x + hi*x = (lo + hi)*x, exact
# in the fp32 accumulator (both summands' exponents lie in 0b011xx, so lo + hi needs at most
# 15 bits). No HADD2: the weight is never rounded to fp16 (its fp16 rounding is decode_states).
_DECODE_HALVES_ASM = {
    cb: "{\n.reg .b32 x;\n" + mul + """
    lop3.b32 $0, x, 0x8FFF8FFF, 0x3B603B60, 0x6A;
}"""
    for cb, mul in (("mcg", f"    mul.lo.u32 x, $1, {MCG_MULTIPLIER};"),
                    ("3inst", f"    mad.lo.u32 x, $1, {THREEINST_MULTIPLIER}, {THREEINST_ADDEND};"))
}
SPLIT_PAIR_CODEBOOKS = tuple(_DECODE_HALVES_ASM)


@dsl_user_op
def decode_halves(state, codebook: str, *, loc=None, ip=None) -> Uint32:
    """The two fp16 summands (lo16, hi16) of the codebook value of one 16-bit state (upper bits
    zero) as one f16x2 word: an A register whose MMA against a B word (x, x) adds
    (lo + hi) * x."""
    res = llvm.inline_asm(
        T.i32(), [Uint32(state).ir_value(loc=loc, ip=ip)], _DECODE_HALVES_ASM[codebook], "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(res)


@dsl_user_op
def mma_m16n8k16_f16_f32(a, b, c, *, loc=None, ip=None):
    """D = A(16x16 f16, 4 regs) @ B(16x8 f16, 2 regs) + C (4 f32), warp-wide mma.sync."""
    operands = ([Uint32(v).ir_value(loc=loc, ip=ip) for v in a]
                + [Uint32(v).ir_value(loc=loc, ip=ip) for v in b]
                + [Float32(v).ir_value(loc=loc, ip=ip) for v in c])
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        operands,
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def lane_funnels(geo: LaneGeometry, lane):
    """Per-group (high word, low word, shift of element 0) for this lane; computed once per
    kernel since they do not depend on the tile. The same function the host emulation
    (trellis_geometry.emulate_lane_states) runs, here on DSL integers."""
    return [lane_funnel(geo, lane, gi) for gi in range(geo.groups)]


def load_tile_words(tw, tile_base, funnels, geo: LaneGeometry):
    """Issue this lane's global loads for one tile: [(high word, low word)] per group.

    Kept separate from ``decode_words`` so kernels can issue the loads of several tiles before
    decoding any of them (memory-level parallelism: the decode is short, the loads are not)."""
    return [(tw[tile_base + hi], tw[tile_base + lo]) for hi, lo, _ in funnels]


def lane_states(words, funnels, geo: LaneGeometry):
    """This lane's 8 16-bit states of one tile (element order), from the words of
    ``load_tile_words``. Each state is one 64-bit funnel shift (SHF.R.U64) and a 16-bit mask,
    or, where the shifts are the same for every lane (K = 4, 8), one instruction on a shared
    32-bit base word (``LaneGeometry.extraction``)."""
    states = []
    for gi in range(geo.groups):
        hi, lo = words[gi]
        merged = (Uint64(hi) << Uint64(32)) | Uint64(lo)
        plan = geo.extraction(gi)
        if plan is None:          # the shift depends on the lane: one funnel + mask per state
            sh0 = funnels[gi][2]
            for q in range(geo.group):
                sh = Uint64(sh0 - geo.offsets[q])
                states.append(Uint32(merged >> sh) & Uint32(0xFFFF))
            continue
        # Compile-time shifts (K = 4, 8): a few 32-bit base words, one instruction per state.
        bases, parts = plan
        base = {b: Uint32(lo) if b == 0 else Uint32(merged >> Uint64(b)) for b in bases}
        for b, part in parts:
            r = base[b]
            states.append(r & Uint32(0xFFFF) if part == 0 else
                          r >> Uint32(16) if part == 16 else byte_window(r))
    return states


def decode_words(words, funnels, geo: LaneGeometry, codebook: str):
    """This lane's 4 f16x2 registers of one tile, in element order ((e0,e1), (e2,e3), (e4,e5),
    (e6,e7)): two weights packed per register."""
    states = lane_states(words, funnels, geo)
    return [decode_pair(states[2 * p], states[2 * p + 1], codebook) for p in range(4)]


def decode_words_split(words, funnels, geo: LaneGeometry, codebook: str):
    """This lane's 8 weights of one tile, one f16x2 register each (element order): the two
    summands of each weight (``decode_halves``)."""
    return [decode_halves(s, codebook) for s in lane_states(words, funnels, geo)]


@dsl_user_op
def _ld_nc_v4(addr, offset: int, *, loc=None, ip=None) -> list:
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4),
                          [Int64(addr).ir_value(loc=loc, ip=ip)],
                          f"ld.global.nc.v4.u32 {{$0, $1, $2, $3}}, [$4+{offset}];",
                          "=r,=r,=r,=r,l", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def load_words_v4(words, index, offset: int = 0):
    """words[index + offset .. + 3] of a global uint32 tensor as one 16-byte load
    (LDG.E.128.CONSTANT; index + offset a multiple of 4; offset a compile-time int, folded
    into the instruction's immediate). Read-only data: the tensor must not be written while
    the kernel runs (the decode kernel's activation words, written by the kernel before it)."""
    return _ld_nc_v4(words.iterator.toint() + Int64(index) * 4, 4 * offset)


@dsl_user_op
def permute_bytes(a, b, selector: int, *, loc=None, ip=None) -> Uint32:
    """prmt.b32 of (a, b): byte i of the result is byte (selector >> 4 i) & 7 of b:a."""
    res = llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(res)


def byte_window(r):
    """(r >> 8) & 0xFFFF as one byte permute against zero."""
    return permute_bytes(r, Uint32(0), 0x4421)


def half_in_both(r, high: bool):
    """The low (or high) 16-bit half of r in both halves: one byte permute."""
    return permute_bytes(r, r, 0x3232 if high else 0x1010)


def cta_thread_ids():
    """(tid, lane, warp, (bx, by, bz)): this thread's index in the CTA, its lane and warp, and
    the CTA's grid index. Inlined at trace time."""
    tid, _, _ = cute.arch.thread_idx()
    bx, by, bz = cute.arch.block_idx()
    return tid, tid % 32, tid // 32, (bx, by, bz)


def warp_task(warps: int):
    """(lane, task) of this thread in a launch of one task per warp: task is the warp's global
    index (block bx runs tasks bx * warps .. bx * warps + warps - 1). Inlined at trace time."""
    tid, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    return tid % 32, bx * warps + tid // 32


def block_row_col(task, width: int, lane):
    """(row, first of this lane's 4 columns) of ``task`` when tasks walk the 128-column blocks
    of rows of ``width`` (a multiple of 128) row by row."""
    nb = width // 128
    return task // nb, (task % nb) * 128 + 4 * lane


def hadamard128_lane(v, lane):
    """Unnormalised Walsh-Hadamard transform of a 128-vector spread over a warp, lane l holding
    elements 4l..4l+3 (list of 4 Float32). Stages on index bits 0..6 (lo' = lo + hi,
    hi' = lo - hi), the reference order: bits 0-1 inside the lane, bits 2-6 by butterfly
    shuffles (the lane with the bit clear holds ``lo``)."""
    v = [v[0] + v[1], v[0] - v[1], v[2] + v[3], v[2] - v[3]]
    v = [v[0] + v[2], v[1] + v[3], v[0] - v[2], v[1] - v[3]]
    for b in range(5):
        upper = ((lane >> b) & 1) == 1
        out = []
        for e in range(4):
            other = cute.arch.shuffle_sync_bfly(v[e], offset=1 << b)
            out.append(cutlass.select_(upper, other - v[e], v[e] + other))
        v = out
    return v


__all__ = ["SPLIT_PAIR_CODEBOOKS", "block_row_col", "cta_thread_ids", "decode_pair",
           "decode_halves", "decode_words", "decode_words_split", "half_in_both", "lane_states", "hadamard128_lane",
           "lane_funnels", "load_tile_words", "load_words_v4", "mma_m16n8k16_f16_f32",
           "warp_task"]
