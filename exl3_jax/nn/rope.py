"""Rotary position embeddings: default, linear and llama3 frequency scaling, partial rotary.

Rotation is the HF "rotate_half" convention (pairs (i, i + r/2) of the first r = rotary_dim
channels of each head); channels past rotary_dim pass through unchanged (partial rotary, GLM-4-MoE).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Static RoPE parameters (hashable, so they can live in a module's static graph)."""
    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                partial_rotary_factor: float = 1.0) -> "RopeConfig":
        """From HF config fields (rope_theta, rope_scaling, partial_rotary_factor)."""
        rotary_dim = int(head_dim * partial_rotary_factor)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"partial_rotary_factor {partial_rotary_factor} gives rotary dim "
                             f"{rotary_dim}, which must be even and in (0, head_dim={head_dim}]")
        scaling = dict(scaling or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported; "
                                      f"supported: {ROPE_TYPES}")
        kw = {}
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(scaling["factor"])
        if rope_type == "llama3":
            kw.update(low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=int(
                          scaling.get("original_max_position_embeddings", 8192)))
        return cls(head_dim=head_dim, rotary_dim=rotary_dim, theta=float(theta),
                   rope_type=rope_type, **kw)

    def inv_freq(self) -> np.ndarray:
        """float32 [rotary_dim / 2] inverse frequencies after scaling."""
        inv = 1.0 / (self.theta ** (np.arange(0, self.rotary_dim, 2, dtype=np.float64)
                                    / self.rotary_dim))
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                               - self.low_freq_factor)
            mid = (1 - smooth) * inv / self.factor + smooth * inv
            inv = np.where(wavelen > low_wavelen, inv / self.factor,
                           np.where(wavelen < high_wavelen, inv, mid))
        return inv.astype(np.float32)


def apply_rope(x, positions, rope: RopeConfig):
    """Rotate the first rotary_dim channels of every head.

    Args:
      x: float [B, T, H, D]; positions: int [B, T]; rope: RopeConfig with head_dim == D.
    Returns:
      [B, T, H, D] in x's dtype (rotation computed in fp32).
    """
    r = rope.rotary_dim
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq())  # [B,T,r/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :r // 2], xf[..., r // 2:r], xf[..., r:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)
