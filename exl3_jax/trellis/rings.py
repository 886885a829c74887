"""Trellis "rings": the tail-biting mul1 rows of quantized token embeddings (exllamav3 1.6.5).

A ring of ``dim`` elements at integer K is stored as 1 + dim*K/16 int16 words: word 0 is an fp16
scale, the rest an LSB-first, word-local bitstream of K-bit codes (exl3_format_165.md 2.1). This
differs from the tile format (MSB-first uint32 pairs), so it has its own pack/unpack.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .codebook import decode_states
from .hadamard import fwht_butterflies

EMBED_RING_DIM = 256


def _check(K: int, dim: int) -> None:
    if K not in range(1, 9) or (dim * K) % 16:
        raise ValueError(f"ring K={K}, dim={dim}: K must be 1..8 and dim*K a multiple of 16")


def unpack_ring_states(words, K: int, dim: int = EMBED_RING_DIM):
    """Ring words int16 [..., 1 + dim*K/16] -> (states uint32 [..., dim], scale float16 [...])."""
    _check(K, dim)
    w = lax.bitcast_convert_type(jnp.asarray(words, jnp.int16), jnp.uint16).astype(jnp.uint32)
    scale = lax.bitcast_convert_type(w[..., 0].astype(jnp.uint16), jnp.float16)
    stream = (w[..., 1:, None] >> np.arange(16, dtype=np.uint32)) & np.uint32(1)
    stream = stream.reshape(*w.shape[:-1], dim, K)                      # code i, bit j (LSB first)
    codes = jnp.sum(stream << np.arange(K, dtype=np.uint32), axis=-1, dtype=jnp.uint32)
    states = jnp.zeros_like(codes)
    for s in range(-(-16 // K)):                                        # codes that reach the window
        states = states | (jnp.roll(codes, s, axis=-1) << np.uint32(K * s))
    return states & np.uint32(0xFFFF), scale


def pack_ring(codes, scale, K: int):
    """Inverse of ``unpack_ring_states``: codes [..., dim] (low K bits kept), scale [...] ->
    int16 [..., 1 + dim*K/16]."""
    codes = jnp.asarray(codes).astype(jnp.uint32) & np.uint32((1 << K) - 1)
    dim = codes.shape[-1]
    _check(K, dim)
    bits = (codes[..., None] >> np.arange(K, dtype=np.uint32)) & np.uint32(1)
    bits = bits.reshape(*codes.shape[:-1], dim * K // 16, 16)
    words = jnp.sum(bits << np.arange(16, dtype=np.uint32), axis=-1, dtype=jnp.uint32)
    scale_bits = lax.bitcast_convert_type(jnp.asarray(scale, jnp.float16), jnp.uint16)
    words = jnp.concatenate([scale_bits.astype(jnp.uint32)[..., None], words], axis=-1)
    return lax.bitcast_convert_type(words.astype(jnp.uint16), jnp.int16)


def decode_embedding(rows, signs, hidden: int):
    """Decode rows of a quantized token embedding (rotate mode, exl3_format_165.md 2.1-2.2).

    Args:
      rows: int16 [..., G * (1 + 16K)] (the ``.trellis`` rows of the tokens to embed).
      signs: float16 [G, 256] (the ``.signs`` tensor).
      hidden: hidden size; the first ``hidden`` of the G*256 decoded values are kept.
    Returns:
      float16 [..., hidden], bit-exact with exllamav3.
    """
    groups = signs.shape[0]
    per_group = rows.shape[-1] // groups
    K = (per_group - 1) // 16
    if per_group * groups != rows.shape[-1] or 1 + 16 * K != per_group:
        raise ValueError(f"row of {rows.shape[-1]} words is not {groups} rings of 1 + 16K words")
    rings = jnp.asarray(rows).reshape(*rows.shape[:-1], groups, per_group)
    states, scale = unpack_ring_states(rings, K, EMBED_RING_DIM)
    v = decode_states(states, "mul1").astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    v = fwht_butterflies(v) * np.float32(1.0 / 16.0) * jnp.asarray(signs, jnp.float32)
    return v.astype(jnp.float16).reshape(*rows.shape[:-1], groups * EMBED_RING_DIM)[..., :hidden]
