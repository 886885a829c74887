"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x, weight, eps: float):
    """x [..., d] * rsqrt(mean(x^2) + eps) * weight [d], in fp32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, weight, eps: float):
        self.weight = nnx.Param(jnp.asarray(weight))
        self.eps = float(eps)

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
