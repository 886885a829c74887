"""The dispatch point of the routed-expert MLP: ``moe``.

Backends (``backend=`` argument, else $EXL3_JAX_MOE_BACKEND, else "auto"):
  * "reference": ``moe_experts``, every expert on every token through ``trellis_matmul`` (or a
    cached dequantized stack), combined with the routing matrix; exact, simple, E/top_k times
    the work of a grouped kernel.
  * "packed": ``moe_packed_reference``, the jnp model of the GPU kernel: routes packed by
    expert into blocks (exl3_jax.ops.moe_routing), each block through its expert's
    ``linear_reference``, combined by gathering each route's row in fp32.
  * "gpu": the grouped Trellis MoE kernels (exl3_jax.ffi.trellis_moe).
  * "auto": "gpu" on a CUDA device with the kernels available, else "reference".

Gate and up that differ in K or codebook cannot share a w13 slab: ``moe`` then takes them as a
(gate, up) pair and runs the all-experts reference.

Mixed bitrates: ``expert_tiers`` groups a layer's experts by (K, codebook) at load, one stack per
tier plus an expert -> (tier, slot) map; ``moe_tiered`` runs them on the GPU as one layer (one
route packing, one launch per phase for all tiers), elsewhere each tier through ``moe`` on the
routes to its experts, summing the tiers' outputs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..trellis import Exl3Weight, linear_reference
from .moe_routing import combine_routes, gather_rows, pack_routes
from .trellis_matmul import pad_input, resolve_backend, trellis_matmul

MOE_BACKENDS = ("auto", "reference", "packed", "gpu")
MOE_BACKEND_ENV = "EXL3_JAX_MOE_BACKEND"

_HIGHEST = jax.lax.Precision.HIGHEST
ACTIVATIONS = ("silu",)


def route_mask(ids, num_experts: int, first_expert=0):
    """bool [T, num_experts]: whether token t routes to expert first_expert + e (ids int [T, k];
    ids of -1 or outside the range route nowhere; first_expert may be traced)."""
    local = jnp.asarray(ids) - first_expert                                   # [T, k]
    return jnp.any(local[..., None] == jnp.arange(num_experts), axis=-2)      # [T, E]


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


def combine_experts(ids, weights, y, first_expert=0):
    """Routed sum of per-expert outputs: out[t] = sum_e combine_matrix[t, e] * y[e, t].

    Args:
      ids: int [T, k] global expert ids; weights: float [T, k].
      y: float32 [E, T, H], every expert's output on every token.
    Returns:
      float32 [T, H]. Experts a token does not route to add exactly 0, even where their output
      is inf or NaN (a plain 0 * inf in the einsum would give NaN).
    """
    num_experts = y.shape[0]
    routed = route_mask(ids, num_experts, first_expert).T                     # [E, T]
    y = jnp.where(routed[..., None], y, 0.0)                                  # [E, T, H]
    return jnp.einsum("te,eth->th", combine_matrix(ids, weights, num_experts, first_expert), y,
                      precision=_HIGHEST)


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
    # The GPU kernels' custom calls have no batching rule: one expert after another there.
    if resolve_backend(backend) == "gpu":
        def over(f):
            return lambda xs: jax.lax.map(f, xs)
    else:
        over = jax.vmap
    if per_expert:
        return over(lambda a: trellis_matmul(a[0], a[1], backend=backend))((x, weight))
    return over(lambda w: trellis_matmul(x, w, backend=backend))(weight)


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
    dg, du, dd = dense if dense is not None else (None, None, None)
    g = _experts_matmul(x, gate, dg, backend, per_expert=False)             # [E, T, I]
    u = _experts_matmul(x, up, du, backend, per_expert=False)
    if x_scale is not None:
        g = g * x_scale[None]
        u = u * x_scale[None]
    h = jax.nn.silu(g) * u
    y = _experts_matmul(h, down, dd, backend, per_expert=True)              # [E, T, H]
    return combine_experts(ids, weights, y)


def plane(w: Exl3Weight, i: int) -> Exl3Weight:
    """Plane i of a [2, E] stack (w13: 0 = gate, 1 = up) as an [E] stack."""
    pick = lambda a: None if a is None else a[i]  # noqa: E731
    return dataclasses.replace(w, trellis=w.trellis[i], suh=w.suh[i], svh=w.svh[i],
                               bias=pick(w.bias))


def stack_layout(w: Exl3Weight) -> tuple:
    """Everything static two linears must share to be stacked into one slab: K, codebook,
    trellis shape, logical sizes and bias presence."""
    return (w.K, w.codebook, tuple(w.trellis.shape), w.in_features, w.out_features,
            w.bias is None)


def can_stack_w13(gate: Exl3Weight, up: Exl3Weight) -> bool:
    """Whether gate and up share everything static (K, codebook, shapes, bias presence)."""
    return stack_layout(gate) == stack_layout(up)


def _stack(ws: Sequence[Exl3Weight]) -> Exl3Weight:
    """ws stacked on a new leading axis (caller checked stack_layout); the trellis words are
    copied as they are, never re-encoded."""
    first = ws[0]
    st = lambda name: (None if getattr(first, name) is None  # noqa: E731
                       else jnp.stack([getattr(w, name) for w in ws]))
    return dataclasses.replace(first, trellis=st("trellis"), suh=st("suh"), svh=st("svh"),
                               bias=st("bias"))


def stack_experts(experts: Sequence[Exl3Weight]) -> Exl3Weight:
    """Single linears of one layout (``stack_layout``) -> one Exl3Weight [E] (done once at
    load)."""
    layouts = {stack_layout(w) for w in experts}
    if len(layouts) != 1:
        raise ValueError(f"experts of one stack must share K, codebook, shape and bias presence; "
                         f"got {len(layouts)} layouts (K, codebook): "
                         f"{sorted({(lay[0], lay[1]) for lay in layouts})}")
    return _stack(list(experts))


def stack_w13(gate: Exl3Weight, up: Exl3Weight) -> Exl3Weight:
    """Stack gate and up [E] into the projection-major w13 [2, E] (done once at load; the
    trellis words are copied as they are, never re-encoded)."""
    if not can_stack_w13(gate, up):
        raise ValueError(f"gate and up stacks differ: K {gate.K}/{up.K}, codebook "
                         f"{gate.codebook}/{up.codebook}, trellis {gate.trellis.shape}/"
                         f"{up.trellis.shape}")
    return _stack([gate, up])


def _take_expert(w: Exl3Weight, e) -> Exl3Weight:
    """Expert e (traced int) of an [E] stack as one linear."""
    pick = lambda a: None if a is None else a[e]  # noqa: E731
    return dataclasses.replace(w, trellis=w.trellis[e], suh=w.suh[e], svh=w.svh[e],
                               bias=pick(w.bias))


def _linear_ref(x, w: Exl3Weight):
    y = linear_reference(pad_input(x, w.k), w.trellis, w.suh, w.svh, w.codebook, w.bias)
    return y[..., :w.out_features]


def moe_packed_reference(x, ids, weights, w13: Exl3Weight, down: Exl3Weight, *, x_scale=None,
                         block_m: int | None = None):
    """jnp model of the grouped GPU MoE (same packing, per-block expert, fp32 math).

    Args:
      x: float [T, d]; ids int [T, top_k] (-1 / out of range = no expert); weights [T, top_k].
      w13: Exl3Weight [2, E] (gate, up); down: Exl3Weight [E].
      x_scale: optional float32 [T, 1] (true input x * x_scale).
      block_m: rows per block (None: chosen from the average routes per expert).
    Returns:
      float32 [T, down.out_features].
    """
    E = w13.stack_shape[1]
    pr = pack_routes(ids, E, block_m)
    bm = pr.block_m
    xr = gather_rows(jnp.asarray(x, jnp.float32), pr.row_token)                  # [rows, d]
    xb = xr.reshape(pr.blocks, bm, -1)                                            # [B, bm, d]
    eb = jnp.maximum(pr.block_expert, 0)                                          # [B]
    gate, up = plane(w13, 0), plane(w13, 1)

    def block(xblk, e):
        g = _linear_ref(xblk, _take_expert(gate, e))                              # [bm, I]
        u = _linear_ref(xblk, _take_expert(up, e))
        return g, u

    g, u = jax.lax.map(lambda a: block(*a), (xb, eb))                             # [B, bm, I]
    if x_scale is not None:
        s = gather_rows(jnp.asarray(x_scale, jnp.float32), pr.row_token).reshape(
            pr.blocks, bm, 1)
        g, u = g * s, u * s
    h = jax.nn.silu(g) * u
    y = jax.lax.map(lambda a: _linear_ref(a[0], _take_expert(down, a[1])), (h, eb))
    live = (pr.block_expert >= 0)[:, None, None]
    y = jnp.where(live, y, 0.0).reshape(pr.rows, -1)                              # [rows, H]
    return combine_routes(y, pr.route_row, weights)


def resolve_moe_backend(backend: str | None, w13: Exl3Weight, down: Exl3Weight) -> str:
    """'reference', 'packed' or 'gpu' (trace time, static information only)."""
    choice = backend or os.environ.get(MOE_BACKEND_ENV, "auto") or "auto"
    if choice not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {choice!r} (from "
                         f"{'argument' if backend else MOE_BACKEND_ENV}); use one of "
                         f"{MOE_BACKENDS}")
    if choice != "auto":
        return choice
    if resolve_backend(None) != "gpu":
        return "reference"
    from ..ffi import trellis_gemm
    if not trellis_gemm._cutlass_jax_ok():     # AOT-only process: no MoE artifacts yet
        return "reference"
    from ..ffi import trellis_moe
    return "gpu" if trellis_moe.supports(w13, down) else "reference"


def moe(x, ids, weights, w13, down: Exl3Weight, *, x_scale=None, dense=None,
        backend: str | None = None, linear_backend: str | None = None):
    """Routed SwiGLU experts: sum_i w_i * down_{e_i}(silu(gate_{e_i}(x)) * up_{e_i}(x)).

    Args:
      x: float [T, d]; ids int [T, top_k] (-1 / out of range = no expert); weights [T, top_k].
      w13: Exl3Weight [2, E] (plane 0 gate, plane 1 up), or a (gate [E], up [E]) pair when
        gate and up cannot share a slab (``can_stack_w13``); a pair always runs the
        all-experts reference. down: Exl3Weight [E].
      x_scale: optional float32 [T, 1] (x is a scaled fp16 operand of true input x * x_scale).
      dense: optional cached dequantized (gate, up, down) float32 [E, k, n] (reference only).
      backend: see the module docstring; linear_backend: passed to trellis_matmul by the
        "reference" backend.
    Returns:
      float32 [T, down.out_features].
    """
    if not isinstance(w13, Exl3Weight):
        gate, up = w13
        return moe_experts(x, ids, weights, gate, up, down, x_scale=x_scale, dense=dense,
                           backend=linear_backend)
    kind = "reference" if dense is not None else resolve_moe_backend(backend, w13, down)
    if kind == "gpu":
        return _moe_gpu(x, ids, weights, w13, down, x_scale)
    if kind == "packed":
        return moe_packed_reference(x, ids, weights, w13, down, x_scale=x_scale)
    return moe_experts(x, ids, weights, plane(w13, 0), plane(w13, 1), down, x_scale=x_scale,
                       dense=dense, backend=linear_backend)


def token_bucket(T: int) -> int:
    """Static token count the GPU kernels are compiled for: T itself in the decode range, else
    the next power of two (at most the capacity), so prompts of different lengths share
    compiled kernels."""
    from .moe_plans import DECODE_MAX_M, DEFAULT_CAPACITY
    if T <= DECODE_MAX_M:
        return T
    return min(DEFAULT_CAPACITY, 1 << (T - 1).bit_length())


def _moe_gpu(x, ids, weights, w13, down, x_scale, tiers=None):
    """trellis_moe.moe_gpu up to the plans' capacity, above it in capacity-sized slices."""
    from .moe_plans import DEFAULT_CAPACITY
    T = x.shape[0]
    if T <= DEFAULT_CAPACITY:
        return _moe_gpu_bucketed(x, ids, weights, w13, down, x_scale, tiers)
    outs = []
    for t0 in range(0, T, DEFAULT_CAPACITY):
        sl = slice(t0, min(T, t0 + DEFAULT_CAPACITY))
        outs.append(_moe_gpu_bucketed(x[sl], ids[sl], weights[sl], w13, down,
                                      None if x_scale is None else x_scale[sl], tiers))
    return jnp.concatenate(outs)


def _moe_gpu_bucketed(x, ids, weights, w13, down, x_scale, tiers=None):
    """moe_gpu on T rows padded to token_bucket(T) with routeless tokens (ids -1: no rows, an
    exact zero output), result sliced back to T."""
    from ..ffi import trellis_moe
    T = x.shape[0]
    Tb = token_bucket(T)
    if Tb != T:
        pad = Tb - T
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = jnp.pad(jnp.asarray(ids, jnp.int32), ((0, pad), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        if x_scale is not None:
            x_scale = jnp.pad(x_scale, ((0, pad), (0, 0)), constant_values=1.0)
    return trellis_moe.moe_gpu(x, ids, weights, w13, down, x_scale=x_scale, tiers=tiers)[:T]


def _select(projection, members: list[int]) -> Exl3Weight:
    """Experts ``members`` of one projection, given stacked [E] (one layout: a gather) or as a
    sequence of single linears (stacked here)."""
    if isinstance(projection, Exl3Weight):
        idx = np.asarray(members)
        return jax.tree.map(lambda a: a[idx], projection)
    return stack_experts([projection[e] for e in members])


def expert_tiers(gate, up, down) -> tuple[list[tuple[Exl3Weight, Exl3Weight, Exl3Weight]],
                                           np.ndarray, np.ndarray]:
    """Group a layer's experts into tiers of one (K, codebook) per projection.

    Args:
      gate, up, down: each either an Exl3Weight [E] (all experts of that projection share one
        layout) or a sequence of E single Exl3Weights (mixed K / codebook).
    Returns:
      (tiers, expert_tier, expert_slot): tiers = (gate, up, down) Exl3Weight [E_t] each,
      ordered by their K (gate, up, down) ascending, then by their first expert; a tier's
      experts in ascending id order, stacked natively (trellis words copied, never
      re-encoded). expert_tier / expert_slot int32 [E]: global expert e lives in
      tiers[expert_tier[e]] at slot expert_slot[e].
    """
    projections = (gate, up, down)
    counts = {w.stack_shape[0] if isinstance(w, Exl3Weight) else len(w) for w in projections}
    if len(counts) != 1:
        raise ValueError(f"gate, up and down hold different numbers of experts: {counts}")
    num_experts = counts.pop()

    def layout(p, e):
        w = projections[p]
        return stack_layout(w if isinstance(w, Exl3Weight) else w[e])

    members: dict[tuple, list[int]] = {}                    # joint layout -> experts (ascending)
    for e in range(num_experts):
        members.setdefault(tuple(layout(p, e) for p in range(3)), []).append(e)
    order = sorted(members, key=lambda key: (tuple(lay[0] for lay in key), members[key][0]))
    tiers = []
    expert_tier = np.full(num_experts, -1, np.int32)
    expert_slot = np.full(num_experts, -1, np.int32)
    for t, key in enumerate(order):
        ids = members[key]
        expert_tier[ids] = t
        expert_slot[ids] = np.arange(len(ids))
        tiers.append(tuple(_select(w, ids) for w in projections))
    return tiers, expert_tier, expert_slot


def tier_glue(tiers, expert_tier, expert_slot):
    """The rotation tables of tiered experts in global expert order, for the glue kernels of
    one set of launches: (suh13 [2, E, H], svh13 [2, E, I], suh2 [E, I], svh2 [E, H]), expert e
    taken from slot expert_slot[e] of tier expert_tier[e]. tiers: (w13 [2, E_t], down [E_t])
    slabs; the maps int32 [E] (may be traced; tier -1: an expert in no tier)."""
    counts = [w13.stack_shape[1] for w13, _ in tiers]
    offset = jnp.asarray(np.cumsum([0] + counts[:-1]), jnp.int32)
    tier = jnp.asarray(expert_tier, jnp.int32)
    # An expert in no tier (tier -1: held by another rank) gets tier 0's first expert's finite
    # tables; its blocks decode nothing, so its rows stay exactly zero.
    order = jnp.where(tier >= 0, offset[jnp.maximum(tier, 0)]
                      + jnp.asarray(expert_slot, jnp.int32), 0)

    def global_order(vectors, axis):
        return jnp.take(jnp.concatenate(vectors, axis=axis), order, axis=axis)
    return (global_order([w.suh for w, _ in tiers], 1), global_order([w.svh for w, _ in tiers], 1),
            global_order([d.suh for _, d in tiers], 0), global_order([d.svh for _, d in tiers], 0))


def tiers_share_launches(tiers) -> bool:
    """Whether the GPU serves these tiers with one set of launches (trellis_moe.moe_gpu's
    ``tiers``): [2, E_t] w13 slabs, no biases, one hidden and intermediate size, at most
    trellis_moe.MAX_TIERS tiers of supported rates."""
    from ..ffi import trellis_moe
    if any(not isinstance(w13, Exl3Weight) for w13, _ in tiers):
        return False
    w13s, downs = [t[0] for t in tiers], [t[1] for t in tiers]
    return (all(w.bias is None for w in w13s + downs)
            and trellis_moe.supports(w13s, downs) and trellis_moe.fused_glue_default())


def moe_tiered(x, ids, weights, tiers, expert_tier, expert_slot, *, x_scale=None, dense=None,
               backend: str | None = None, glue=None):
    """Mixed-bitrate experts: tier t holds (w13, down [E_t]) of one layout each, w13 as ``moe``
    takes it (a [2, E_t] slab or a (gate, up) pair); global expert e lives in tier
    expert_tier[e] at slot expert_slot[e] (int32 [E] arrays, may be traced).

    On the GPU, tiers that ``tiers_share_launches`` run as one layer: one route packing over the
    global ids, each phase one launch whose grouped GEMMs pick each block's tier (``glue``: the
    ``tier_glue`` tables, computed here when not given). Otherwise each tier runs through
    ``moe`` (its backend choice, EXL3_JAX_MOE_BACKEND included) on the routes to its experts
    (the others masked to -1: no rows, an exact zero) and the tiers' fp32 outputs are summed in
    tier order. dense: optional per-tier cached dequantized stacks (None for a tier without).
    Returns float32 [T, out_features]."""
    ids = jnp.asarray(ids, jnp.int32)
    num_experts = jnp.shape(expert_tier)[0]
    dense = dense if dense is not None else (None,) * len(tiers)
    if (all(d is None for d in dense) and isinstance(tiers[0][0], Exl3Weight)
            and resolve_moe_backend(backend, *tiers[0]) == "gpu"
            and tiers_share_launches(tiers)):
        glue = glue if glue is not None else tier_glue(tiers, expert_tier, expert_slot)
        maps = (jnp.asarray(expert_tier, jnp.int32), jnp.asarray(expert_slot, jnp.int32), glue)
        return _moe_gpu(x, ids, weights, [t[0] for t in tiers], [t[1] for t in tiers], x_scale,
                        maps)
    valid = (ids >= 0) & (ids < num_experts)        # others route nowhere (kernels spec 4.2)
    safe = jnp.where(valid, ids, 0)
    tier_of = jnp.asarray(expert_tier, jnp.int32)[safe]                           # [T, k]
    slot_of = jnp.asarray(expert_slot, jnp.int32)[safe]
    out = None
    for t, ((w13, down), cached) in enumerate(zip(tiers, dense, strict=True)):
        local = jnp.where(valid & (tier_of == t), slot_of, -1)                    # [T, k]
        y = moe(x, local, weights, w13, down, x_scale=x_scale, dense=cached, backend=backend)
        out = y if out is None else out + y
    return out
