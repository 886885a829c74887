"""Tail-biting trellis quantization of 16x16 tiles (spec 6.5; half rates: exl3_format_165.md 1.2).

A tile is 256 target values in sequence order (``tile_perm`` order). The encoder picks 256 16-bit
states, each the previous one shifted left by D(t) bits with a new D(t)-bit code in the low bits
(D(t) = K for integer rates; KA + (t odd) for the half rates 1.5/2.5/3.5), circularly over the tile,
minimising sum_t (decode(state_t) - w_t)^2.

Trellis vocabulary used below. The *edge* into step t is the part of state_t that is inherited
from state_{t-1}: its high 16 - D(t) bits (= the low 16 - D(t) bits of state_{t-1}). A path cost is
kept per edge; a step extends every edge e by every code c to the state s = (e << D(t)) | c and
hands on the edge into step t+1, s & (2^(16-D(t+1)) - 1).

Two search modes:

* ``"exact"``: full Viterbi over all 2^16 states per step (2^16 work per element). Both the
  "broadcast the edge cost over its 2^D codes" and the "min over the 2^D states sharing an outgoing
  edge" are plain reshapes, so a step is a few dense [tiles, 65536] vector operations.
  Tail-biting in two passes, as the reference does: pass 1 starts at element 128, unconstrained,
  and its best path gives the edge entering element 0; pass 2 runs over elements 0..255 starting
  from that edge and ends on it.
* ``"fast"``: pass 1 covers only a window around the wrap (elements 192..255, 0..31: the entry
  edge depends on nothing further away) with a reduced-state Viterbi with per-survivor
  processing: paths are merged on only the low 16 - D - r bits of their edge (2^(16-r)
  candidates per element instead of 2^16); each survivor remembers its full edge, so every
  candidate is still costed with its true 16-bit state. The approximation is that paths differing
  only in the r oldest edge bits compete early. Pass 2 is exact for K >= 3 and reduced for
  K < 3; a reduced pass 2 forces the last states onto the entry edge with bit masks and the ring
  is rebuilt from the chosen codes, so the output is tail-biting by construction. (A sort-based
  beam search was tried first: slower than exact Viterbi on CPU. So were a numba loop over the
  reduced candidates and an M-algorithm: on 2 cores the dense exact step, ~1.5 cycles per state,
  is hard to beat with scalar per-candidate code, so only pass 1, whose choice matters little, is
  pruned hard.)

Costs are accumulated in fp32 (the reference uses fp16, so near-ties may resolve differently; the
format does not care which of two equally good codewords is stored). Targets are rounded to fp16
first, as the reference does, which also makes a valid codeword re-encode with zero error in the
exact search.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..format.spec import TILE_WEIGHTS, width_from_rate
from ..trellis.bitstream import pack_codes, ring_layout, unpack_states
from ..trellis.codebook import check_codebook, codebook_table

MODES = ("exact", "fast")
STATE_BITS = 16
N_STATES = 1 << STATE_BITS

# Dropped edge bits r of the fast mode per K (integer part for half rates), chosen on Gaussian tiles
# so that the mean tile MSE stays within ~1.2x of the exact encoder (measured ratios: K1 1.12,
# K1.5 1.12, K2 1.20, K2.5 1.15; r = 4 would be ~2x faster still but 1.3x worse). For K >= 3 the
# reduced search is not worth it on CPU (gathers cost ~10x a dense op; r = 2 loses 1.2x MSE and is
# slower than exact), so those rates use the exact pass 2; the fast mode then only shortens pass 1.
# scripts/bench_encoder.py records speed and ratios; tests/test_quant_viterbi.py bounds them.
DEFAULT_REDUCE_BITS = {1: 3, 2: 3, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0, 8: 0}
# Dropped edge bits in the fast mode's pass 1 when pass 2 is exact (the largest the range allows,
# up to 6): pass 1 only picks the entry edge, and a pruned choice costs ~1.05x tile MSE at K4
# while pass 1 drops from ~27% of the work to a few percent.
PASS1_REDUCE_BITS = {3: 6, 4: 6, 5: 6, 6: 4, 7: 2, 8: 0}
# Fast mode's pass 1 covers only elements 256 - BEFORE .. 255, 0 .. AFTER - 1 (even numbers).
FAST_PASS1_BEFORE = 64
FAST_PASS1_AFTER = 32


def default_reduce_bits(K: float) -> int:
    return DEFAULT_REDUCE_BITS[int(K)]


@functools.lru_cache(maxsize=None)
def _table_f32(codebook: str) -> np.ndarray:
    """Decoded value of every state as fp32 [65536] (exact: fp16 values are fp32-representable)."""
    with jax.ensure_compile_time_eval():
        table = np.asarray(codebook_table(codebook), dtype=np.float32)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=None)
def step_bits(K: float) -> tuple[int, ...]:
    """D(t) for t = 0..255 (new bits per element), from the bitstream's ring layout."""
    return tuple(int(d) for d in ring_layout(width_from_rate(K))["steps"])


def _period(K: float) -> int:
    """Length of the repeating D(t) pattern: 1 for integer K, 2 for half rates (0xAAAA mask)."""
    d = step_bits(K)
    return 1 if all(x == d[0] for x in d) else 2


def _end_masks(K: float) -> tuple[np.ndarray, np.ndarray]:
    """For forcing pass 2 to end on a given edge E (the low 16 - D(0) bits of state_255).

    State_t's low m_t bits lie inside E's stream span; they must equal (E >> shift_t) & mask_t.
    Returns (mask_t uint32 [256], shift_t uint32 [256]); mask_t = 0 where nothing is forced.
    """
    steps = np.asarray(step_bits(K))
    ends = np.cumsum(steps)                     # S(t): exclusive end bit of code t
    R = int(ends[-1])
    m = np.clip(ends - R + STATE_BITS - steps[0], 0, STATE_BITS)
    mask = ((1 << m) - 1).astype(np.uint32)
    shift = np.minimum(R - ends, 31).astype(np.uint32)
    return mask, shift


# ------------------------------------------------------------------------------------------------
# exact Viterbi


# From this many bits per step on, the exact forward keeps only a min-reduce and records the
# incoming costs; the backtrack recomputes the 2^D candidates of the one edge it follows. On XLA:CPU
# an argmin over a 32..256-long major axis was 4-10x slower than the whole rest of the step.
RECOMPUTE_FROM_BITS = 5


def _exact_step(cost_in, w_t, table, d_t: int, d_next: int):
    """One exact Viterbi step for a batch of tiles.

    Args:
      cost_in: float32 [B, 2^(16-d_t)] best path cost per edge into this step.
      w_t: float32 [B] target of this element.
      table: float32 [65536] decoded value per state.
      d_t, d_next: new bits at this step and at the next one.
    Returns:
      cost_out float32 [B, 2^(16-d_next)] per edge into the next step, and the step's record for
      the backtrack: for d_next < RECOMPUTE_FROM_BITS the back pointer uint8 [B, 2^(16-d_next)]
      (the top d_next bits of the best state ending in that edge), else cost_in itself.
    """
    B = cost_in.shape[0]
    dist = jnp.square(table[None, :] - w_t[:, None])                           # [B, 65536]
    # state s = (edge_in << d_t) | code: edge_in = s >> d_t is the slow axis of a reshape
    cand = cost_in[:, :, None] + dist.reshape(B, N_STATES >> d_t, 1 << d_t)
    # edge_out = s & (2^(16-d_next) - 1) is the fast axis; its 2^d_next predecessors the slow one
    cand = cand.reshape(B, 1 << d_next, N_STATES >> d_next)
    if d_next >= RECOMPUTE_FROM_BITS:
        return jnp.min(cand, axis=1), cost_in
    top = jnp.argmin(cand, axis=1)                                # first minimum wins (k ascending)
    cost_out = jnp.take_along_axis(cand, top[:, None, :], axis=1)[:, 0, :]
    return cost_out, top.astype(jnp.uint8)


def _exact_forward(cost0, w_seq, table, steps: tuple[int, ...]):
    """Viterbi forward over w_seq float32 [T, B] whose D pattern ``steps`` repeats (period 1 or 2).

    Returns (final cost float32 [B, 2^(16-steps[0])], records: a tuple with one [T/P, B, ...]
    array per phase, see ``_exact_step``)."""
    P = len(steps)
    T, B = w_seq.shape
    w_groups = w_seq.reshape(T // P, P, B)

    def body(cost, w_group):
        bps = []
        for p in range(P):
            cost, bp = _exact_step(cost, w_group[p], table, steps[p], steps[(p + 1) % P])
            bps.append(bp)
        return cost, tuple(bps)

    return lax.scan(body, cost0, w_groups)


def _exact_backtrack(bps, edge_last, w_seq, table, steps: tuple[int, ...]):
    """Follow the records of ``_exact_forward`` back from the edge out of the last element.

    bps: its records; edge_last: int32 [B]; w_seq: float32 [T, B] (the forward's targets).
    Returns uint32 states [T, B] in forward order.
    """
    P = len(steps)
    T, B = w_seq.shape

    def body(edge, x):
        bp_group, w_group = x
        states = [None] * P
        for p in reversed(range(P)):
            d_t, d_next = steps[p], steps[(p + 1) % P]
            if d_next >= RECOMPUTE_FROM_BITS:
                # the 2^d_next states ending in ``edge``, costed as in the forward step
                s = (jnp.arange(1 << d_next, dtype=jnp.int32)[None, :] << (STATE_BITS - d_next)
                     ) | edge[:, None]
                cand = (jnp.take_along_axis(bp_group[p], s >> d_t, axis=1)
                        + jnp.square(table[s] - w_group[p][:, None]))
                top = jnp.argmin(cand, axis=1).astype(jnp.int32)
            else:
                top = jnp.take_along_axis(bp_group[p], edge[:, None], axis=1)[:, 0]
                top = top.astype(jnp.int32)
            s = (top << (STATE_BITS - d_next)) | edge
            states[p] = s
            edge = s >> d_t
        return edge, jnp.stack(states)

    _, states = lax.scan(body, edge_last, (bps, w_seq.reshape(T // P, P, B)), reverse=True)
    return states.reshape(-1, states.shape[-1]).astype(jnp.uint32)


def _entry_edge(w, table, steps: tuple[int, ...], start: int, length: int):
    """Pass 1: the edge entering element 0 on the best unconstrained path over elements
    start, start+1, ... (``length`` of them, circularly; must cover element 255).

    w float32 [B, 256] -> int32 [B] (the low 16 - D(0) bits of the best path's state 255).
    start and length are even so the half-rate D pattern stays in phase.
    """
    B = w.shape[0]
    w_rolled = jnp.roll(w, -start, axis=1).T[:length]
    free = jnp.zeros((B, N_STATES >> steps[0]), jnp.float32)
    cost, bps = _exact_forward(free, w_rolled, table, steps)
    rolled = _exact_backtrack(bps, jnp.argmin(cost, axis=1).astype(jnp.int32), w_rolled, table,
                              steps)
    last = rolled[TILE_WEIGHTS - start - 1]                         # element 255
    return (last & jnp.uint32((N_STATES >> steps[0]) - 1)).astype(jnp.int32)


def _encode_exact(w, table, steps: tuple[int, ...], edge0):
    """Pass 2, exact: the best path over elements 0..255 entering element 0 through edge0
    (int32 [B]) and leaving element 255 through it again. Returns uint32 states [B, 256]."""
    lanes = jnp.arange(N_STATES >> steps[0])[None, :]
    start = jnp.where(lanes == edge0[:, None], 0.0, jnp.inf).astype(jnp.float32)
    _, bps = _exact_forward(start, w.T, table, steps)
    return _exact_backtrack(bps, edge0, w.T, table, steps).T


# ------------------------------------------------------------------------------------------------
# reduced-state (fast) search


# From this many bits per step on, the reduced step takes each survivor group's minimum with an
# unrolled running minimum (dense selects); below it with argmin + take_along_axis. On XLA:CPU the
# first was ~6x faster at 2^4..2^6 candidates per group, the second ~2x faster at 2^1..2^2.
CHAIN_MIN_FROM_BITS = 3


def _reduced_step(cost_in, full_in, w_t, table, d_t: int, d_next: int, r: int, end_mask,
                  end_shift, end_edge):
    """One reduced-state Viterbi step: paths are merged on the low 16 - d - r bits of their edge
    only; each survivor carries its full edge (per-survivor processing), so every candidate state
    is still costed exactly.

    Args:
      cost_in: float32 [B, 2^(16-d_t-r)] survivor cost per reduced edge into this step.
      full_in: int32 [B, 2^(16-d_t-r)] the survivor's full (16 - d_t bit) edge.
      w_t: float32 [B]; table: float32 [65536].
      end_mask, end_shift: uint32 scalars; state bits under end_mask must equal
        (end_edge >> end_shift) (int32 [B]) (pass 2's forced end; mask 0 = free).
    Returns:
      cost_out, full_out ([B, 2^(16-d_next-r)]) and the back pointer uint8 [B, 2^(16-d_next-r)]:
      the top d_next bits of the winning candidate's low 16 - r state bits.
    """
    B = cost_in.shape[0]
    codes = jnp.arange(1 << d_t, dtype=jnp.int32)
    # flat candidate index = (reduced edge << d_t) | code = the state's low 16 - r bits
    s = ((full_in[:, :, None] << d_t) | codes).reshape(B, N_STATES >> r)
    cand = (cost_in[:, :, None] + jnp.zeros((1, 1, 1 << d_t), jnp.float32)).reshape(B, -1)
    cand = cand + jnp.square(table[s] - w_t[:, None])
    forced = (end_edge.astype(jnp.uint32)[:, None] >> end_shift) & end_mask
    cand = jnp.where((s.astype(jnp.uint32) & end_mask) == forced, cand, jnp.inf)
    # reduced edge out = low 16 - d_next - r bits of the flat index (fast axis)
    cand = cand.reshape(B, 1 << d_next, N_STATES >> (r + d_next))
    s = s.reshape(B, 1 << d_next, N_STATES >> (r + d_next))
    if d_next >= CHAIN_MIN_FROM_BITS:
        cost_out, s_best = cand[:, 0], s[:, 0]
        top = jnp.zeros(cost_out.shape, jnp.uint8)
        for k in range(1, 1 << d_next):                # strict <: the first minimum wins
            better = cand[:, k] < cost_out
            cost_out = jnp.where(better, cand[:, k], cost_out)
            s_best = jnp.where(better, s[:, k], s_best)
            top = jnp.where(better, jnp.uint8(k), top)
    else:
        top = jnp.argmin(cand, axis=1)                 # first minimum wins (k ascending)
        cost_out = jnp.take_along_axis(cand, top[:, None, :], axis=1)[:, 0, :]
        s_best = jnp.take_along_axis(s, top[:, None, :], axis=1)[:, 0, :]
        top = top.astype(jnp.uint8)
    full_out = s_best & ((1 << (STATE_BITS - d_next)) - 1)
    return cost_out, full_out, top


def _reduced_forward(cost, full, w_seq, table, steps, r, end_masks, end_shifts, end_edge):
    """Reduced-state forward over w_seq float32 [T, B] (D pattern ``steps`` repeating).
    Returns final (cost, full) and per-phase back pointers uint8 [T/P, B, 2^(16-d_next-r)]."""
    P = len(steps)
    T, B = w_seq.shape
    xs = (w_seq.reshape(T // P, P, B), end_masks.reshape(T // P, P), end_shifts.reshape(T // P, P))

    def body(carry, x):
        cost, full = carry
        w_group, masks, shifts = x
        bps = []
        for p in range(P):
            cost, full, bp = _reduced_step(cost, full, w_group[p], table, steps[p],
                                           steps[(p + 1) % P], r, masks[p], shifts[p], end_edge)
            bps.append(bp)
        return (cost, full), tuple(bps)

    (cost, full), bps = lax.scan(body, (cost, full), xs)
    return cost, full, bps


def _reduced_backtrack(bps, edge_last, steps, r):
    """Codes along the survivor ending in reduced edge edge_last (int32 [B]).

    Returns int32 codes [T, B] (code t = the low D(t) bits of state t)."""
    P = len(steps)

    def body(edge, bp_group):
        codes = [None] * P
        for p in reversed(range(P)):
            d_t, d_next = steps[p], steps[(p + 1) % P]
            top = jnp.take_along_axis(bp_group[p], edge[:, None], axis=1)[:, 0].astype(jnp.int32)
            flat = (top << (STATE_BITS - r - d_next)) | edge        # state's low 16 - r bits
            codes[p] = flat & ((1 << d_t) - 1)
            edge = flat >> d_t
        return edge, jnp.stack(codes)

    _, codes = lax.scan(body, edge_last, bps, reverse=True)
    return codes.reshape(-1, codes.shape[-1])


def _entry_edge_reduced(w, table, steps: tuple[int, ...], r: int, start: int, length: int):
    """Pass 1 of the fast mode with reduced states (see ``_entry_edge``). The free start gives
    every reduced edge cost 0 and an arbitrary full edge; that choice is forgotten long before
    element 255 (the edge is read ~16/K elements before the window's middle)."""
    B = w.shape[0]
    d0 = steps[0]
    w_rolled = jnp.roll(w, -start, axis=1).T[:length]
    n_red = N_STATES >> (d0 + r)
    cost = jnp.zeros((B, n_red), jnp.float32)
    full = jnp.broadcast_to(jnp.arange(n_red, dtype=jnp.int32), (B, n_red))
    free = jnp.zeros(length, jnp.uint32)
    cost, _, bps = _reduced_forward(cost, full, w_rolled, table, steps, r, free, free,
                                    jnp.zeros((B,), jnp.int32))
    codes = _reduced_backtrack(bps, jnp.argmin(cost, axis=1).astype(jnp.int32), steps, r)
    # state 255 (window position 255 - start) from the codes that end there: >= 16 bits
    P = len(steps)
    state, used, pos = jnp.zeros((B,), jnp.uint32), 0, TILE_WEIGHTS - start - 1
    while used < STATE_BITS:
        state = state | (codes[pos].astype(jnp.uint32) << used)
        used += steps[pos % P]
        pos -= 1
    return (state & jnp.uint32((N_STATES >> d0) - 1)).astype(jnp.int32)


def _encode_reduced(w, table, steps: tuple[int, ...], K: float, r: int, edge0):
    """Pass 2, reduced-state: like ``_encode_exact`` but merging on 16 - D - r edge bits, with the
    last states forced onto edge0 (int32 [B]) by masks. Returns int32 codes [B, 256]."""
    d0 = steps[0]
    masks, shifts = _end_masks(K)
    reduced = edge0 & ((N_STATES >> (d0 + r)) - 1)
    lanes = jnp.arange(N_STATES >> (d0 + r))[None, :]
    cost = jnp.where(lanes == reduced[:, None], 0.0, jnp.inf).astype(jnp.float32)
    full = jnp.broadcast_to(edge0[:, None], cost.shape)
    cost, _, bps = _reduced_forward(cost, full, w.T, table, steps, r, jnp.asarray(masks),
                                    jnp.asarray(shifts), edge0)
    return _reduced_backtrack(bps, reduced, steps, r).T


# ------------------------------------------------------------------------------------------------
# public API


@functools.partial(jax.jit, static_argnames=("K", "mode", "reduce_bits"))
def _encode_batch(w, table, *, K: float, mode: str, reduce_bits: int):
    """w float32 [B, 256], table float32 [65536] (decoded value per state)
    -> (states uint16 [B, 256], values float16 [B, 256])."""
    w = w.astype(jnp.float16).astype(jnp.float32)
    steps = step_bits(K)[:_period(K)]
    if mode == "exact":
        edge0 = _entry_edge(w, table, steps, TILE_WEIGHTS // 2, TILE_WEIGHTS)
    else:
        # the entry edge only depends on the few elements around the wrap: a short window
        start, length = TILE_WEIGHTS - FAST_PASS1_BEFORE, FAST_PASS1_BEFORE + FAST_PASS1_AFTER
        r1 = reduce_bits or PASS1_REDUCE_BITS[int(K)]
        edge0 = (_entry_edge(w, table, steps, start, length) if r1 == 0 else
                 _entry_edge_reduced(w, table, steps, r1, start, length))
    if reduce_bits == 0:
        states = _encode_exact(w, table, steps, edge0).astype(jnp.uint16)
    else:
        # the ring is rebuilt from the codes, so the result is tail-biting by construction
        codes = _encode_reduced(w, table, steps, K, reduce_bits, edge0)
        states = unpack_states(pack_codes(codes, K), K)
    return states, table[states.astype(jnp.int32)].astype(jnp.float16)


def check_rate(K: float, codebook: str) -> float:
    """Validate (K, codebook); returns K as int for integer rates."""
    check_codebook(codebook)
    width_from_rate(K)
    if K != int(K) and codebook != "mul1":
        raise ValueError(f"half-integer rate K={K} requires the mul1 codebook")
    return int(K) if K == int(K) else float(K)


def default_batch(K: float, mode: str) -> int:
    """Tiles per jitted batch. Larger batches were not faster on CPU (the per-step working set
    leaves the caches); the exact search's records (256 steps x 2^(16-D) entries per tile and
    pass: uint8 pointers, or fp32 costs from D = RECOMPUTE_FROM_BITS on) are also kept to about
    128 MiB (8 MiB per tile at K=1)."""
    entry = 4 if int(K) >= RECOMPUTE_FROM_BITS else 1
    per_tile = TILE_WEIGHTS * (N_STATES >> int(K)) * entry
    return int(max(1, min(16, (128 << 20) // per_tile)))


def encode_tiles(tiles, K: float, codebook: str, *, mode: str = "exact",
                 reduce_bits: int | None = None,
                 batch: int | None = None,
                 progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Trellis-quantize tiles (sequence order) with a tail-biting encoder.

    Args:
      tiles: float [N, 256] targets, each tile in sequence (``tile_perm``) order.
      K: bits per weight, 1..8 or 1.5/2.5/3.5 (mul1 only).
      codebook: "3inst", "mcg" or "mul1".
      mode: "exact" (full Viterbi) or "fast" (reduced-state Viterbi dropping ``reduce_bits``
        edge bits; default per K from DEFAULT_REDUCE_BITS).
      batch: tiles per jitted call (memory bound); results do not depend on it.
      progress: called with the number of tiles finished after each batch.
    Returns:
      states uint16 [N, 256] (sequence order, tail-biting; ``pack_codes(states, K)`` packs them)
      and their decoded values float16 [N, 256].
    """
    K = check_rate(K, codebook)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    r = default_reduce_bits(K) if reduce_bits is None else int(reduce_bits)
    if mode == "fast" and not 0 <= r <= STATE_BITS - 2 * int(math.ceil(K)):
        raise ValueError(f"reduce_bits={r} out of range for K={K}")
    tiles = np.asarray(tiles, dtype=np.float32)
    if tiles.ndim != 2 or tiles.shape[1] != TILE_WEIGHTS:
        raise ValueError(f"tiles must be [N, 256], got {tiles.shape}")
    N = tiles.shape[0]
    if batch is None:
        # even batches: 36 tiles run as 3 x 12, not 3 x 16 with 12 tiles of padding
        n_batches = max(1, -(-N // default_batch(K, mode)))
        batch = -(-N // n_batches) if N else 1
    batch = max(1, min(int(batch), N)) if N else 1
    table = jnp.asarray(_table_f32(codebook))
    states = np.zeros((N, TILE_WEIGHTS), np.uint16)
    values = np.zeros((N, TILE_WEIGHTS), np.float16)
    for lo in range(0, N, batch):
        chunk = tiles[lo:lo + batch]
        n = chunk.shape[0]
        if n < batch:           # pad to a fixed shape so one compiled program serves every batch
            chunk = np.concatenate([chunk, np.zeros((batch - n, TILE_WEIGHTS), np.float32)])
        s, v = _encode_batch(jnp.asarray(chunk), table, K=K, mode=mode,
                             reduce_bits=r if mode == "fast" else 0)
        states[lo:lo + n] = np.asarray(s)[:n]
        values[lo:lo + n] = np.asarray(v)[:n]
        if progress is not None:
            progress(n)
    return states, values
