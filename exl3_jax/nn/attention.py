"""Grouped-query attention over a static KV cache.

The cache is a plain pytree (``KVCache``) of fixed size S: every call writes its T new key/value
rows at slot ``cache.slot`` (the same for every sequence in the batch; prompts are left-padded)
and attends over all S slots under a mask, so shapes never change between decode steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .linear import project
from .rope import RopeConfig, apply_rope

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-size KV cache of a whole model.

    Leaves:
      k, v: tuples (one per layer) of [B, S, Hkv, D] in the activation dtype.
      valid: bool [B, S]; slot s holds a real (not padding) token of row b.
      pos: int32 [B]; RoPE position of the next real token of each row.
      slot: int32 []; next slot to write (shared by all rows).
    """
    k: Any
    v: Any
    valid: Any
    pos: Any
    slot: Any

    @property
    def size(self) -> int:
        return int(self.valid.shape[1])

    @property
    def batch(self) -> int:
        return int(self.valid.shape[0])


def init_cache(num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
               dtype) -> KVCache:
    """An empty cache: zeros, nothing valid, positions and slot at 0."""
    shape = (batch, size, num_kv_heads, head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   valid=jnp.zeros((batch, size), bool), pos=jnp.zeros((batch,), jnp.int32),
                   slot=jnp.zeros((), jnp.int32))


def advance(cache: KVCache, token_valid):
    """Positions, mask and the updated bookkeeping for T new tokens (before the layers run).

    Args:
      cache: the cache before this call.
      token_valid: bool [B, T]; False for left padding.
    Returns:
      (positions int32 [B, T], mask bool [B, T, S], the cache with valid/pos/slot advanced).
      The layers write their k/v at the old ``cache.slot``. The caller guarantees room:
      slot + T <= S (``lax.dynamic_update_slice`` would silently clamp otherwise).
    """
    B, T = token_valid.shape
    S = cache.size
    tv = token_valid.astype(jnp.int32)
    positions = cache.pos[:, None] + jnp.cumsum(tv, axis=1) - 1
    positions = jnp.maximum(positions, 0)
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid.astype(bool), (0, cache.slot))
    q_slot = cache.slot + jnp.arange(T)                                   # [T]
    k_slot = jnp.arange(S)                                                # [S]
    causal = k_slot[None, :] <= q_slot[:, None]                           # [T, S]
    self_slot = k_slot[None, :] == q_slot[:, None]
    mask = causal[None] & (valid[:, None, :] | self_slot[None])           # [B, T, S]
    new = dataclasses.replace(cache, valid=valid, pos=cache.pos + tv.sum(axis=1),
                              slot=cache.slot + T)
    return positions, mask, new


def gqa_attention(q, k, v, mask, scale: float):
    """Softmax attention with grouped KV heads; fp32 softmax and accumulation.

    The two products take the cache's dtype as operands: a bf16 cache runs them on bf16 tensor
    cores with fp32 accumulation (q and the probabilities rounded to bf16, as flash attention
    does), which on the H200 is what keeps the decode step's attention off the fp32 HIGHEST
    path (bench/NOTES.md); an fp32 cache keeps fp32 operands at Precision.HIGHEST (the exact
    mode the tests compare against).

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] (Hq a multiple of Hkv); mask: bool [B, T, S].
    Returns:
      float32 [B, T, Hq, D].
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    dt = jnp.promote_types(k.dtype, v.dtype)
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    qg = q.astype(dt).reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(dt), precision=precision,
                   preferred_element_type=jnp.float32) * scale              # [B, Hkv, G, T, S]
    s = jnp.where(mask[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(dt), v.astype(dt), precision=precision,
                   preferred_element_type=jnp.float32)                       # [B, T, Hkv, G, D]
    return o.reshape(B, T, Hq, D)


class Attention(nnx.Module):
    """q/k/v/o projections (Exl3Linear or Linear), optional per-head q/k RMSNorm (Qwen3, GLM),
    RoPE, GQA over the static cache."""

    def __init__(self, q_proj, k_proj, v_proj, o_proj, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope: RopeConfig, q_norm=None, k_norm=None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope = rope

    def __call__(self, x, positions, mask, k_cache, v_cache, write_slot):
        """x [B, T, H]; positions int32 [B, T]; mask bool [B, T, S]; k_cache/v_cache
        [B, S, Hkv, D]; write_slot int32 [] -> (out [B, T, H], k_cache, v_cache)."""
        B, T, _ = x.shape
        with jax.named_scope("qkv"):
            q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        with jax.named_scope("qk_norm_rope"):
            q = q.reshape(B, T, self.num_heads, self.head_dim)
            k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
            v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rope(q, positions, self.rope)
            k = apply_rope(k, positions, self.rope)
        with jax.named_scope("cache_update"):
            zero = jnp.zeros((), jnp.int32)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype),
                                                   (zero, write_slot, zero, zero))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype),
                                                   (zero, write_slot, zero, zero))
        with jax.named_scope("attend"):
            o = gqa_attention(q, k_cache, v_cache, mask, self.head_dim ** -0.5).astype(x.dtype)
        with jax.named_scope("o_proj"):
            o = self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))
        return o, k_cache, v_cache
