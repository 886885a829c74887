"""SwiGLU MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx

from .linear import project


class GatedMLP(nnx.Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x):
        """x [..., H] -> [..., H] in x's dtype (silu product in fp32)."""
        g, u = (y.astype("float32") for y in project(x, (self.gate_proj, self.up_proj)))
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))
