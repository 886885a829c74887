"""The tail-biting Viterbi of ``viterbi.py`` as numba loops, for CPUs.

Same search, same arithmetic: per step every edge is extended by every code, the candidate cost
is ``cost_in + (table[s] - w)^2`` in fp32 (sub, mul, add; no FMA), its bits are ANDed with ~low and
ORed with the predecessor index, and the int32 minimum gives the surviving cost and back pointer at
once (``viterbi._exact_step``). Both passes (pass 1 over ``length`` elements from ``start``, pass 2
over the tile from the entry edge) and their backtracks run per tile; tiles run in parallel
(``prange``), so memory is a few MiB per thread whatever the batch.

The loops take the D pattern as arguments, so one compiled program (cached on disk by numba)
serves every rate. Why a second implementation: XLA:CPU runs the JAX step at ~0.85 cycles per
state per core, these loops at ~0.55-0.7 (12-15 us per K4 step; bench/NOTES.md, "The encoder's
search as numba loops"), because the loop order is picked per (D(t), D(t+1)) so the innermost
loop is a long contiguous run:

* "j-inner" (2^(16-D(t+1)-D(t)) >= 2^D(t), i.e. K <= 5): state s = (p, j, c) with p the
  predecessor index (top D(t+1) bits), c the new code (low D(t) bits), j the bits between. The
  edge in is (p, j) and the edge out is (j, c): for fixed p and c both are contiguous in j, so
  the loop runs over j with the table stored as [p, c, j] (``_layout_table``) and the minima kept
  as [c, j]; one transpose per step turns them back into edge order.
* "c-inner" (K >= 6): the loop runs over the 2^D(t) codes of one edge in, contiguous in the table
  and in the edge out, with the edge's cost a scalar.

XLA may contract or reorder the same arithmetic, so a last-ulp difference can break a near-tie the
other way: the two backends are tested for equal path costs (measured: identical states).
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

STATE_BITS = 16
TILE = 256


@intrinsic
def _as_int(typingctx, x):
    """float32 -> its int32 bit pattern."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def _as_float(typingctx, x):
    """int32 bit pattern -> float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _packed_min(typingctx, cand, keep, index, best):
    """min(best, (bits(cand) & keep) | index), all in int32 (numba would widen to int64)."""
    def codegen(context, builder, signature, args):
        c, k, i, b = args
        v = builder.or_(builder.and_(builder.bitcast(c, ir.IntType(32)), k), i)
        return builder.select(builder.icmp_signed("<", v, b), v, b)
    return types.int32(types.float32, types.int32, types.int32, types.int32), codegen


@njit(nogil=True, cache=True)
def _j_inner(dt, dn):
    """Loop order of the step for (D(t), D(t+1)) = (dt, dn): j-inner while the run of j's
    (2^(16-dn-dt)) is at least the run of codes (2^dt), i.e. integer K <= 5."""
    return (1 << (STATE_BITS - dn - dt)) >= (1 << dt)


def _layout_table(table: np.ndarray, dt: int, dn: int) -> np.ndarray:
    """The decode table in the order the step for (dt, dn) reads it: [p, c, j] (flattened) for
    the j-inner loop, the natural order for the c-inner one. float32 [65536]."""
    if not _j_inner(dt, dn):
        return np.ascontiguousarray(table, np.float32)
    p = np.arange(1 << dn)[:, None, None]
    c = np.arange(1 << dt)[None, :, None]
    j = np.arange(1 << (STATE_BITS - dn - dt))[None, None, :]
    return np.ascontiguousarray(table[(p << (STATE_BITS - dn)) | (j << dt) | c].ravel(),
                                np.float32)


@njit(nogil=True, boundscheck=False, cache=True)
def _step(wt, table, cost_in, cost_out, best, bp, dt, dn):
    """One Viterbi step for (D(t), D(t+1)) = (dt, dn).

    wt float32 target; table float32 [65536] (``_layout_table(., dt, dn)``); cost_in float32
    [2^(16-dt)] per edge in; writes cost_out float32 [2^(16-dn)] per edge out (in edge order) and
    bp uint8 [2^(16-dn)] (the top dn bits of each edge's best state, at ``_bp_slot``); best is
    int32 scratch [>= 2^(16-dn)].
    """
    C, J, P = 1 << dt, 1 << (STATE_BITS - dn - dt), 1 << dn
    low = np.int32((1 << dn) - 1)
    if _j_inner(dt, dn):
        _step_j_inner(wt, table, cost_in, cost_out, best, bp, C, J, P, low, np.int32(~low))
    else:
        _step_c_inner(wt, table, cost_in, cost_out, best, bp, C, J, P, low, np.int32(~low))


@njit(nogil=True, boundscheck=False, cache=True)
def _step_j_inner(wt, table, cost_in, cost_out, best, bp, C, J, P, low, keep):
    """``_step`` with j innermost: state (p, j, c), edge in (p, j), edge out (j, c); the minima
    are kept as [c, j] (and the back pointers stay so)."""
    for c in range(C):                            # p = 0 initialises; its index bits are 0
        tb = table[c * J:(c + 1) * J]
        bb = best[c * J:(c + 1) * J]
        for j in range(J):
            d = tb[j] - wt
            bb[j] = _as_int(cost_in[j] + d * d) & keep
    for p in range(1, P):
        index = np.int32(p)
        cb = cost_in[p * J:(p + 1) * J]
        for c in range(C):
            tb = table[(p * C + c) * J:(p * C + c + 1) * J]
            bb = best[c * J:(c + 1) * J]
            for j in range(J):
                d = tb[j] - wt
                bb[j] = _packed_min(cb[j] + d * d, keep, index, bb[j])
    for i in range(C * J):                        # back pointers stay in [c, j] order
        bp[i] = np.uint8(best[i] & low)
    for j in range(J):                            # costs go back to edge order (j, c)
        for c in range(C):
            cost_out[j * C + c] = _as_float(best[c * J + j] & keep)


@njit(nogil=True, boundscheck=False, cache=True)
def _step_c_inner(wt, table, cost_in, cost_out, best, bp, C, J, P, low, keep):
    """``_step`` with the codes innermost: the 2^dt codes of one edge in are contiguous in the
    table and in the edges out."""
    for j in range(J):
        ci = cost_in[j]
        tb = table[j * C:(j + 1) * C]
        bb = best[j * C:(j + 1) * C]
        for c in range(C):
            d = tb[c] - wt
            bb[c] = _as_int(ci + d * d) & keep
    for p in range(1, P):
        index = np.int32(p)
        for j in range(J):
            ci = cost_in[p * J + j]
            base = p * (C * J) + j * C
            tb = table[base:base + C]
            bb = best[j * C:(j + 1) * C]
            for c in range(C):
                d = tb[c] - wt
                bb[c] = _packed_min(ci + d * d, keep, index, bb[c])
    for i in range(C * J):
        bp[i] = np.uint8(best[i] & low)
        cost_out[i] = _as_float(best[i] & keep)


@njit(nogil=True, cache=True)
def _bp_slot(edge, dt, dn):
    """Where ``_step`` stored the back pointer of edge out ``edge``."""
    if _j_inner(dt, dn):
        return (edge & ((1 << dt) - 1)) * (1 << (STATE_BITS - dn - dt)) + (edge >> dt)
    return edge


@njit(nogil=True, boundscheck=False, cache=True)
def _forward(w_seq, steps, tables, cost, scratch, best, bps):
    """Steps over w_seq float32 [T] from ``cost`` (phase 0 first; D pattern ``steps`` int64 [P],
    ``tables`` float32 [P, 65536]). Returns the final cost array (one of the two buffers)."""
    P = steps.shape[0]
    for t in range(w_seq.shape[0]):
        ph = t % P
        _step(w_seq[t], tables[ph], cost, scratch, best, bps[t], steps[ph], steps[(ph + 1) % P])
        cost, scratch = scratch, cost
    return cost


@njit(nogil=True, boundscheck=False, cache=True)
def _backtrack(bps, steps, edge, last, first, states):
    """From the edge out of element ``last`` back to element ``first`` (indices into bps, phase 0
    at index 0): writes states[first..last] (int64)."""
    P = steps.shape[0]
    for t in range(last, first - 1, -1):
        dt, dn = steps[t % P], steps[(t + 1) % P]
        s = (np.int64(bps[t, _bp_slot(edge, dt, dn)]) << (STATE_BITS - dn)) | edge
        states[t] = s
        edge = s >> dt


@njit(nogil=True, boundscheck=False, cache=True)
def _encode_tile(w, steps, tables, start, length, out):
    """Both passes for one tile w float32 [256]; writes out uint16 [256]."""
    e_max = 1 << (STATE_BITS - steps.min())
    n_in0 = 1 << (STATE_BITS - steps[0])                # edges into a phase-0 element
    bps = np.empty((TILE, e_max), np.uint8)
    cost = np.empty(e_max, np.float32)
    scratch = np.empty(e_max, np.float32)
    best = np.empty(e_max, np.int32)
    states = np.empty(TILE, np.int64)
    # pass 1: unconstrained, over ``length`` elements from ``start``
    w_seq = np.empty(length, np.float32)
    for i in range(length):
        w_seq[i] = w[(start + i) % TILE]
    cost[:n_in0] = 0.0
    final = _forward(w_seq, steps, tables, cost, scratch, best, bps)
    last = TILE - start - 1                               # element 255 in the rolled order
    _backtrack(bps, steps, np.int64(np.argmin(final[:n_in0])), length - 1, last, states)
    edge0 = states[last] & (n_in0 - 1)
    # pass 2: elements 0..255, entering and leaving through edge0
    cost[:n_in0] = np.inf
    cost[edge0] = 0.0
    _forward(w, steps, tables, cost, scratch, best, bps)
    _backtrack(bps, steps, edge0, TILE - 1, 0, states)
    for t in range(TILE):
        out[t] = np.uint16(states[t])


@njit(parallel=True, nogil=True, cache=True)
def _encode_batch(w, steps, tables, start, length, out):
    for b in prange(w.shape[0]):
        _encode_tile(w[b], steps, tables, start, length, out[b])


@functools.lru_cache(maxsize=None)
def _layout_tables(codebook: str, steps: tuple[int, ...]) -> np.ndarray:
    """``_layout_table`` of the codebook for each phase of the D pattern: float32 [P, 65536]."""
    from .viterbi import decode_table_f32
    table = decode_table_f32(codebook)
    P = len(steps)
    tables = np.stack([_layout_table(table, steps[p], steps[(p + 1) % P]) for p in range(P)])
    tables.setflags(write=False)
    return tables


def encode_states(w: np.ndarray, codebook: str, steps: tuple[int, ...], start: int,
                  length: int) -> np.ndarray:
    """Tail-biting states of fp16-rounded targets w float32 [B, 256] for ``codebook`` and the D
    pattern ``steps`` (period 1 or 2); pass 1 covers ``length`` elements from ``start`` (both
    even). Returns uint16 [B, 256] (sequence order)."""
    steps = tuple(int(d) for d in steps)
    out = np.empty((w.shape[0], TILE), np.uint16)
    _encode_batch(np.ascontiguousarray(w, np.float32), np.asarray(steps, np.int64),
                  _layout_tables(codebook, steps), start, length, out)
    return out
