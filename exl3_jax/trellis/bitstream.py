"""The tile bitstream: packing codes into int16 words and reading 16-bit states back out.

A tile of 256 weights is one circular (tail-biting) bit ring of R bits stored as W int16 words
(spec 2.2-2.5; half-integer rates: exl3_format_165.md 1.2). Words pair into little-endian uint32s
read MSB-first. Element t owns the D(t) bits ending at S(t); its state is the 16-bit window of the
ring ending at S(t). Everything position-dependent is a static numpy table, so the jnp code is plain
gathers, shifts and masks.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..format.spec import TILE_WEIGHTS, rate_from_width, width_from_rate

HALF_RATE_MASK = 0xAAAA   # the only mask exllamav3 1.6.5 instantiates: odd t take the extra bit


@functools.lru_cache(maxsize=None)
def tile_perm() -> np.ndarray:
    """Sequence index t -> position 16*r + c inside the 16x16 tile (r: input dim, c: output).

    The tensor-core m16n8k16 fragment order (spec 2.4). int32 [256], a permutation.
    """
    t = np.arange(TILE_WEIGHTS)
    lane, j = t // 8, t % 8
    r0, c0 = 2 * (lane % 4), lane // 4
    r = r0 + np.array([0, 1, 8, 9])[j % 4]
    c = c0 + 8 * (j // 4)
    perm = (16 * r + c).astype(np.int32)
    perm.setflags(write=False)
    return perm


@functools.lru_cache(maxsize=None)
def ring_layout(width: int) -> dict[str, np.ndarray | int]:
    """Static tables for one trellis width (int16 words per tile).

    Returns dict with: bits R (ring length), steps D[t], ends S[t] (exclusive end bit of code t),
    and the window-extraction tables i0/i1/shift_lo/shift_hi/mask_hi per t (spec 2.3).
    """
    K = rate_from_width(width)
    ka = int(K)
    t = np.arange(TILE_WEIGHTS)
    if isinstance(K, float):
        steps = ka + ((HALF_RATE_MASK >> (t % 16)) & 1)
    else:
        steps = np.full(TILE_WEIGHTS, ka)
    ends = np.cumsum(steps)
    R = int(ends[-1])
    assert R == 16 * width, (R, width)
    i1 = (ends - 1) // 32
    i0 = ((ends - 16) % R) // 32
    s = 32 * (i1 + 1) - ends
    tables = {
        "K": K, "R": R, "steps": steps.astype(np.int32), "ends": ends.astype(np.int32),
        "i0": i0.astype(np.int32), "i1": i1.astype(np.int32),
        "shift_lo": s.astype(np.uint32), "shift_hi": ((32 - s) % 32).astype(np.uint32),
        "mask_hi": np.where(s == 0, 0, 0xFFFFFFFF).astype(np.uint32),
    }
    for v in tables.values():
        if isinstance(v, np.ndarray):
            v.setflags(write=False)
    return tables


def _width_of(trellis, K) -> int:
    width = int(trellis.shape[-1])
    if K is not None and width_from_rate(K) != width:
        raise ValueError(f"trellis last dimension {width} does not match K={K} "
                         f"(expected {width_from_rate(K)})")
    rate_from_width(width)     # validates
    return width


def words_to_u32(trellis):
    """int16 [..., W] -> uint32 [..., W/2]: U[m] = u[2m] | u[2m+1] << 16 (spec 2.2)."""
    u = lax.bitcast_convert_type(jnp.asarray(trellis, dtype=jnp.int16), jnp.uint16)
    u = u.astype(jnp.uint32)
    return u[..., 0::2] | (u[..., 1::2] << np.uint32(16))


def window_states(U, layout, order=None):
    """16-bit windows ending at the code ends of ``layout``, from uint32 words U [..., W/2].

    order: optional int [256] permutation of sequence indices (e.g. to emit in tile-position
    order); default sequence order. Returns uint32 [..., 256] with values < 2^16.
    """
    idx = np.arange(TILE_WEIGHTS) if order is None else np.asarray(order)
    i0, i1 = layout["i0"][idx], layout["i1"][idx]
    lo = U[..., i1] >> layout["shift_lo"][idx]
    hi = (U[..., i0] << layout["shift_hi"][idx]) & layout["mask_hi"][idx]
    return (lo | hi) & np.uint32(0xFFFF)


def unpack_states(trellis, K=None):
    """Trellis words -> the 256 16-bit states of every tile, in sequence order.

    Args:
      trellis: int16 [..., W] with W = 16K (K = 1..8) or 24/40/56 (K = 1.5/2.5/3.5).
      K: optional bits per weight, checked against W.
    Returns:
      uint16 [..., 256].
    """
    width = _width_of(trellis, K)
    return window_states(words_to_u32(trellis), ring_layout(width)).astype(jnp.uint16)


def pack_codes(codes, K):
    """Pack per-element codes (or full 16-bit states; only the low D(t) bits are kept) of tiles.

    Args:
      codes: integer [..., 256] in sequence order.
      K: bits per weight, 1..8 or 1.5/2.5/3.5.
    Returns:
      int16 [..., W], W = 16K (integer K) or 16*floor(K)+8 (half rates), the on-disk layout.
    """
    width = width_from_rate(K)
    layout = ring_layout(width)
    R, ends = layout["R"], layout["ends"]
    p = np.arange(R)
    owner = np.searchsorted(ends, p, side="right")            # code index owning stream bit p
    shift = (ends[owner] - 1 - p).astype(np.uint32)           # MSB-first within the code
    c = jnp.asarray(codes).astype(jnp.uint32)
    bits = (c[..., owner] >> shift) & np.uint32(1)            # [..., R]
    bits = bits.reshape(*bits.shape[:-1], R // 32, 32)
    U = jnp.sum(bits << np.arange(31, -1, -1, dtype=np.uint32), axis=-1, dtype=jnp.uint32)
    u = jnp.stack([U & np.uint32(0xFFFF), U >> np.uint32(16)], axis=-1)
    u = u.reshape(*U.shape[:-1], width).astype(jnp.uint16)
    return lax.bitcast_convert_type(u, jnp.int16)


def is_tail_biting(states, K) -> jnp.ndarray:
    """True per tile where each state's high bits equal the previous state's low bits, cyclically.

    states: integer [..., 256] (full 16-bit encoder states, sequence order). Returns bool [...].
    """
    layout = ring_layout(width_from_rate(K))
    s = jnp.asarray(states).astype(jnp.uint32)
    prev = jnp.roll(s, 1, axis=-1)
    d = jnp.asarray(layout["steps"], dtype=jnp.uint32)
    keep = (np.uint32(1) << (np.uint32(16) - d)) - np.uint32(1)
    return jnp.all((s >> d) == (prev & keep), axis=-1)
