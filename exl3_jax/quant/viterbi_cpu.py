"""The tail-biting Viterbi of ``viterbi.py`` as numba loops, for CPUs.

Same search, same arithmetic: per step every edge is extended by every code, the candidate cost
is ``cost_in + (table[s] - w)^2`` in fp32 (sub, mul, add; no FMA), its bits are ANDed with ~low and
ORed with the predecessor index, and the int32 minimum gives the surviving cost and back pointer at
once (``viterbi._exact_step``). Both passes (pass 1 over ``length`` elements from ``start``, pass 2
over the tile from the entry edge) and their backtracks run per tile; tiles run in parallel
(``prange``), so memory is a few MiB per thread whatever the batch.

The step runs over the states in their natural order, 16 at a time, as explicit 16-lane LLVM
vectors (``_extend16_*``): state s = (p, e) with p the predecessor index (top D(t+1) bits) and e
the edge out (low 16 - D(t+1) bits), so for each p the table, the minima and the edges out are
all contiguous in e, and the edge in, s >> D(t), is one cost per 2^D(t) lanes (a broadcast, or a
short load spread over the lanes when 2^D(t) < 16). Nothing is transposed and the minima are
already in edge order. On AVX-512 CPUs the vectors are single zmm registers; elsewhere LLVM
splits them. Why explicit vectors: the loop vectoriser left 16-long runs scalar and a runtime
2^D(t) turned the edge-in index into a division (bench/NOTES.md, "The encoder step as explicit
vectors": ~1000 tiles/s at K4 fast on 2 cores, from ~570 with auto-vectorised loops).

XLA may contract or reorder the same arithmetic, so a last-ulp difference can break a near-tie the
other way: the two backends are tested for equal path costs (measured: identical states).
"""

from __future__ import annotations

import os

# numba's OpenMP workers spin after each parallel region by default; between encoder calls the
# build runs numpy and XLA work on the same cores, and the spinning slowed the default build's
# encoder by ~30% (bench/NOTES.md, "The encoder step as explicit vectors"). Read by libgomp
# when numba first starts its pool; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from ..format.spec import TILE_WEIGHTS as TILE  # noqa: E402
from .viterbi import STATE_BITS, decode_table_f32  # noqa: E402


@intrinsic
def _as_float(typingctx, x):
    """int32 bit pattern -> float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


LANES = 16


def _splat(builder, value, vec_type):
    """The scalar ``value`` in every lane of ``vec_type``."""
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(i32, 0))
    zeros = ir.Constant(ir.VectorType(i32, vec_type.count), [0] * vec_type.count)
    return builder.shuffle_vector(one, ir.Constant(vec_type, ir.Undefined), zeros)


def _is_c_vector(ty, dtype) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == dtype


def _make_extend16(codes: int):
    """An intrinsic extending 16 consecutive states (p, e..e+15) of a step whose edges take
    ``codes`` = 2^D(t) codes (16 stands for any multiple of 16: one edge in for all lanes):

    best[e + l] = min(best[e + l], (bits(cost_in[c0 + l // codes] + (table[t0 + l] - wt)^2)
                                    & keep) | index)   for l = 0..15, in int32.

    No bounds checks: the caller keeps t0 + 16 <= len(table), e + 16 <= len(best) and
    c0 + max(1, 16 // codes) <= len(cost_in)."""
    spread = [lane // codes for lane in range(LANES)] if codes < LANES else None

    @intrinsic
    def extend16(typingctx, table, t0, cost_in, c0, best, e, wt, keep, index):
        if not (_is_c_vector(table, types.float32) and _is_c_vector(cost_in, types.float32)
                and _is_c_vector(best, types.int32)):
            return None
        sig = types.void(table, types.intp, cost_in, types.intp, best, types.intp, types.float32,
                         types.int32, types.int32)

        def codegen(context, builder, signature, args):
            table_v, t0_v, cost_v, c0_v, best_v, e_v, wt_v, keep_v, index_v = args
            f32, i32 = ir.FloatType(), ir.IntType(32)
            vf, vi = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)

            def data(k, value):
                return context.make_array(signature.args[k])(context, builder, value).data

            tv = builder.load(builder.bitcast(builder.gep(data(0, table_v), [t0_v]),
                                              vf.as_pointer()), align=4)
            c_ptr = builder.gep(data(2, cost_v), [c0_v])
            if spread is None:
                cv = _splat(builder, builder.load(c_ptr), vf)
            else:
                short = ir.VectorType(f32, LANES // codes)
                cv = builder.shuffle_vector(
                    builder.load(builder.bitcast(c_ptr, short.as_pointer()), align=4),
                    ir.Constant(short, ir.Undefined), ir.Constant(vi, spread))
            d = builder.fsub(tv, _splat(builder, wt_v, vf))
            cand = builder.bitcast(builder.fadd(cv, builder.fmul(d, d)), vi)
            cand = builder.or_(builder.and_(cand, _splat(builder, keep_v, vi)),
                               _splat(builder, index_v, vi))
            b_ptr = builder.bitcast(builder.gep(data(4, best_v), [e_v]), vi.as_pointer())
            old = builder.load(b_ptr, align=4)
            builder.store(builder.select(builder.icmp_signed("<", cand, old), cand, old), b_ptr,
                          align=4)
            return context.get_dummy_value()

        return sig, codegen

    return extend16


_extend16_c2 = _make_extend16(2)
_extend16_c4 = _make_extend16(4)
_extend16_c8 = _make_extend16(8)
_extend16_wide = _make_extend16(LANES)


@njit(nogil=True, boundscheck=False, cache=True)
def _step(wt, table, cost_in, cost_out, best, bp, dt, dn):
    """One Viterbi step for (D(t), D(t+1)) = (dt, dn).

    wt float32 target; table float32 [65536] (decoded value per state); cost_in float32
    [2^(16-dt)] per edge in; writes cost_out float32 [2^(16-dn)] per edge out and bp uint8
    [2^(16-dn)] (the top dn bits of each edge's best state); best is int32 scratch
    [>= 2^(16-dn)]. State s = (p << (16 - dn)) | e enters through edge s >> dt.
    """
    n_out = 1 << (STATE_BITS - dn)
    low = np.int32((1 << dn) - 1)
    keep = np.int32(~low)
    best[:n_out] = np.int32(0x7FFFFFFF)       # above every packed cost, inf included
    for p in range(1 << dn):
        index = np.int32(p)
        t0 = p * n_out                          # first state of this predecessor index
        c0 = p * (n_out >> dt)                  # its first edge in
        # one loop per spread of the edge-in cost over the lanes (a compile-time shuffle)
        if dt >= 4:
            for e in range(0, n_out, LANES):
                _extend16_wide(table, t0 + e, cost_in, c0 + (e >> dt), best, e, wt, keep, index)
        elif dt == 3:
            for e in range(0, n_out, LANES):
                _extend16_c8(table, t0 + e, cost_in, c0 + (e >> 3), best, e, wt, keep, index)
        elif dt == 2:
            for e in range(0, n_out, LANES):
                _extend16_c4(table, t0 + e, cost_in, c0 + (e >> 2), best, e, wt, keep, index)
        else:
            for e in range(0, n_out, LANES):
                _extend16_c2(table, t0 + e, cost_in, c0 + (e >> 1), best, e, wt, keep, index)
    for i in range(n_out):
        v = best[i]
        bp[i] = np.uint8(v & low)
        cost_out[i] = _as_float(v & keep)


@njit(nogil=True, boundscheck=False, cache=True)
def _forward(w_seq, steps, table, cost, scratch, best, bps):
    """Steps over w_seq float32 [T] from ``cost`` (phase 0 first; D pattern ``steps`` int64 [P]).
    Returns the final cost array (one of the two buffers)."""
    P = steps.shape[0]
    for t in range(w_seq.shape[0]):
        ph = t % P
        _step(w_seq[t], table, cost, scratch, best, bps[t], steps[ph], steps[(ph + 1) % P])
        cost, scratch = scratch, cost
    return cost


@njit(nogil=True, boundscheck=False, cache=True)
def _backtrack(bps, steps, edge, last, first, states):
    """From the edge out of element ``last`` back to element ``first`` (indices into bps, phase 0
    at index 0): writes states[first..last] (int64)."""
    P = steps.shape[0]
    for t in range(last, first - 1, -1):
        dt, dn = steps[t % P], steps[(t + 1) % P]
        s = (np.int64(bps[t, edge]) << (STATE_BITS - dn)) | edge
        states[t] = s
        edge = s >> dt


@njit(nogil=True, boundscheck=False, cache=True)
def _encode_tile(w, steps, table, start, length, out):
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
    final = _forward(w_seq, steps, table, cost, scratch, best, bps)
    last = TILE - start - 1                               # element 255 in the rolled order
    _backtrack(bps, steps, np.int64(np.argmin(final[:n_in0])), length - 1, last, states)
    edge0 = states[last] & (n_in0 - 1)
    # pass 2: elements 0..255, entering and leaving through edge0
    cost[:n_in0] = np.inf
    cost[edge0] = 0.0
    _forward(w, steps, table, cost, scratch, best, bps)
    _backtrack(bps, steps, edge0, TILE - 1, 0, states)
    for t in range(TILE):
        out[t] = np.uint16(states[t])


@njit(parallel=True, nogil=True, cache=True)
def _encode_batch(w, steps, table, start, length, out):
    for b in prange(w.shape[0]):
        _encode_tile(w[b], steps, table, start, length, out[b])


def encode_states(w: np.ndarray, codebook: str, steps: tuple[int, ...], start: int,
                  length: int) -> np.ndarray:
    """Tail-biting states of fp16-rounded targets w float32 [B, 256] for ``codebook`` and the D
    pattern ``steps`` (period 1 or 2); pass 1 covers ``length`` elements from ``start`` (both
    even). Returns uint16 [B, 256] (sequence order)."""
    out = np.empty((w.shape[0], TILE), np.uint16)
    _encode_batch(np.ascontiguousarray(w, np.float32), np.asarray(steps, np.int64),
                  decode_table_f32(codebook), start, length, out)
    return out
