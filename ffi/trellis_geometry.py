"""Per-lane bit geometry of the in-register trellis decode, shared by every Trellis kernel.

Lane ``l`` of a warp decodes the 8 consecutive sequence elements t = 8l .. 8l+7 of a 16x16 tile:
these are exactly its m16n8k16 fragment registers (exl3_format.md 2.4), so no shuffles are needed.
Element t's 16-bit state is the ring window ending at bit S(t) (exclusive), S(t) = (t+1)K for
integer K, (t+1)KA + floor((t+1)/2) for half rates (exl3_format_165.md 1.2).

A lane reads its codes in ``groups`` of ``group`` consecutive elements. One group needs one 64-bit
funnel of two consecutive ring words: word ``wi`` (high half) and ``wi + 1`` (low half), both taken
modulo the tile's word count, so the tail-biting wrap of lane 0 is just a modulo. Within the funnel,
element q of the group sits at right shift ``sh0 - off[q]``: ``sh0`` depends on the lane (runtime,
computed once per kernel), ``off`` only on K (compile time). The group size is the largest divisor
of 8 for which every lane's group fits in the 64-bit funnel, so K=2 takes one funnel per tile and
lane, K=3..5 and half rates two, K=6..8 four.

Everything here is plain Python/numpy: the kernels import the constants, and
``emulate_lane_states`` runs the exact kernel formulas on the host so the geometry is tested
bit-exactly against the jnp reference decoder without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from exl3_jax.format.spec import rate_from_width, width_from_rate

LANES = 32
CODES_PER_LANE = 8


@dataclasses.dataclass(frozen=True)
class LaneGeometry:
    """Compile-time constants of the per-lane window extraction for one rate K."""
    K: float              # bits per weight (int, or 2.5 / 3.5 / 1.5)
    words: int            # uint32 words per tile (W / 2)
    group: int            # elements per 64-bit funnel
    lane_stride: int      # S(8(l+1) + c) - S(8l + c): bits per lane (8K, or 8KA + 4)
    group_base: tuple     # S(gi * group) for gi in groups, i.e. S(t_first) at lane 0
    offsets: tuple        # S(t_first + q) - S(t_first), q < group (same for every group)
    const_shift0: tuple = ()  # per group: sh0 when it is the same for every lane, else None
    top_states: tuple = ()    # per group: its first states whose shift is >= 16 in every lane
    byte_aligned: tuple = ()  # per group: every lane's lowest state starts on a byte boundary

    @property
    def groups(self) -> int:
        return CODES_PER_LANE // self.group

    def window_plan(self, gi: int):
        """Byte-window extraction of a lane-dependent, byte-aligned group gi (else None), for
        the FMA-pipe decode (cute_ops.lane_states): the lane's lowest state starts at byte j of
        its 64-bit funnel (j from the lane's sh0), so two byte permutes give 32-bit windows at
        bytes j and j + 2 (window_selectors) and state q sits at the compile-time shift
        o = span - offsets[q] of window 0 (o <= 16) or o - 16 of window 1. Returns per state
        (window, shift, fma): fma states are taken by two IMADs (a multiply that puts the state
        on top, a high multiply), the others by a shift and a mask on the ALU pipe (one
        instruction at shifts 0, 8, 16); as many go to the FMA pipe as balance the two pipes.
        Not used where every state is on top of its funnel in every lane (K = 1, 2:
        top_states), whose extraction is already one ALU and one FMA operation per state."""
        if (self.extraction(gi) is not None or not self.byte_aligned[gi]
                or self.top_states[gi] == self.group):    # all on top: one SHF + one IMAD.HI
            return None
        span = self.offsets[-1]
        states = [(0, span - off) if span - off <= 16 else (1, span - off - 16)
                  for off in self.offsets]
        windows = len({w for w, _ in states})
        alu_cost = [1 if sh in (0, 8, 16) else 2 for _, sh in states]
        movable = [q for q in range(len(states)) if alu_cost[q] == 2]
        alu = windows + len(states) + sum(alu_cost)       # permutes + codebook lop3s + shifts
        fma = len(states)                                  # the codebook multiplies
        n = 0
        while n < len(movable) and max(alu - 2 * (n + 1), fma + 2 * (n + 1)) < max(
                alu - 2 * n, fma + 2 * n):
            n += 1
        to_fma = set(movable[:n])
        return tuple((w, sh, q in to_fma) for q, (w, sh) in enumerate(states))

    def nibble_plan(self, gi: int):
        """K = 4's extraction on both pipes (cute_ops.lane_states with fma_pipe), or None for
        other rates: per state (base, op) with base "lo" (the funnel's low word), "left4" (lo
        << 4, an IMAD) or "mid12" (funnel >> 12, one SHF) and op "high" (bits 16..31, IMAD.HI),
        "byte" (bits 8..23, PRMT against zero), "fold" (bits 0..15 left unmasked, FoldedState
        with the base's "high" state) or "dup" (funnel bytes 3..4 permuted into both halves,
        cute_ops.DupState). 2 base words + 8 ops for 8 states (4 ALU, 5 FMA), against
        ``extraction``'s 3 funnel shifts + 8 (7 ALU, 4 FMA): the states at odd nibbles come
        from bytes of the two shifted words, the one across the word boundary from a byte
        permute that needs no mask."""
        if self.K != 4 or self.const_shift0[gi] != 28 or self.group != 8:
            return None
        by_shift = {0: ("lo", "fold"), 8: ("lo", "byte"), 16: ("lo", "high"), 24: ("lo", "dup"),
                    4: ("left4", "byte"), 12: ("left4", "high"), 20: ("mid12", "byte"),
                    28: ("mid12", "high")}
        return tuple(by_shift[28 - off] for off in self.offsets)

    def extraction(self, gi: int):
        """Compile-time extraction plan of group gi, or None if its shifts depend on the lane.

        Returns (bases, parts): ``bases`` are the right shifts b of 32-bit words
        r_b = (funnel >> b) mod 2^32 that the group needs (b = 0 is the low ring word itself, no
        instruction); element q's state is ``(r_b >> part) & 0xFFFF`` with (b, part) =
        parts[q] and part in {0, 8, 16}, one instruction each (a mask, a byte permute against
        zero, a 16-bit right shift) instead of a 64-bit funnel shift plus a mask per element.
        With K = 4 (one funnel of 8 codes at shifts 28, 24, ..., 0) that is 3 funnel shifts + 8
        = 11 instructions for 8 states instead of 16."""
        sh0 = self.const_shift0[gi] if self.const_shift0 else None
        if sh0 is None:
            return None
        shifts = [sh0 - off for off in self.offsets]
        bases: list[int] = []
        part_of: dict[int, tuple[int, int]] = {}
        for s in sorted(shifts):             # ascending: a base serves s, s + 8 and s + 16
            b = next((b for b in bases if s - b in (0, 8, 16)), None)
            if b is None:
                b = s
                bases.append(b)
            part_of[s] = (b, s - b)
        return tuple(bases), tuple(part_of[s] for s in shifts)


def end_bit(t, K):
    """Exclusive end bit S(t) of element t's code (numpy-friendly)."""
    t = np.asarray(t)
    if isinstance(K, float) and not float(K).is_integer():
        ka = int(K)
        return (t + 1) * ka + (t + 1) // 2
    return (t + 1) * int(K)


@functools.lru_cache(maxsize=None)
def lane_geometry(K) -> LaneGeometry:
    """Geometry for rate K (1..8 or 1.5/2.5/3.5)."""
    width = width_from_rate(K)
    K = rate_from_width(width)
    words = width // 2
    lanes = np.arange(LANES)
    for group in (8, 4, 2, 1):
        ok = True
        for gi in range(CODES_PER_LANE // group):
            t_first = CODES_PER_LANE * lanes + gi * group
            s_first = end_bit(t_first, K)
            start = s_first - 16
            sh0 = 48 - (start % 32)                       # right shift of element 0 in the funnel
            span = end_bit(t_first + group - 1, K) - s_first
            ok &= bool(np.all(sh0 - span >= 0))
            # offsets must not depend on the lane (t_first is always even for even group sizes)
        if ok:
            break
    offsets = tuple(int(end_bit(q, K) - end_bit(0, K)) for q in range(group))
    base = tuple(int(end_bit(gi * group, K)) for gi in range(CODES_PER_LANE // group))
    stride = int(end_bit(CODES_PER_LANE, K) - end_bit(0, K))
    geo = LaneGeometry(K=K, words=words, group=group, lane_stride=stride, group_base=base,
                       offsets=offsets)
    _check_lane_invariance(geo)
    const, top, aligned = [], [], []
    for gi in range(geo.groups):
        sh0s = {lane_funnel(geo, lane, gi)[2] for lane in range(LANES)}
        top.append(sum(min(sh0s) - off >= 16 for off in offsets))
        aligned.append(all((sh0 - offsets[-1]) % 8 == 0 for sh0 in sh0s))
        const.append(sh0s.pop() if len(sh0s) == 1 else None)
    return dataclasses.replace(geo, const_shift0=tuple(const), top_states=tuple(top),
                               byte_aligned=tuple(aligned))


def window_selectors(geo: LaneGeometry, sh0, minimum=min):
    """The two prmt selectors of a byte-aligned group's windows (LaneGeometry.window_plan):
    bytes j.. and j + 2.. of the (hi:lo) funnel, j = the lowest state's byte, each byte index
    clamped to 7 (the bytes past the funnel are never part of a state). Python or DSL integers
    (``minimum``: min, or cutlass.min in a kernel)."""
    j = (sh0 - geo.offsets[-1]) // 8
    return tuple(sum(minimum(j + first + k, 7) * 16 ** k for k in range(4)) for first in (0, 2))


def _check_lane_invariance(geo: LaneGeometry) -> None:
    """The kernel assumes S is affine in the lane and offsets are lane independent."""
    for lane in range(LANES):
        for gi in range(geo.groups):
            t_first = CODES_PER_LANE * lane + gi * geo.group
            s_first = int(end_bit(t_first, geo.K))
            assert s_first == geo.lane_stride * lane + geo.group_base[gi], (geo.K, lane, gi)
            for q in range(geo.group):
                assert int(end_bit(t_first + q, geo.K)) - s_first == geo.offsets[q], (geo.K, q)


def lane_funnel(geo: LaneGeometry, lane, gi):
    """(word index of the high half, of the low half, right shift of element 0) for a group.

    Called by the kernels on DSL integers (cute_ops.lane_funnels) and by the host emulation on
    Python ints, so one formula is tested on CPU and used on the GPU. Floor division of a
    possibly negative start bit: lane 0's first window wraps to the end of the tile.
    """
    s_first = lane * geo.lane_stride + geo.group_base[gi]
    wi_u = (s_first + 16) // 32 - 1             # floor((s_first - 16) / 32), s_first >= 1
    hi = (wi_u + geo.words) % geo.words
    lo = (wi_u + 1) % geo.words
    sh0 = 64 + 32 * wi_u - s_first
    return hi, lo, sh0


def emulate_lane_states(U: np.ndarray, K, fma_pipe: bool = False,
                        byte_windows: bool = False, nibbles: bool = False) -> np.ndarray:
    """Run the kernel's extraction on tiles' uint32 words U [..., words] -> states [..., 256]
    in sequence order (t = 8 lane + j); ``fma_pipe`` / ``byte_windows``: cute_ops.lane_states's
    top windows (LaneGeometry.top_states) and byte windows (window_plan); ``nibbles``: K = 4 by
    nibble_plan (as lane_states, with ``fma_pipe``). Host-side oracle for the geometry."""
    geo = lane_geometry(K)
    U = np.asarray(U, dtype=np.uint64)
    out = np.zeros(U.shape[:-1] + (LANES * CODES_PER_LANE,), dtype=np.uint32)
    for lane in range(LANES):
        for gi in range(geo.groups):
            hi, lo, sh0 = lane_funnel(geo, lane, gi)
            merged = (U[..., hi] << np.uint64(32)) | U[..., lo]
            plan = geo.extraction(gi)
            nplan = geo.nibble_plan(gi) if fma_pipe and nibbles else None
            for q in range(geo.group):
                t = CODES_PER_LANE * lane + gi * geo.group + q
                if nplan is not None:            # K = 4 on both pipes
                    out[..., t] = _nibble_state(merged, *nplan[q])
                    continue
                wplan = geo.window_plan(gi) if fma_pipe and byte_windows else None
                if wplan is not None:            # byte windows of the funnel
                    win, sh, fma = wplan[q]
                    sel = window_selectors(geo, sh0)[win]
                    byte_idx = [(sel >> (4 * k)) & 7 for k in range(4)]
                    w = sum(((merged >> np.uint64(8 * b)) & np.uint64(0xFF)) << np.uint64(8 * k)
                            for k, b in enumerate(byte_idx))
                    if fma:                      # state on top, then a high multiply
                        v = (w << np.uint64(16 - sh)) & np.uint64(0xFFFFFFFF)
                        out[..., t] = (v >> np.uint64(16)).astype(np.uint32)
                    else:
                        out[..., t] = ((w >> np.uint64(sh)) & np.uint64(0xFFFF)).astype(np.uint32)
                elif plan is None and fma_pipe and q < geo.top_states[gi]:   # state on top
                    r = (merged >> np.uint64(sh0 - 16 - geo.offsets[q])) & np.uint64(0xFFFFFFFF)
                    out[..., t] = (r >> np.uint64(16)).astype(np.uint32)
                elif plan is None:       # lane-dependent shift: 64-bit funnel + mask
                    sh = np.uint64(sh0 - geo.offsets[q])
                    out[..., t] = ((merged >> sh) & np.uint64(0xFFFF)).astype(np.uint32)
                else:                    # 32-bit base word, then mask / byte permute / shift
                    b, part = plan[1][q]
                    r = (merged >> np.uint64(b)) & np.uint64(0xFFFFFFFF)
                    out[..., t] = ((r >> np.uint64(part)) & np.uint64(0xFFFF)).astype(np.uint32)
    return out


def _nibble_state(merged, base: str, op: str):
    """One state of LaneGeometry.nibble_plan from 64-bit funnels (numpy uint64), as the kernel
    forms it (a "dup" state's word holds it twice; the state is either half)."""
    m32 = np.uint64(0xFFFFFFFF)
    words = {"lo": merged & m32, "left4": (merged << np.uint64(4)) & m32,
             "mid12": (merged >> np.uint64(12)) & m32}
    if op == "dup":
        b = [(merged >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(8)]
        w = b[3] | (b[4] << np.uint64(8)) | (b[3] << np.uint64(16)) | (b[4] << np.uint64(24))
        assert np.all((w >> np.uint64(16)) == (w & np.uint64(0xFFFF)))
        return (w & np.uint64(0xFFFF)).astype(np.uint32)
    r = words[base]
    shift = {"fold": 0, "byte": 8, "high": 16}[op]
    return ((r >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint32)


# Fragment placement: decoded element j of a lane -> register pair of the MMA operand.
# As the A operand of m16n8k16 (16 output columns x 16 input rows; the "swapped" decode form),
# A regs are {a0a1, a2a3, a4a5, a6a7} = elements {(0,1), (4,5), (2,3), (6,7)}.
A_OPERAND_PAIRS = ((0, 1), (4, 5), (2, 3), (6, 7))


B_REGS = 4               # B-fragment registers per lane, token group and k16 step (split pairs)


def b_fragment_slot(row, kk):
    """Where element (row, kk) of the rotated activation goes in the B-fragment layout that the
    dense decode kernel reads with split pairs: (token group G, k16 step kt, register i, lane).

    B of one m16n8k16 is 16 k x 8 tokens; lane 4*tok + t holds k rows 2t, 2t+1 (register 0)
    and 2t+8, 2t+9 (register 1). With split pairs each k row is alone in its register (in both
    halves, against a weight's two fp16 summands): register 2h + r holds k row 2t + 8r + h, so
    the even-k MMA takes registers (0, 1) and the odd-k MMA (2, 3). Plain integer arithmetic:
    the input-transform kernel runs it on DSL integers, the tests on numpy arrays."""
    w = kk % 16
    return row // 8, kk // 16, 2 * (w % 2) + w // 8, 4 * (row % 8) + (w % 8) // 2


P_REGS = 2               # packed B-fragment registers per lane, token group and k16 step


def pair_fragment_slot(row, kk):
    """Where element (row, kk) goes in the packed B-fragment layout ("pairs": packed kernels,
    two fp16 per register): (token group G, k16 step kt, register i, lane, half h). Lane
    4*tok + t holds k rows 2t, 2t+1 in register 0 (low, high half) and 2t+8, 2t+9 in
    register 1 (PTX m16n8k16 B layout). Plain integer arithmetic (DSL integers in the input
    transform, numpy in the tests)."""
    w = kk % 16
    return row // 8, kk // 16, w // 8, 4 * (row % 8) + (w % 8) // 2, w % 2


def pair_fragment_word(G, kt, i, lane, k16: int):
    """uint32 word of register i of ``lane`` (token group G, k16 step kt) in the "pairs"
    layout: each register index's 32 lanes are contiguous (one 128-byte load per warp, where
    row-major pairs touch 8 token rows' lines)."""
    return ((G * k16 + kt) * P_REGS + i) * LANES + lane


def row_fragment_slot(c):
    """One token's B fragments as a compact sequence (the row linear's shared memory): column
    c of the row (k16 step j = c // 16) goes to (j * 4 + i) * 4 + t, its register i and lane t
    < 4 of b_fragment_slot(0, c); lanes 4..31 (tokens 1..7) read lane t % 4's. Plain integer
    arithmetic (DSL integers in the kernel)."""
    kk = c % 16
    return ((c // 16) * 4 + 2 * (kk % 2) + kk // 8) * 4 + (kk % 8) // 2


def token_fragment_word(c):
    """One token's split-pair B fragments as the decode kernel reads them at m = 1 (MmaConfig
    one_token, layout "token"): column c (k16 step kt = c // 16) is register i of lane t < 4 of
    b_fragment_slot(0, c), at uint32 word (kt * 4 + t) * 4 + i, so each lane's 4 registers of
    a step are one 16-byte load, and lanes 4..31 (padding tokens 1..7) read lane t % 4's
    (their D columns are copies of token 0's, which nothing reads). A row of k columns is k
    words, 8x fewer than the 8 token rows of b_fragment_word. Plain integer arithmetic (DSL
    integers in the input transform, numpy in the tests)."""
    kk = c % 16
    return ((c // 16) * 4 + (kk % 8) // 2) * B_REGS + 2 * (kk % 2) + kk // 8


def quad_fragment_index(row, c, k16: int, group_rows: int = 8):
    """fp16 index of element (row, c) in the byte-sum kernels' "quads" layout: token groups of
    ``group_rows`` rows (8; 1 for one token, which makes it row-major), each k16 step of a group
    its rows' 16 values back to back, so the block of (group G, step kt) is x[8G .. 8G + 7, 16kt
    .. 16kt + 15] row-major and lane 4 tok + t's B pair (x rows 4t .. 4t + 3 of token tok,
    cute_ops.BYTESUM_ELEMENTS) is its words 2 lane, 2 lane + 1: one 8-byte load, 256 contiguous
    bytes per warp. Plain integer arithmetic (DSL integers in the input transform)."""
    return (((row // group_rows) * k16 + c // 16) * group_rows + row % group_rows) * 16 + c % 16


def b_fragment_word(G, kt, i, lane, k16: int):
    """uint32 word index of register i of ``lane`` for token group G, k16 step kt: a lane's 4
    registers of a step are contiguous (one 16-byte load per lane; a warp's load covers 512
    contiguous bytes)."""
    return ((G * k16 + kt) * LANES + lane) * B_REGS + i


class KSplitShape:
    """k16 / n16 tile counts and k16 steps per K-split of a kernel config with fields k, n (and
    splits): the base of every Trellis kernel config."""

    @property
    def k16(self) -> int:
        return self.k // 16

    @property
    def n16(self) -> int:
        return self.n // 16

    @property
    def k_per_split(self) -> int:
        return self.k16 // self.splits


def supported_rates() -> tuple:
    """Every rate the GPU kernels compile for (integer K = 1..8 and the mul1 half rates)."""
    return (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
