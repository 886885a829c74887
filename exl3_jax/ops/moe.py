"""The dispatch point of the routed-expert MLP (the fused Trellis MoE plugs in here).

Reference implementation only: every expert runs on every token through ``trellis_matmul`` (or a
cached dequantized stack) and the outputs are combined with the routing weights; exact, simple,
and E/top_k times more work than a grouped kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..trellis import Exl3Weight
from .trellis_matmul import pad_input, trellis_matmul

_HIGHEST = jax.lax.Precision.HIGHEST
ACTIVATIONS = ("silu",)


def combine_matrix(ids, weights, num_experts: int, first_expert=0):
    """Dense routing matrix float32 [T, num_experts] of experts first_expert .. + num_experts.

    ids int [T, k] global expert ids, weights [T, k]; entry (t, e) is the sum of the weights with
    which token t routes to expert first_expert + e, and exactly 0 for experts outside the range
    (ids of -1, or experts held on another device; first_expert may be traced).
    """
    local = jnp.asarray(ids) - first_expert                                   # [T, k]
    onehot = local[..., None] == jnp.arange(num_experts)                      # [T, k, E]
    w = jnp.asarray(weights, jnp.float32)[..., None]
    return jnp.sum(jnp.where(onehot, w, 0.0), axis=-2)


def _experts_matmul(x, weight: Exl3Weight, dense, backend, per_expert: bool):
    """Every expert of a stack applied to x.

    Args:
      x: [T, d] shared by all experts, or [E, T, d] per expert (``per_expert``).
      weight: stacked Exl3Weight [E]; dense: its cached float32 [E, k, n] or None.
    Returns:
      float32 [E, T, out_features].
    """
    if dense is not None:
        xp = pad_input(x.astype(jnp.float32), weight.k)
        eq = "etk,ekn->etn" if per_expert else "tk,ekn->etn"
        y = jnp.einsum(eq, xp, dense, precision=_HIGHEST)[..., :weight.out_features]
        if weight.bias is not None:
            y = y + weight.bias[:, None, :weight.out_features].astype(jnp.float32)
        return y
    if per_expert:
        return jax.vmap(lambda xe, w: trellis_matmul(xe, w, backend=backend))(x, weight)
    return jax.vmap(lambda w: trellis_matmul(x, w, backend=backend))(weight)


def moe_experts(x, ids, weights, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, *,
                x_scale=None, dense=None, act: str = "silu", backend: str | None = None):
    """Routed SwiGLU experts: sum_i w_i * down_{e_i}(silu(gate_{e_i}(x)) * up_{e_i}(x)).

    Args:
      x: float [T, d] (fp16, bf16 or fp32), in_features <= d <= k of gate/up.
      ids: int [T, top_k] selected experts; weights: float [T, top_k] routing weights.
      gate, up: stacked Exl3Weight [E] (hidden -> intermediate); down: [E] (intermediate -> hidden).
      x_scale: optional float32 [T, 1]: x is a scaled fp16 operand and the true input is
        x * x_scale (numerics policy at the fp16 boundary); gate/up outputs are rescaled.
      dense: optional (gate, up, down) cached dequantized stacks float32 [E, k, n].
      act: "silu" (SwiGLU).
    Returns:
      float32 [T, down.out_features].
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {act!r}; supported: {ACTIVATIONS}")
    if not (len(gate.stack_shape) == len(up.stack_shape) == len(down.stack_shape) == 1):
        raise ValueError("moe_experts takes expert stacks with one leading axis; got "
                         f"{gate.stack_shape}, {up.stack_shape}, {down.stack_shape}")
    num_experts = gate.stack_shape[0]
    dg, du, dd = dense if dense is not None else (None, None, None)
    g = _experts_matmul(x, gate, dg, backend, per_expert=False)             # [E, T, I]
    u = _experts_matmul(x, up, du, backend, per_expert=False)
    if x_scale is not None:
        g = g * x_scale[None]
        u = u * x_scale[None]
    h = jax.nn.silu(g) * u
    y = _experts_matmul(h, down, dd, backend, per_expert=True)              # [E, T, H]
    return jnp.einsum("te,eth->th", combine_matrix(ids, weights, num_experts), y,
                      precision=_HIGHEST)
