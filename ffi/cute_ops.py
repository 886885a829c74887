"""Device-side building blocks (CuTe DSL, inline PTX) shared by the Trellis kernels.

Only SM80-level PTX is used (mul/lop3/prmt/dp4a, f16x2 add/fma, mma.sync m16n8k16), so every kernel
built from these compiles unchanged for sm_90a (H200) and sm_120a (RTX PRO 6000); the cluster
helpers (cluster_rank, cluster_arrive / cluster_wait, st_cluster_v4: sm_90 distributed shared
memory) exist on both targets too.

Importing this module imports cutlass; keep it out of CPU-only import paths.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from exl3_jax.format.spec import MCG_MULTIPLIER, MUL1_MULTIPLIER
from exl3_jax.trellis.codebook import MUL1_CENTER, THREEINST_ADDEND, THREEINST_MULTIPLIER

from .trellis_geometry import LaneGeometry, lane_funnel, window_selectors

# Codebook arithmetic (exl3_format.md 3.1-3.3), as PTX:
#  * 3inst / mcg: x = state * a (+ b); x = (x & 0x8FFF8FFF) ^ 0x3B603B60 (lop3 0x6A);
#    value = fp16(lo16) + fp16(hi16), one RNE rounding.
#  * mul1: x = state * 0x83DCD12D; h = fp16 bits 0x6400 + bytesum(x) (= 1024 + sum exactly);
#    value = fma.rn.f16(h, 0x1EEE, 0xC931).
# A state is a 16-bit value (upper bits zero) or a FoldedState (lane_states): for those the
# product is formed from the unmasked word, which moves the 16-bit mask off the ALU pipe.
_LOP3 = "    lop3.b32 {0}, {0}, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n"


class FoldedState(NamedTuple):
    """The state ``word & 0xFFFF`` left unmasked, with ``high = word >> 16`` (which the lane
    extracts anyway, as another state). state * a = word * a - high * (a << 16) mod 2^32: two
    IMADs (FMA pipe) in place of a LOP3 mask (ALU pipe) and an IMAD."""
    word: object
    high: object


class DupState(NamedTuple):
    """The state in both halves of ``word`` (word = state * 65537, one byte permute of two
    source words, no mask): word * (a * 65537^-1 mod 2^32) = state * a mod 2^32, so the
    codebook multiply takes it with another constant (65537 is odd, hence invertible)."""
    word: object


_INV_65537 = pow(65537, -1, 2**32)


def _product(codebook: str, dst: str, operands: list) -> str:
    """PTX for dst = state * a (+ b) of one state whose registers are operands ($i names;
    ("dup", name) for a DupState)."""
    a = {"mcg": MCG_MULTIPLIER, "3inst": THREEINST_MULTIPLIER, "mul1": MUL1_MULTIPLIER}[codebook]
    b = THREEINST_ADDEND if codebook == "3inst" else 0
    if operands[0] == "dup":
        operands = operands[1:]
        a = a * _INV_65537 % 2**32
    if len(operands) == 1:
        op = f"mad.lo.u32 {dst}, {operands[0]}, {a}, {b}" if b else \
            f"mul.lo.u32 {dst}, {operands[0]}, {a}"
        return f"    {op};\n"
    word, high = operands
    first = f"mad.lo.u32 {dst}, {word}, {a}, {b}" if b else f"mul.lo.u32 {dst}, {word}, {a}"
    return f"    {first};\n    mad.lo.u32 {dst}, {high}, {(-(a << 16)) % 2**32}, {dst};\n"


def _state_operands(states, loc, ip):
    """(ir values, PTX operand names per state) of a list of states (plain or FoldedState)."""
    values, names = [], []
    for st in states:
        parts = list(st) if isinstance(st, (FoldedState, DupState)) else [st]
        tag = ["dup"] if isinstance(st, DupState) else []
        names.append(tag + [f"${1 + len(values) + i}" for i in range(len(parts))])
        values += [Uint32(v).ir_value(loc=loc, ip=ip) for v in parts]
    return values, names


def _asm_u32(values, body: str, loc, ip) -> Uint32:
    res = llvm.inline_asm(T.i32(), values, body, ",".join(["=r"] + ["r"] * len(values)),
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(res)


@dsl_user_op
def decode_pair(state_a, state_b, codebook: str, *, loc=None, ip=None) -> Uint32:
    """Codebook values of two states as one f16x2 word (the first in the low half, the
    lower-indexed element of an MMA register pair): one asm block keeps the f16x2 path (prmt +
    one add.f16x2 / fma.f16x2 per two weights) that the spec's arithmetic allows exactly."""
    values, (na, nb) = _state_operands([state_a, state_b], loc, ip)
    body = "{\n.reg .b32 xa, xb, lo, hi, ones, kinv, kbias;\n"
    body += _product(codebook, "xa", na) + _product(codebook, "xb", nb)
    if codebook == "mul1":
        body += ("    mov.b32 ones, 0x01010101;\n"
                 "    dp4a.u32.u32 xa, xa, ones, 0x6400;\n"
                 "    dp4a.u32.u32 xb, xb, ones, 0x6400;\n"
                 "    prmt.b32 lo, xa, xb, 0x5410;\n"
                 "    mov.b32 kinv, 0x1EEE1EEE;\n"
                 "    mov.b32 kbias, 0xC931C931;\n"
                 "    fma.rn.f16x2 $0, lo, kinv, kbias;\n}")
    else:
        body += (_LOP3.format("xa") + _LOP3.format("xb")
                 + "    prmt.b32 lo, xa, xb, 0x5410;\n"
                   "    prmt.b32 hi, xa, xb, 0x7632;\n"
                   "    add.rn.f16x2 $0, lo, hi;\n}")
    return _asm_u32(values, body, loc, ip)


# One state -> one weight, unpacked (split pairs), the MMA doing the codebook's last step against
# a B word that holds the activation in both halves:
#  * 3inst / mcg: the register is left as the lop3 made it, the value's two fp16 summands
#    (lo16, hi16); lo*x + hi*x = (lo + hi)*x is exact in the fp32 accumulator (both exponents
#    lie in 0b011xx, so lo + hi needs at most 15 bits). No HADD2: the weight is never rounded
#    to fp16 (its fp16 rounding is decode_states').
#  * mul1: the dp4a's accumulator puts fp16 1024 + bytesum in the low half (0x6400 + sum, no
#    carry: sum <= 1020) and fp16 -MUL1_CENTER in the high half, so the MMA adds the integer
#    (h - 1534) * x, exact; the kernel adds MUL1_RESIDUAL * sum(x) and scales by k_inv
#    (trellis_mma.mul1_affine). No PRMT, no HFMA2: IMAD + IDP4A per weight.
_MUL1_HALVES_INIT = (int(np.float16(-MUL1_CENTER).view(np.uint16)) << 16) | 0x6400
# The codebooks whose decode is a multiply and a lop3: ALU-bound (mul1's dp4a loads the FMA
# pipe), so they extract states on the FMA pipe where they can (lane_states).
LOP3_CODEBOOKS = ("mcg", "3inst")


@dsl_user_op
def decode_halves(state, codebook: str, *, loc=None, ip=None) -> Uint32:
    """One state as one f16x2 A register against a B word (x, x): for 3inst / mcg the two fp16
    summands (lo16, hi16) of its codebook value (the MMA adds (lo + hi) * x); for mul1
    (1024 + bytesum, -MUL1_CENTER) (the MMA adds the integer h - 1534 times x)."""
    values, (names,) = _state_operands([state], loc, ip)
    body = "{\n.reg .b32 x, ones;\n" + _product(codebook, "x", names)
    if codebook == "mul1":
        body += ("    mov.b32 ones, 0x01010101;\n"
                 f"    dp4a.u32.u32 $0, x, ones, {_MUL1_HALVES_INIT};\n}}")
    else:
        body += _LOP3.format("x") + "    mov.b32 $0, x;\n}"
    return _asm_u32(values, body, loc, ip)


@dsl_user_op
def codebook_product(state, codebook: str, *, loc=None, ip=None) -> Uint32:
    """The codebook's multiply alone, state * a (+ b) mod 2^32 (a plain or folded state): the
    word whose bytes the mul1 byte-sum MMA adds (mul1_bytesum_operand)."""
    values, (names,) = _state_operands([state], loc, ip)
    body = "{\n.reg .b32 x;\n" + _product(codebook, "x", names) + "    mov.b32 $0, x;\n}"
    return _asm_u32(values, body, loc, ip)


def _mma_sync(shape_types: str, a, b, c, acc, loc, ip):
    """D = A (4 regs) @ B (2 regs) + C (4 regs of ``acc``: Float32, or Uint32 for s32), one
    warp-wide mma.sync.aligned.<shape_types>."""
    ir_t, con = (T.f32(), "f") if acc is Float32 else (T.i32(), "r")
    operands = ([Uint32(v).ir_value(loc=loc, ip=ip) for v in [*a, *b]]
                + [acc(v).ir_value(loc=loc, ip=ip) for v in c])
    res = llvm.inline_asm(
        llvm.StructType.get_literal([ir_t] * 4),
        operands,
        f"mma.sync.aligned.{shape_types} "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        ",".join([f"={con}"] * 4 + ["r"] * 6 + [con] * 4),
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [acc(llvm.extractvalue(ir_t, res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def imma_m16n8k32_u8(a, b, c, *, loc=None, ip=None):
    """D = A(16x32 u8, 4 regs) @ B(32x8 u8, 2 regs) + C (4 s32), warp-wide mma.sync: lane 4g + t
    holds A rows g (regs 0, 2) and g + 8 (regs 1, 3) at k bytes 4t.. (regs 0, 1) and 16 + 4t..
    (regs 2, 3), B column g at the same k bytes, D as the f32 MMA's (rows g, g + 8, columns
    2t, 2t + 1)."""
    return _mma_sync("m16n8k32.row.col.s32.u8.u8.s32", a, b, c, Uint32, loc, ip)


# mul1 by a byte-sum MMA (MmaTiling.mul1_bytesum): a lane's 8 products x_e (codebook_product)
# go to two u8 MMAs as A rows of 4 bytes, against B = "k-quad q -> column q" ones, so D[row, q]
# = 0x6400 + bytesum, the fp16 bits of h = 1024 + bytesum (exact: bytesum <= 1020). Elements
# (0, 4, 2, 6) take the first MMA's registers (A rows g, g + 8, g, g + 8: the rows of the f16
# A registers A_OPERAND_PAIRS puts them in), (1, 5, 3, 7) the second's, so D1 column q holds
# input row 2q and D2 column q input row 2q + 1 (of the 16x16 tile, as the f16 MMA's A columns).
# A lane then holds input rows 4t .. 4t + 3 of its rows g, g + 8: packed in that order into the
# f16 A registers (PRMT of the two D's low halves), the f16 MMA needs B rows 2t, 2t + 1, 2t + 8,
# 2t + 9 = x rows 4t .. 4t + 3, i.e. B register pair = row-major words 2t, 2t + 1 of x (layout
# "quads"). Per 8 weights: 8 IMAD, 2 IMMA, 4 PRMT and 1 f16 MMA per token group, against 8 IMAD,
# 8 IDP and 2 MMAs per group of the split pairs; yet 9-60% slower on the H200 (session 28,
# bench/NOTES.md: the timings fit a u8 MMA that costs two f16 MMAs of tensor-pipe time), so it
# is opt-in (EXL3_JAX_MUL1_BYTESUM), kept for sm_120a where it is not timed.
BYTESUM_ELEMENTS = ((0, 4, 2, 6), (1, 5, 3, 7))
_F16_1024 = 0x6400


def bytesum_ones(lane):
    """The byte-sum MMA's B registers for ``lane`` (4g + t: column g, k bytes 4t.. and 16 +
    4t..): 1 in every byte of k-quad q = column g, so reg 0 is ones where t == g and reg 1
    where t + 4 == g. Computed once per kernel."""
    g, t = lane // 4, lane % 4
    ones = Uint32(0x01010101)
    return [cutlass.select_(t == g, ones, Uint32(0)),
            cutlass.select_(t + 4 == g, ones, Uint32(0))]


def mul1_bytesum_operand(states, ones):
    """The f16 A registers (A_OPERAND_PAIRS order) of one tile's 8 mul1 states: h = 1024 +
    bytesum of each product, exact fp16 integers (the MMA multiplies h; mul1_affine applies
    k_inv and the codebook's bias), input rows permuted as BYTESUM_ELEMENTS describes."""
    prods = [codebook_product(s, "mul1") for s in states]
    init = [Uint32(_F16_1024)] * 4
    d1, d2 = (imma_m16n8k32_u8([prods[e] for e in elems], ones, init)
              for elems in BYTESUM_ELEMENTS)
    return [permute_bytes(d1[r], d2[r], 0x5410) for r in (0, 2, 1, 3)]


@dsl_user_op
def mma_m16n8k16_f16_f32(a, b, c, *, loc=None, ip=None):
    """D = A(16x16 f16, 4 regs) @ B(16x8 f16, 2 regs) + C (4 f32), warp-wide mma.sync."""
    return _mma_sync("m16n8k16.row.col.f32.f16.f16.f32", a, b, c, Float32, loc, ip)


def lane_funnels(geo: LaneGeometry, lane):
    """Per-group (high word, low word, shift of element 0, window selectors) for this lane;
    computed once per kernel since they do not depend on the tile (the selectors only where
    the group has a byte-window plan, else None). The same functions the host emulation
    (trellis_geometry.emulate_lane_states) runs, here on DSL integers."""
    out = []
    for gi in range(geo.groups):
        hi, lo, sh0 = lane_funnel(geo, lane, gi)
        sel = (window_selectors(geo, sh0, cutlass.min) if geo.window_plan(gi) is not None
               else None)
        out.append((hi, lo, sh0, sel))
    return out


@dsl_user_op
def cp_async_16(address, src, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared (L2 only), completing asynchronously (cp.async groups):
    ``address`` a shared byte address, ``src`` a global byte address, both 16-byte aligned."""
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip),
                           Int64(src).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def inline_ptx(body: str, *, loc=None, ip=None) -> None:
    """A PTX statement with no operands, ordered with every memory access around it."""
    llvm.inline_asm(None, [], body, "~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def lane_pieces(lane, total: int, lanes: int = 32) -> list:
    """The pieces p = lane + lanes * i (i < ceil(total / lanes)) this lane copies of ``total``
    pieces split over the lanes; where they do not divide, the spare lanes take the last piece
    again (the same bytes to the same place), so every lane issues the same copies."""
    out = []
    for i in range(-(-total // lanes)):
        p = lane + lanes * i
        out.append(cutlass.min(p, total - 1) if total % lanes else p)
    return out


def cp_async_commit():
    """Close this thread's cp.async group (the copies issued since the last commit)."""
    inline_ptx("cp.async.commit_group;")


def cp_async_wait(pending: int):
    """Wait until at most ``pending`` of this thread's cp.async groups are still in flight (the
    copies become visible to the issuing thread; other threads need a barrier after)."""
    inline_ptx(f"cp.async.wait_group {pending};")


def load_tile_words(tw, tile_base, funnels, geo: LaneGeometry):
    """Issue this lane's global loads for one tile: [(high word, low word)] per group.

    Kept separate from ``decode_words`` so kernels can issue the loads of several tiles before
    decoding any of them (memory-level parallelism: the decode is short, the loads are not)."""
    return [(tw[tile_base + f[0]], tw[tile_base + f[1]]) for f in funnels]


@dsl_user_op
def times_power_of_two(r, k: int, *, loc=None, ip=None) -> Uint32:
    """r << k (mod 2^32) as a multiply by 2^k (an IMAD on the FMA pipe, not the ALU's SHF)."""
    return _asm_u32([Uint32(r).ir_value(loc=loc, ip=ip)], f"mul.lo.u32 $0, $1, {1 << k};",
                    loc, ip)


@dsl_user_op
def high_half(r, *, loc=None, ip=None) -> Uint32:
    """r >> 16 as a high multiply by 2^16 (IMAD.HI: the FMA pipe, not the ALU pipe's SHF)."""
    return _asm_u32([Uint32(r).ir_value(loc=loc, ip=ip)], "mul.hi.u32 $0, $1, 65536;", loc, ip)


def lane_states(words, funnels, geo: LaneGeometry, fma_pipe: bool = False,
                byte_windows: bool = False, nibbles: bool = False):
    """This lane's 8 states of one tile (element order), from the words of
    ``load_tile_words``.

    Where the shifts depend on the lane, each state is one 64-bit funnel shift (SHF.R.U64) and
    a 16-bit mask (both ALU); with ``fma_pipe``, for the states that lie at bit 16 or above in
    every lane (LaneGeometry.top_states: all 8 at K = 1, 2; 2 of 8 at K = 3), the funnel puts
    the state in its top 16 bits and a high multiply takes them (ALU + FMA). Where the shifts
    are the same for every lane (K = 4, 8) each state is one instruction on a shared 32-bit
    base word (``LaneGeometry.extraction``); with ``fma_pipe`` its 16-bit shifts are high
    multiplies and a mask whose base word also yields a shifted state is folded into the
    codebook multiply (FoldedState). fma_pipe serves the ALU-bound decodes (LOP3_CODEBOOKS):
    it trades ALU operations for FMA-pipe ones, one for one. ``byte_windows`` (split pairs,
    where the ALU binds harder than the issue rate): byte-aligned lane-dependent groups (K = 3,
    5, 6) are read from two byte-permuted 32-bit windows at compile-time shifts instead
    (LaneGeometry.window_plan), about half their states by two IMADs. ``nibbles`` (with
    ``fma_pipe``): K = 4 by LaneGeometry.nibble_plan instead of ``extraction``."""
    states = []
    for gi in range(geo.groups):
        hi, lo = words[gi]
        merged = (Uint64(hi) << Uint64(32)) | Uint64(lo)
        plan = geo.extraction(gi)
        wplan = geo.window_plan(gi) if fma_pipe and byte_windows else None
        if wplan is not None:     # byte windows: compile-time shifts inside two 32-bit words
            sels = funnels[gi][3]
            wins = [permute_bytes(lo, hi, sels[w]) for w in sorted({w for w, _, _ in wplan})]
            for w, sh, fma in wplan:
                r = wins[w]
                if fma:           # the state on top (a multiply), then a high multiply
                    states.append(high_half(r if sh == 16 else times_power_of_two(r, 16 - sh)))
                elif sh == 0:
                    states.append(r & Uint32(0xFFFF))
                elif sh == 8:
                    states.append(byte_window(r))
                elif sh == 16:
                    states.append(r >> Uint32(16))
                else:
                    states.append((r >> Uint32(sh)) & Uint32(0xFFFF))
            continue
        if plan is None:          # the shift depends on the lane: one funnel per state
            sh0 = funnels[gi][2]
            for q, off in enumerate(geo.offsets):
                if fma_pipe and q < geo.top_states[gi]:
                    states.append(high_half(Uint32(merged >> Uint64(sh0 - 16 - off))))
                else:
                    states.append(Uint32(merged >> Uint64(sh0 - off)) & Uint32(0xFFFF))
            continue
        nplan = geo.nibble_plan(gi) if fma_pipe and nibbles else None
        if nplan is not None:     # K = 4 on both pipes: two base words, one op per state
            lo32 = Uint32(lo)
            base = {"lo": lo32, "left4": times_power_of_two(lo32, 4),
                    "mid12": Uint32(merged >> Uint64(12))}
            highs = {b: high_half(base[b]) for b, op in nplan if op == "high"}
            for b, op in nplan:
                if op == "high":
                    states.append(highs[b])
                elif op == "byte":
                    states.append(byte_window(base[b]))
                elif op == "fold":
                    states.append(FoldedState(base[b], highs[b]))
                else:             # "dup": funnel bytes 3, 4 in both halves
                    states.append(DupState(permute_bytes(lo32, hi, 0x4343)))
            continue
        # Compile-time shifts (K = 4, 8): a few 32-bit base words, one instruction per state.
        bases, parts = plan
        base = {b: Uint32(lo) if b == 0 else Uint32(merged >> Uint64(b)) for b in bases}
        highs = {b: high_half(base[b]) if fma_pipe else base[b] >> Uint32(16)
                 for b, part in parts if part == 16}
        for b, part in parts:
            r = base[b]
            if part == 16:
                states.append(highs[b])
            elif part == 8:
                states.append(byte_window(r))
            elif fma_pipe and b in highs:
                states.append(FoldedState(r, highs[b]))
            else:
                states.append(r & Uint32(0xFFFF))
    return states


def decode_words(words, funnels, geo: LaneGeometry, codebook: str, nibbles: bool = False):
    """This lane's 4 f16x2 registers of one tile, in element order ((e0,e1), (e2,e3), (e4,e5),
    (e6,e7)): two weights packed per register (``nibbles``: as lane_states')."""
    states = lane_states(words, funnels, geo, codebook in LOP3_CODEBOOKS, nibbles=nibbles)
    return [decode_pair(states[2 * p], states[2 * p + 1], codebook) for p in range(4)]


def decode_words_split(words, funnels, geo: LaneGeometry, codebook: str, nibbles: bool = False):
    """This lane's 8 weights of one tile, one f16x2 register each (element order,
    ``decode_halves``; ``nibbles``: as lane_states')."""
    lop3 = codebook in LOP3_CODEBOOKS
    states = lane_states(words, funnels, geo, fma_pipe=lop3, byte_windows=lop3, nibbles=nibbles)
    return [decode_halves(s, codebook) for s in states]


@dsl_user_op
def _ld_nc(addr, offset: int, n: int, *, loc=None, ip=None) -> list:
    regs = ", ".join(f"${i}" for i in range(n))
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * n),
                          [Int64(addr).ir_value(loc=loc, ip=ip)],
                          f"ld.global.nc.v{n}.u32 {{{regs}}}, [${n}+{offset}];",
                          "=r," * n + "l", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


def load_words_v4(words, index, offset: int = 0):
    """words[index + offset .. + 3] of a global uint32 tensor as one 16-byte load
    (LDG.E.128.CONSTANT; index + offset a multiple of 4; offset a compile-time int, folded
    into the instruction's immediate). Read-only data: the tensor must not be written while
    the kernel runs (the decode kernel's activation words, written by the kernel before it)."""
    return _ld_nc(words.iterator.toint() + Int64(index) * 4, 4 * offset, 4)


def load_words_v2(words, index, offset: int = 0):
    """words[index + offset], [.. + 1] as one 8-byte load (index + offset even), as
    load_words_v4."""
    return _ld_nc(words.iterator.toint() + Int64(index) * 4, 4 * offset, 2)


@dsl_user_op
def _ld_shared(address, n: int, *, loc=None, ip=None) -> list:
    regs = ", ".join(f"${i}" for i in range(n))
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * n),
                          [Int32(address).ir_value(loc=loc, ip=ip)],
                          f"ld.shared.v{n}.u32 {{{regs}}}, [${n}];", "=r," * n + "r",
                          has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


def load_shared_words_v4(words, index, offset: int = 0):
    """words[index + offset .. + 3] of a shared-memory uint32 tensor as one 16-byte load
    (LDS.128; index + offset a multiple of 4). A side effect for LLVM, so it stays behind
    the barrier that publishes the stores it reads."""
    return _ld_shared(words.iterator.toint() + Int32(index) * 4 + 4 * offset, 4)


def load_shared_words_v2(words, index, offset: int = 0):
    """words[index + offset], [.. + 1] of a shared-memory uint32 tensor as one 8-byte load
    (LDS.64; index + offset even), as load_shared_words_v4."""
    return _ld_shared(words.iterator.toint() + Int32(index) * 4 + 4 * offset, 2)


# The element kinds of the 16-byte global accesses below: (PTX type, register constraint, LLVM).
_V4_KINDS = {Uint32: ("u32", "r", T.i32), Float32: ("f32", "f", T.f32)}


@dsl_user_op
def ld_global_v4(addr, kind=Uint32, *, loc=None, ip=None) -> list:
    """The 4 elements (Uint32 or Float32) at the 16-byte aligned global address ``addr``
    (Int64): one ld.global.v4 (LDG.E.128). A coherent load (not .nc, which reads data assumed
    constant: callers read what an earlier launch wrote, or order it with a barrier); side
    effects, so that LLVM keeps these loads in program order with barriers."""
    ptx, reg, ty = _V4_KINDS[kind]
    res = llvm.inline_asm(llvm.StructType.get_literal([ty()] * 4),
                          [Int64(addr).ir_value(loc=loc, ip=ip)],
                          f"ld.global.v4.{ptx} {{$0, $1, $2, $3}}, [$4];",
                          f"={reg},={reg},={reg},={reg},l", has_side_effects=True,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [kind(llvm.extractvalue(ty(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_global_v4(addr, values, kind=Uint32, *, loc=None, ip=None) -> None:
    """The 4 ``values`` (Uint32 or Float32) to the 16-byte aligned global address ``addr``
    (Int64): one st.global.v4 (STG.E.128)."""
    ptx, reg, _ = _V4_KINDS[kind]
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)]
                    + [kind(v).ir_value(loc=loc, ip=ip) for v in values],
                    f"st.global.v4.{ptx} [$0], {{$1, $2, $3, $4}};",
                    f"l,{reg},{reg},{reg},{reg},~{{memory}}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def store_words_v4(words, index, values):
    """words[index .. index + 3] = values (4 Uint32) of a global uint32 tensor as one 16-byte
    store (STG.E.128; index a multiple of 4)."""
    st_global_v4(words.iterator.toint() + Int64(index) * 4, values)


@dsl_user_op
def permute_bytes(a, b, selector, *, loc=None, ip=None) -> Uint32:
    """prmt.b32 of (a, b): byte i of the result is byte (selector >> 4 i) & 7 of b:a; selector
    a Python int (an immediate) or a DSL integer (a register, e.g. lane-dependent)."""
    values = [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)]
    if isinstance(selector, int):
        return _asm_u32(values, f"prmt.b32 $0, $1, $2, {selector:#x};", loc, ip)
    values.append(Uint32(selector).ir_value(loc=loc, ip=ip))
    return _asm_u32(values, "prmt.b32 $0, $1, $2, $3;", loc, ip)


def byte_window(r):
    """(r >> 8) & 0xFFFF as one byte permute against zero."""
    return permute_bytes(r, Uint32(0), 0x4421)


def half_in_both(r, high: bool):
    """The low (or high) 16-bit half of r in both halves: one byte permute."""
    return permute_bytes(r, r, 0x3232 if high else 0x1010)


@dsl_user_op
def fma_f32(a, b, c, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once (fma.rn.f32), as inline PTX so the compiler keeps the form."""
    res = llvm.inline_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip),
                                    Float32(b).ir_value(loc=loc, ip=ip),
                                    Float32(c).ir_value(loc=loc, ip=ip)],
                          "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", has_side_effects=False,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def cluster_rank(*, loc=None, ip=None) -> Int32:
    """This CTA's rank in its thread-block cluster (%cluster_ctarank)."""
    res = llvm.inline_asm(T.i32(), [], "mov.u32 $0, %cluster_ctarank;", "=r",
                          has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(res)


def cluster_arrive(release: bool = True):
    """This thread's arrival at the cluster barrier: with ``release`` its earlier memory
    accesses (shared memory of other CTAs included) are ordered before the wait of every
    thread of the cluster; relaxed orders nothing (the kernel-start arrival that only proves
    every CTA of the cluster has started). All lanes of the warp."""
    inline_ptx("barrier.cluster.arrive.release.aligned;" if release
               else "barrier.cluster.arrive.relaxed.aligned;")


def cluster_wait():
    """Wait until every thread of the cluster has arrived (acquire). All lanes of the warp."""
    inline_ptx("barrier.cluster.wait.acquire.aligned;")


@dsl_user_op
def st_cluster_v4(address, rank, values, *, loc=None, ip=None) -> None:
    """The 4 Uint32 ``values`` to shared byte ``address`` (16-byte aligned, an address of this
    CTA's shared memory) of cluster CTA ``rank``'s shared memory: mapa + one 16-byte
    st.shared::cluster (distributed shared memory)."""
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip),
                           Int32(rank).ir_value(loc=loc, ip=ip)]
                    + [Uint32(v).ir_value(loc=loc, ip=ip) for v in values],
                    "{\n.reg .b32 a;\n    mapa.shared::cluster.u32 a, $0, $1;\n"
                    "    st.shared::cluster.v4.b32 [a], {$2, $3, $4, $5};\n}",
                    "r,r,r,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def fp16_in_both(v, *, loc=None, ip=None) -> Uint32:
    """fp16(v) (round to nearest even) in both halves of a word."""
    res = llvm.inline_asm(T.i32(), [Float32(v).ir_value(loc=loc, ip=ip)],
                          "{\n.reg .b16 h;\n    cvt.rn.f16.f32 h, $1;\n    mov.b32 $0, {h, h};\n}",
                          "=r,f", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Uint32(res)


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
    shuffles (the lane with the bit clear holds ``lo``).

    A shuffle stage is one fma per element, other + sign * v with sign = -1 in the upper lane:
    sign * v is exact, so it rounds as other - v and v + other do, and it takes no select per
    element (a select is an ALU-pipe instruction, and FC1's k loop is ALU-bound)."""
    v = [v[0] + v[1], v[0] - v[1], v[2] + v[3], v[2] - v[3]]
    v = [v[0] + v[2], v[1] + v[3], v[0] - v[2], v[1] - v[3]]
    for b in range(5):
        sign = cutlass.select_(((lane >> b) & 1) == 1, Float32(-1.0), Float32(1.0))
        v = [fma_f32(sign, e, cute.arch.shuffle_sync_bfly(e, offset=1 << b)) for e in v]
    return v


__all__ = ["FoldedState", "LOP3_CODEBOOKS", "block_row_col", "byte_window", "cluster_arrive",
           "cluster_rank", "cluster_wait", "cta_thread_ids", "decode_halves", "decode_pair",
           "decode_words", "decode_words_split", "fma_f32", "fp16_in_both", "half_in_both",
           "hadamard128_lane", "high_half", "lane_funnels", "lane_states", "load_tile_words",
           "load_words_v4", "mma_m16n8k16_f16_f32", "permute_bytes", "st_cluster_v4",
           "store_words_v4", "times_power_of_two", "warp_task"]
