"""SwiGLU MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx


class GatedMLP(nnx.Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x):
        """x [..., H] -> [..., H] in x's dtype (silu product in fp32)."""
        g = self.gate_proj(x).astype("float32")
        u = self.up_proj(x).astype("float32")
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))
