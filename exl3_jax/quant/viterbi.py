"""Tail-biting trellis quantization of 16x16 tiles (spec 6.5; half rates: exl3_format_165.md 1.2).

A tile is 256 target values in sequence order (``tile_perm`` order). The encoder picks 256 16-bit
states, each the previous one shifted left by D(t) bits with a new D(t)-bit code in the low bits
(D(t) = K for integer rates; KA + (t odd) for the half rates 1.5/2.5/3.5), circularly over the tile,
minimising sum_t (decode(state_t) - w_t)^2.

Trellis vocabulary used below. The *edge* into step t is the part of state_t that is inherited
from state_{t-1}: its high 16 - D(t) bits (= the low 16 - D(t) bits of state_{t-1}). A path cost is
kept per edge; a step extends every edge e by every code c to the state s = (e << D(t)) | c and
hands on the edge into step t+1, s & (2^(16-D(t+1)) - 1).

Two modes, both exact Viterbi over all 2^16 states per step (2^16 work per element; the "broadcast
the edge cost over its 2^D codes" and the "min over the 2^D states sharing an outgoing edge" are
plain reshapes, so a step is one fused [tiles, 65536] loop on XLA:CPU). Tail-biting takes two
passes, as the reference does: pass 1, unconstrained, finds the best path's edge entering element
0; pass 2 runs over elements 0..255 starting from that edge and ends on it.

* ``"exact"``: pass 1 starts at element 128 and covers the whole ring.
* ``"fast"``: pass 1 covers only a window around the wrap (elements 192..255, 0..31): the entry
  edge depends on little further away. Pass 1 costs 96 steps instead of 256, so a tile costs 1.4
  passes instead of 2; tile MSE is within about 1% of the exact mode (K4 1.008, K6 1.004 on 512
  Gaussian tiles; a 48-element window gives 1.017 and 1.009, and its default-model build measured
  perplexity 14.392 against 14.372, inside the ~0.17 spread between equivalent builds:
  bench/NOTES.md). (Reduced-state searches, a sort-based beam, a
  numba loop over the reduced candidates and an M-algorithm were tried before: once the exact
  step packed its argmin into the min (``_exact_step``), all of them were slower than exact
  Viterbi on CPU.)

Two backends run this search: the JAX code below (any JAX device; the GPU's) and, on CPUs, the
numba loops of ``viterbi_cpu`` with the same arithmetic, written as explicit 16-lane vectors
(``encode_tiles(backend=...)``; ``default_backend``).

Costs are accumulated in fp32 (the reference uses fp16, so near-ties may resolve differently; the
format does not care which of two equally good codewords is stored). Targets are rounded to fp16
first, as the reference does, which also makes a valid codeword re-encode with zero error in the
exact search.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..format.spec import TILE_WEIGHTS, width_from_rate
from ..trellis.bitstream import ring_layout
from ..trellis.codebook import check_codebook, codebook_table

MODES = ("exact", "fast")
BACKENDS = ("jax", "numba")
STATE_BITS = 16
N_STATES = 1 << STATE_BITS

# Fast mode's pass 1 covers only elements 256 - BEFORE .. 255, 0 .. AFTER - 1 (even numbers).
FAST_PASS1_BEFORE = 64
FAST_PASS1_AFTER = 32


@functools.lru_cache(maxsize=None)
def decode_table_f32(codebook: str) -> np.ndarray:
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


# ------------------------------------------------------------------------------------------------
# exact Viterbi


def _exact_step(cost_in, w_t, table, d_t: int, d_next: int):
    """One exact Viterbi step for a batch of tiles.

    Args:
      cost_in: float32 [B, 2^(16-d_t)] best path cost per edge into this step.
      w_t: float32 [B] target of this element.
      table: float32 [65536] decoded value per state.
      d_t, d_next: new bits at this step and at the next one.
    Returns:
      cost_out float32 [B, 2^(16-d_next)] per edge into the next step, and the back pointer
      uint8 [B, 2^(16-d_next)]: the top d_next bits of the best state ending in that edge.

    The min and its argmin come from one integer min-reduce: path costs are >= 0, so their fp32
    bit patterns order as int32; the low d_next mantissa bits are replaced by the candidate's
    index, so ties (within 2^d_next ulps) go to the lowest index and the index rides along with
    the minimum. On XLA:CPU this is one fused loop, 1.3-1.9x faster than min + argmin + gather.
    The cleared bits perturb costs by < 2^(d_next-23) relative per step: a near-tie, never a
    zero-cost (exact) path, can resolve differently.
    """
    B = cost_in.shape[0]
    dist = jnp.square(table[None, :] - w_t[:, None])                           # [B, 65536]
    # state s = (edge_in << d_t) | code: edge_in = s >> d_t is the slow axis of a reshape
    cand = cost_in[:, :, None] + dist.reshape(B, N_STATES >> d_t, 1 << d_t)
    # edge_out = s & (2^(16-d_next) - 1) is the fast axis; its 2^d_next predecessors the slow one
    cand = cand.reshape(B, 1 << d_next, N_STATES >> d_next)
    low = (1 << d_next) - 1
    index = lax.broadcasted_iota(jnp.int32, cand.shape, 1)
    packed = (lax.bitcast_convert_type(cand, jnp.int32) & ~low) | index
    best = jnp.min(packed, axis=1)                                          # [B, 2^(16-d_next)]
    return (lax.bitcast_convert_type(best & ~low, jnp.float32),
            (best & low).astype(jnp.uint8))


def _exact_forward(cost0, w_seq, table, steps: tuple[int, ...]):
    """Viterbi forward over w_seq float32 [T, B] whose D pattern ``steps`` repeats (period 1 or 2).

    Returns (final cost float32 [B, 2^(16-steps[0])], back pointers: a tuple with one uint8
    [T/P, B, 2^(16-D)] array per phase, see ``_exact_step``)."""
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


def _exact_backtrack(bps, edge_last, steps: tuple[int, ...]):
    """Follow the back pointers of ``_exact_forward`` from the edge out of the last element.

    bps: its records (one uint8 [T/P, B, 2^(16-D)] per phase); edge_last: int32 [B].
    Returns uint32 states [T, B] in forward order.
    """
    P = len(steps)

    def body(edge, bp_group):
        states = [None] * P
        for p in reversed(range(P)):
            d_t, d_next = steps[p], steps[(p + 1) % P]
            top = jnp.take_along_axis(bp_group[p], edge[:, None], axis=1)[:, 0]
            top = top.astype(jnp.int32)
            s = (top << (STATE_BITS - d_next)) | edge
            states[p] = s
            edge = s >> d_t
        return edge, jnp.stack(states)

    _, states = lax.scan(body, edge_last, bps, reverse=True)
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
    rolled = _exact_backtrack(bps, jnp.argmin(cost, axis=1).astype(jnp.int32), steps)
    last = rolled[TILE_WEIGHTS - start - 1]                         # element 255
    return (last & jnp.uint32((N_STATES >> steps[0]) - 1)).astype(jnp.int32)


def _encode_exact(w, table, steps: tuple[int, ...], edge0):
    """Pass 2, exact: the best path over elements 0..255 entering element 0 through edge0
    (int32 [B]) and leaving element 255 through it again. Returns uint32 states [B, 256]."""
    lanes = jnp.arange(N_STATES >> steps[0])[None, :]
    start = jnp.where(lanes == edge0[:, None], 0.0, jnp.inf).astype(jnp.float32)
    _, bps = _exact_forward(start, w.T, table, steps)
    return _exact_backtrack(bps, edge0, steps).T


# ------------------------------------------------------------------------------------------------
# public API


@functools.partial(jax.jit, static_argnames=("K", "mode"))
def _encode_batch(w, table, *, K: float, mode: str):
    """w float32 [B, 256], table float32 [65536] (decoded value per state)
    -> states uint16 [B, 256]."""
    w = w.astype(jnp.float16).astype(jnp.float32)
    steps = step_bits(K)[:_period(K)]
    edge0 = _entry_edge(w, table, steps, *pass1_window(mode))
    return _encode_exact(w, table, steps, edge0).astype(jnp.uint16)


def pass1_window(mode: str) -> tuple[int, int]:
    """(first element, length) of pass 1: the whole ring from element 128 in the exact mode, the
    window 192..255, 0..31 in the fast one."""
    if mode == "exact":
        return TILE_WEIGHTS // 2, TILE_WEIGHTS
    return TILE_WEIGHTS - FAST_PASS1_BEFORE, FAST_PASS1_BEFORE + FAST_PASS1_AFTER


def default_backend() -> str:
    """"numba" where JAX runs on the CPU and numba imports (its loops run the same search 1.4x
    (K4) to 3.7x (K6) faster than XLA:CPU on 2 cores, encoder_cpu_numba_vec_2026-12-03.json),
    else "jax"."""
    numba = importlib.util.find_spec("numba") is not None
    return "numba" if jax.default_backend() == "cpu" and numba else "jax"


def check_rate(K: float, codebook: str) -> float:
    """Validate (K, codebook); returns K as int for integer rates."""
    check_codebook(codebook)
    width_from_rate(K)
    if K != int(K) and codebook != "mul1":
        raise ValueError(f"half-integer rate K={K} requires the mul1 codebook")
    return int(K) if K == int(K) else float(K)


def default_batch(K: float, backend: str = "jax") -> int:
    """Tiles per call. numba: 64 (memory is per thread, so this only sets how often progress is
    reported). JAX on CPU: larger batches than 16 were not faster (the per-step working set
    leaves the caches) and the exact search's back pointers (256 steps x 2^(16-D)
    bytes per tile and pass) are kept to about 128 MiB (8 MiB per tile at K=1). On a GPU,
    throughput grows up to a few hundred tiles per call (bench/results/encoder_gpu_h200.json),
    so up to 512 tiles and 2 GiB of back pointers."""
    if backend == "numba":
        return 64
    per_tile = TILE_WEIGHTS * (N_STATES >> int(K))
    cap, budget = (512, 2 << 30) if jax.default_backend() == "gpu" else (16, 128 << 20)
    return int(max(1, min(cap, budget // per_tile)))


def encode_tiles(tiles, K: float, codebook: str, *, mode: str = "exact",
                 batch: int | None = None, backend: str | None = None,
                 progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Trellis-quantize tiles (sequence order) with a tail-biting encoder.

    Args:
      tiles: float [N, 256] targets, each tile in sequence (``tile_perm``) order.
      K: bits per weight, 1..8 or 1.5/2.5/3.5 (mul1 only).
      codebook: "3inst", "mcg" or "mul1".
      mode: "exact" or "fast" (pass 1 over a window around the wrap; see the module docstring).
      batch: tiles per call (the jitted program's batch, memory bound; for numba, the progress
        granularity); results do not depend on it.
      backend: "jax" (this module, any JAX device) or "numba" (``viterbi_cpu``, the same search as
        CPU loops); None picks ``default_backend()``.
      progress: called with the number of tiles finished after each batch.
    Returns:
      states uint16 [N, 256] (sequence order, tail-biting; ``pack_codes(states, K)`` packs them)
      and their decoded values float16 [N, 256].
    """
    K = check_rate(K, codebook)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown encoder backend {backend!r}; expected one of {BACKENDS}")
    tiles = np.asarray(tiles, dtype=np.float32)
    if tiles.ndim != 2 or tiles.shape[1] != TILE_WEIGHTS:
        raise ValueError(f"tiles must be [N, 256], got {tiles.shape}")
    N = tiles.shape[0]
    if batch is None:
        # even batches: 36 tiles run as 3 x 12, not 3 x 16 with 12 tiles of padding
        n_batches = max(1, -(-N // default_batch(K, backend)))
        batch = -(-N // n_batches) if N else 1
    batch = max(1, min(int(batch), N)) if N else 1
    table_np = decode_table_f32(codebook)
    if backend == "numba":
        from .viterbi_cpu import encode_states
        steps = step_bits(K)[:_period(K)]
    else:
        table = jnp.asarray(table_np)
    states = np.zeros((N, TILE_WEIGHTS), np.uint16)
    for lo in range(0, N, batch):
        chunk = tiles[lo:lo + batch]
        n = chunk.shape[0]
        if backend == "numba":
            w = chunk.astype(np.float16).astype(np.float32)
            states[lo:lo + n] = encode_states(w, codebook, steps, *pass1_window(mode))
        else:
            if n < batch:       # pad to a fixed shape so one compiled program serves every batch
                chunk = np.concatenate([chunk, np.zeros((batch - n, TILE_WEIGHTS), np.float32)])
            s = _encode_batch(jnp.asarray(chunk), table, K=K, mode=mode)
            states[lo:lo + n] = np.asarray(s)[:n]
        if progress is not None:
            progress(n)
    return states, table_np[states.astype(np.int64)].astype(np.float16)
