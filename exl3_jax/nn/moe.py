"""Sparse MoE block: router, routed SwiGLU experts, optional shared experts.

Router logits: ``Router``, the weight [E, H] as the checkpoint stores it (HF orientation and
dtype). Routers (all math after the logits in fp32, spec 5.2):
* ``"softmax"`` (Qwen3-MoE, Mixtral): p = softmax(logits) over all experts, top-k of p, optionally
  renormalised to sum 1 (Mixtral always; Qwen3-MoE when norm_topk_prob). Equivalent to exllamav3's
  ``std`` router (softmax over the selected logits) when renormalised.
* ``"sigmoid"`` (GLM-4-MoE, exllamav3 ``dots``): s = sigmoid(logits); experts picked by top-k of
  s + e_score_correction_bias; weights are the unbiased s of the picked experts, optionally
  normalised to sum 1 (+1e-20), times routed_scaling_factor. No group limiting.

Experts: ``routed_experts`` builds the module from the loaded stacks: ``Exl3Experts`` when every
projection has one K and codebook (one tier), ``TieredExl3Experts`` for mixed-K layers (one
``Exl3Experts`` per (K, codebook) tier, run through ``ops.moe_tiered``), ``PlainExperts`` for
unquantized weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..ops.moe import (can_stack_w13, combine_experts, expert_tiers, moe, moe_tiered, plane,
                       stack_w13, tier_glue)
from ..trellis import Exl3Weight
from .linear import dequantize_weight, dot_f32

ROUTERS = ("softmax", "sigmoid")
_HIGHEST = jax.lax.Precision.HIGHEST


def route_softmax_topk(logits, top_k: int, renormalize: bool):
    """logits float [T, E] -> (ids int32 [T, top_k], weights float32 [T, top_k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w


def route_sigmoid_topk(logits, bias, top_k: int, renormalize: bool, scaling: float):
    """GLM-4-MoE / "dots" router.

    logits float [T, E], bias [E] or None -> (ids int32 [T, k], weights float32 [T, k])."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    _, ids = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), w * scaling


class Exl3Experts(nnx.Module):
    """Stacked EXL3 experts in the fused-MoE layout: ``w13`` = Exl3Weight [2, E] (plane 0 gate,
    plane 1 up, stacked once here at load, trellis words unchanged) and ``down`` [E].
    ``gate`` / ``up`` are [E] views of the planes (sharding, dequantized caches). When gate and
    up differ in K or codebook they cannot share a slab: they stay separate (``w13`` is None)
    and the layer runs the all-experts reference."""

    def __init__(self, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight):
        for name, w in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(w, Exl3Weight):
                raise TypeError(f"{name} experts must be one stacked Exl3Weight, got "
                                f"{type(w).__name__}; mixed-K layers are built by "
                                f"routed_experts (TieredExl3Experts)")
            if len(w.stack_shape) != 1:
                raise ValueError(f"{name} experts need one leading expert axis, got "
                                 f"{w.stack_shape}")
        if can_stack_w13(gate, up):
            self.w13, self.split = nnx.data(stack_w13(gate, up)), nnx.data(None)
        else:
            self.w13, self.split = nnx.data(None), nnx.data((gate, up))
        self.down = nnx.data(down)
        self.dense = nnx.data(None)

    @property
    def gate(self) -> Exl3Weight:
        return plane(self.w13, 0) if self.w13 is not None else self.split[0]

    @property
    def up(self) -> Exl3Weight:
        return plane(self.w13, 1) if self.w13 is not None else self.split[1]

    @property
    def gate_up(self):
        """gate/up as ``ops.moe`` takes them: the w13 slab, or the (gate, up) pair."""
        return self.w13 if self.w13 is not None else self.split

    @property
    def num_experts(self) -> int:
        return self.down.stack_shape[0]

    def cache_dequantized(self) -> None:
        self.dense = nnx.data(tuple(dequantize_weight(w) for w in (self.gate, self.up,
                                                                     self.down)))

    def __call__(self, x, ids, weights):
        """x [T, H] -> float32 [T, H] (routed sum), through ``exl3_jax.ops.moe``."""
        return moe(x, ids, weights, self.gate_up, self.down, dense=self.dense)


class TieredExl3Experts(nnx.Module):
    """Mixed-bitrate experts: one ``Exl3Experts`` per (K, codebook) tier (``ops.expert_tiers``:
    tiers by K ascending, experts in id order) and the maps expert_tier / expert_slot int32 [E]
    (global expert e is slot expert_slot[e] of tiers[expert_tier[e]]). Runs through
    ``ops.moe_tiered`` with the numerics policy of ``Exl3Experts``."""

    def __init__(self, tiers, expert_tier, expert_slot):
        if len(tiers) < 2:
            raise ValueError(f"TieredExl3Experts needs at least two tiers, got {len(tiers)} "
                             f"(one tier is an Exl3Experts)")
        self.tiers = nnx.List([Exl3Experts(*t) for t in tiers])
        self.expert_tier = nnx.data(jnp.asarray(expert_tier, jnp.int32))
        self.expert_slot = nnx.data(jnp.asarray(expert_slot, jnp.int32))
        # The rotation tables in global expert order, built once (~1% of the experts' bytes)
        # for the GPU's one-set-of-launches path (ops.moe.tier_glue); None when some tier has
        # no w13 slab (that layer runs tier by tier).
        slabs = [(t.w13, t.down) for t in self.tiers]
        self.glue = nnx.data(None if any(w is None for w, _ in slabs) else
                             tier_glue(slabs, self.expert_tier, self.expert_slot))

    @property
    def num_experts(self) -> int:
        return int(self.expert_tier.shape[0])

    def __call__(self, x, ids, weights):
        """x [T, H] -> float32 [T, H] (routed sum)."""
        return moe_tiered(x, ids, weights, [(t.gate_up, t.down) for t in self.tiers],
                          self.expert_tier, self.expert_slot,
                          dense=[t.dense for t in self.tiers], glue=self.glue)


class PlainExperts(nnx.Module):
    """Unquantized stacked experts (HF-layout reference models): w [E, in, out]."""

    def __init__(self, gate, up, down):
        for name, w in (("gate", gate), ("up", up), ("down", down)):
            if isinstance(w, (Exl3Weight, list, tuple)):
                raise TypeError(f"{name} experts are EXL3 ({type(w).__name__}), not a plain "
                                f"[E, in, out] array; build the layer with routed_experts")
        self.gate, self.up, self.down = nnx.Param(gate), nnx.Param(up), nnx.Param(down)

    @property
    def num_experts(self) -> int:
        return int(self.gate.shape[0])

    def __call__(self, x, ids, weights):
        xf = x.astype(jnp.float32)
        g = jnp.einsum("th,ehi->eti", xf, self.gate[...].astype(jnp.float32), precision=_HIGHEST)
        u = jnp.einsum("th,ehi->eti", xf, self.up[...].astype(jnp.float32), precision=_HIGHEST)
        y = jnp.einsum("eti,eih->eth", jax.nn.silu(g) * u, self.down[...].astype(jnp.float32),
                       precision=_HIGHEST)
        return combine_experts(ids, weights, y)


def routed_experts(gate, up, down):
    """The routed-experts module of one MoE layer from its loaded projections.

    Args:
      gate, up, down: what ``models.WeightSource.expert_stack`` returns for each projection:
        float [E, in, out] (unquantized), an Exl3Weight [E] (one K and codebook), or a sequence
        of E single Exl3Weights (mixed K / codebook).
    Returns:
      PlainExperts; Exl3Experts when every projection is one stack (today's single-tier
      layout); else TieredExl3Experts, experts grouped by (K, codebook) of all three projections.
    """
    projections = (gate, up, down)
    quantized = [isinstance(w, (Exl3Weight, list, tuple)) for w in projections]
    if not any(quantized):
        return PlainExperts(gate, up, down)
    if not all(quantized):
        raise ValueError("an MoE layer mixes EXL3 and plain expert projections")
    if all(isinstance(w, Exl3Weight) for w in projections):
        return Exl3Experts(gate, up, down)
    tiers, expert_tier, expert_slot = expert_tiers(gate, up, down)
    if len(tiers) == 1:
        return Exl3Experts(*tiers[0])
    return TieredExl3Experts(tiers, expert_tier, expert_slot)


class Router(nnx.Module):
    """Router logits of an MoE layer: weight [E, H] in the checkpoint's orientation, kept in
    its dtype when that is float16 / bfloat16 (else float32), so bf16 activations meet a bf16
    weight in one exact-product dot (``nn.linear.dot_f32``).

    Why [E, H] and not Linear's [H, E]: at one token XLA turns the dot into a reduce over H, a
    row reduce of one fusion with this layout (~2 us on the H200 for Qwen3-30B-A3B's 2048 x
    128, scripts/gpu_router_probe.py), a column reduce of two (4.6-5.4 us) with [H, E]."""

    def __init__(self, weight):
        w = jnp.asarray(weight)
        if w.ndim != 2:
            raise ValueError(f"router weight must be [experts, hidden], got shape {w.shape}")
        if w.dtype not in (jnp.float16, jnp.bfloat16):
            w = w.astype(jnp.float32)
        self.weight = nnx.Param(w)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, x):
        """x [..., H] -> float32 [..., E]."""
        return dot_f32("...h,eh->...e", x, self.weight[...])


class MoEBlock(nnx.Module):
    """router (``Router``, hidden -> E) + routed experts (+ shared experts MLP)."""

    def __init__(self, router, experts, *, top_k: int, router_kind: str, renormalize: bool,
                 routed_scaling_factor: float = 1.0, score_bias=None, shared=None):
        if not isinstance(router, Router):
            raise TypeError(f"router must be an nn.Router (weight [E, H]), got "
                            f"{type(router).__name__}")
        if router_kind not in ROUTERS:
            raise ValueError(f"unknown router kind {router_kind!r}; use one of {ROUTERS}")
        if not 0 < top_k <= experts.num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} not in [1, {experts.num_experts}]")
        if router.out_features != experts.num_experts:
            raise ValueError(f"router has {router.out_features} outputs for "
                             f"{experts.num_experts} experts")
        self.router, self.experts, self.shared = router, experts, shared
        self.top_k, self.router_kind, self.renormalize = top_k, router_kind, renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.score_bias = nnx.Param(jnp.asarray(score_bias)) if score_bias is not None \
            else nnx.data(None)

    def route(self, x):
        """x [T, H] -> (ids int32 [T, k], weights float32 [T, k])."""
        logits = self.router.logits(x)
        if self.router_kind == "softmax":
            return route_softmax_topk(logits, self.top_k, self.renormalize)
        bias = None if self.score_bias is None else self.score_bias[...]
        return route_sigmoid_topk(logits, bias, self.top_k, self.renormalize,
                                  self.routed_scaling_factor)

    def __call__(self, x):
        """x [..., H] -> [..., H] in x's dtype."""
        lead = x.shape[:-1]
        xt = x.reshape(-1, x.shape[-1])
        with jax.named_scope("router"):
            ids, w = self.route(xt)
        with jax.named_scope("experts"):
            y = self.experts(xt, ids, w)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y = y + self.shared(xt).astype(jnp.float32)
        return y.astype(x.dtype).reshape(*lead, -1)


__all__ = ["ROUTERS", "Exl3Experts", "MoEBlock", "PlainExperts", "Router", "TieredExl3Experts",
           "route_sigmoid_topk", "route_softmax_topk", "routed_experts"]
