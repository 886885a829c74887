"""Meshes, tensor-parallel and expert-parallel rules for EXL3 weights, and shard_map forwards.

Spec: shared/spec/exl3_format.md section 8 (slicing rules) and 5.2 (expert parallel).

An EXL3 tensor can only be cut on multiples of 128 along the cut axis (the Hadamard blocks); then
every piece is itself a valid EXL3 tensor and no re-encoding is needed:

* column-parallel (q, k, v, gate, up, lm_head): slice n. trellis dim -2 ``[first/16:last/16]``,
  svh and bias ``[first:last]``; suh is replicated. Each rank computes its output columns.
* row-parallel (o, down): slice k. trellis dim -3, suh ``[first:last]``; svh is full; the bias is
  added on rank 0 only; the partial outputs are summed (psum). The sum is exact math because each
  rank applies the full (linear) output transform ``had(.) * svh`` to its partial product.

Shards are equal (as in vLLM): ``size % tp == 0`` and ``size / tp`` a multiple of 128, else a
``ShardingError`` naming the layer. When tp exceeds the number of KV heads, k/v shards are
replicated (rank r holds KV head ``r // (tp / num_kv_heads)``), and every shard start must still be
128-aligned. Experts split across ranks by contiguous ranges (expert parallel), or every expert is
cut like an MLP (tensor-split experts: gate/up column, down row).

Sharding is done once, at load: ``shard_column`` / ``shard_row`` / ``shard_experts`` lay an
``Exl3Weight`` out on the mesh (one ``NamedSharding`` per leaf); the forwards
(``tp_column_linear``, ``tp_row_linear``, ``tp_mlp``, ``ep_moe``, ``tensor_split_moe``) wrap
``jax.shard_map`` around per-shard calls of ``exl3_jax.ops.trellis_matmul``. Inside a shard_map
body of your own, use ``column_parallel_matmul`` / ``row_parallel_matmul`` / ``local_moe`` (the
per-rank view of ``exl3_jax.ops.moe``).

Rank-sliced checkpoints (spec 7) carry one independently encoded slice per rank, which is not a
cut of a common tensor; ``rank_stacked`` puts such slices on the mesh with a leading rank axis
(each process supplies only the ranks of its own devices, so under jax.distributed every process
reads only its own slices), and ``rank_sliced_layer`` / ``rank_sliced_moe`` load and run a layer.

A whole ``models.decoder.CausalLM``: ``shard_model`` lays it out and returns a ``ShardedModel``
that runs the model's own graph per rank (rank-local head counts; q/k/v/gate/up column blocks,
``RowParallelLinear`` o/down, ``ShardedExperts``, ``GatheredColumnLinear`` head) in one
shard_map, with the KV cache split by KV heads. Generation and full-sequence logits go through
``exl3_jax.generate.Generator`` with ``mesh=``, the same jitted prefill / decode loop as on one
device::

    gen = Generator(model, mesh=make_mesh(4), moe_mode="experts")
    gen.generate(prompts, max_new_tokens=32)          # GenerationResult, as without a mesh
    gen.logits(tokens)                                # float32 [B, T, vocab]

Meshes use ``AxisType.Auto`` axes (jax 0.10.2 defaults to Explicit, under which shard_map rejects
unsharded inputs; shared/spec/jax_gpu_paths.md 7.4), so the same code runs on 0.10.2 and 0.11.2.
Under jax.distributed the same calls run in every process on a mesh over all processes' devices
(``put_global`` / ``to_host`` move host values in and out).

Example (a gated MLP at tp=4; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=4
before importing jax)::

    mesh = make_mesh(4)
    g, u, d = shard_mlp(mesh, gate, up, down, layer="model.layers.0.mlp")   # once, at load
    y = jax.jit(lambda x, g, u, d: tp_mlp(mesh, x, g, u, d))(x, g, u, d)   # [T, H] float32
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .format.spec import HADAMARD_BLOCK, TILE
from .nn import (Exl3Experts, Exl3Linear, KVCache, MoEBlock, exl3_forward,
                 init_cache)
from .nn.moe import TieredExl3Experts
from .ops import moe, moe_experts, moe_tiered, pad_input, stack_w13, trellis_matmul
from .ops.moe import can_stack_w13
from .trellis import Exl3Weight

TP_AXIS = "tp"

Range = tuple[int, int]


class ShardingError(ValueError):
    """A weight cannot be split as asked (not on 128-aligned boundaries, or not evenly).

    ``layer`` is the name of the layer the caller passed; the message always names it.
    """

    def __init__(self, message: str, *, layer: str):
        self.layer = layer
        super().__init__(f"{layer}: {message}")


# --------------------------------------------------------------------------------------------
# mesh

def make_mesh(tp: int | None = None, *, axes: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A device mesh with named axes, all of type Auto.

    Args:
      tp: size of the single axis "tp" (default: all devices). Ignored when ``axes`` is given.
      axes: ordered axis name -> size, e.g. ``{"dp": 2, "tp": 4}``.
      devices: the devices to use (default: the first prod(sizes) of ``jax.devices()``).
    """
    if axes is None:
        axes = {TP_AXIS: tp if tp is not None else len(devices or jax.devices())}
    names, shape = tuple(axes), tuple(int(s) for s in axes.values())
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh axis sizes must be positive, got {dict(axes)}")
    count = math.prod(shape)
    pool = list(devices) if devices is not None else jax.devices()
    if len(pool) < count:
        raise ValueError(f"a mesh {dict(axes)} needs {count} devices, only {len(pool)} available "
                         f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                         f"before importing jax)")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=pool[:count])


# --------------------------------------------------------------------------------------------
# partitions (pure integer rules)

def _check_aligned(first: int, last: int, *, layer: str, what: str) -> None:
    if first % HADAMARD_BLOCK or last % HADAMARD_BLOCK or last <= first:
        raise ShardingError(f"{what} range [{first}, {last}) is not a non-empty range on "
                            f"{HADAMARD_BLOCK}-aligned boundaries (EXL3 tensors can only be cut "
                            f"between Hadamard blocks)", layer=layer)


def even_partition(size: int, parts: int, *, layer: str, what: str = "axis") -> list[Range]:
    """Split [0, size) into ``parts`` equal contiguous ranges on 128-aligned boundaries.

    Returns [(first, last)] per rank. Raises ShardingError naming ``layer`` when ``size`` is not
    divisible by ``parts`` or the shard size is not a multiple of 128 (e.g. a split below 128).
    """
    if parts < 1:
        raise ValueError(f"number of shards must be positive, got {parts}")
    if size % parts:
        raise ShardingError(f"cannot split {what} of size {size} into {parts} equal shards",
                            layer=layer)
    width = size // parts
    if width % HADAMARD_BLOCK:
        below = " (a split below 128 channels)" if width < HADAMARD_BLOCK else ""
        raise ShardingError(f"cannot split {what} of size {size} into {parts} shards on "
                            f"{HADAMARD_BLOCK}-aligned boundaries: each shard would be {width} "
                            f"wide, not a multiple of {HADAMARD_BLOCK}{below}", layer=layer)
    return [(r * width, (r + 1) * width) for r in range(parts)]


def head_partition(num_heads: int, head_dim: int, tp: int, *, layer: str) -> list[Range]:
    """Column ranges of a q projection (or o's rows) split by whole heads: [(first, last)]."""
    if num_heads % tp:
        raise ShardingError(f"{num_heads} heads cannot be split evenly over tp={tp}", layer=layer)
    return even_partition(num_heads * head_dim, tp, layer=layer, what="heads x head_dim")


def kv_replicas(num_kv_heads: int, tp: int, *, layer: str) -> int:
    """How many ranks share one KV head (1 when tp <= num_kv_heads)."""
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ShardingError(f"{num_kv_heads} KV heads cannot be split evenly over tp={tp}",
                                layer=layer)
        return 1
    if tp % num_kv_heads:
        raise ShardingError(f"tp={tp} is not a multiple of the {num_kv_heads} KV heads, so they "
                            f"cannot be replicated evenly", layer=layer)
    return tp // num_kv_heads


def kv_head_partition(num_kv_heads: int, head_dim: int, tp: int, *, layer: str) -> list[Range]:
    """Column ranges of a k/v projection per rank, with KV-head replication when tp > heads.

    Rank r gets heads [r*h, (r+1)*h) with h = num_kv_heads / tp, or, when tp > num_kv_heads, the
    single head ``r // (tp / num_kv_heads)`` (vLLM's rule). Every range must start and end on a
    multiple of 128 (ShardingError otherwise).
    """
    replicas = kv_replicas(num_kv_heads, tp, layer=layer)
    per_rank = max(1, num_kv_heads // tp) * head_dim
    ranges = [((r // replicas) * per_rank, (r // replicas + 1) * per_rank) for r in range(tp)]
    for first, last in ranges:
        _check_aligned(first, last, layer=layer, what="KV-head column")
    return ranges


def expert_partition(num_experts: int, ep: int, *, layer: str) -> list[Range]:
    """Contiguous expert ranges [first, last) per rank; requires num_experts % ep == 0."""
    if ep < 1 or num_experts % ep:
        raise ShardingError(f"{num_experts} experts cannot be split into {ep} equal contiguous "
                            f"ranges", layer=layer)
    per = num_experts // ep
    return [(r * per, (r + 1) * per) for r in range(ep)]


# --------------------------------------------------------------------------------------------
# slicing one Exl3Weight (numpy or jax leaves, optional leading stack axes)

def _zero_beyond(vec, limit: int, offset: int):
    """vec [..., m] with entries whose global index offset + j >= limit set to 0 (same dtype)."""
    m = vec.shape[-1]
    if offset + m <= limit:
        return vec
    keep = (offset + np.arange(m)) < limit
    if isinstance(vec, np.ndarray):
        return np.where(keep, vec, np.zeros((), vec.dtype)).astype(vec.dtype)
    return jnp.where(keep, vec, jnp.zeros((), vec.dtype))


def slice_columns(weight: Exl3Weight, first: int, last: int, *, layer: str) -> Exl3Weight:
    """The output columns [first, last) of an EXL3 linear (column-parallel shard, spec 8).

    trellis [..., k/16, n/16, W] -> [..., k/16, (last-first)/16, W]; svh, bias [..., n] ->
    [..., last-first]; suh unchanged. The shard's out_features is its padded width; columns at or
    beyond the full weight's logical out_features get svh = bias = 0, so their outputs are exactly
    0 (the unsharded op trims them instead).
    """
    _check_aligned(first, last, layer=layer, what="column")
    if last > weight.n:
        raise ShardingError(f"column range [{first}, {last}) exceeds n={weight.n}", layer=layer)
    svh = _zero_beyond(weight.svh[..., first:last], weight.out_features, first)
    bias = (None if weight.bias is None
            else _zero_beyond(weight.bias[..., first:last], weight.out_features, first))
    return dataclasses.replace(
        weight, trellis=weight.trellis[..., first // TILE:last // TILE, :], svh=svh, bias=bias,
        out_features=last - first)


def slice_rows(weight: Exl3Weight, first: int, last: int, *, layer: str,
               keep_bias: bool) -> Exl3Weight:
    """The input rows [first, last) of an EXL3 linear (row-parallel shard, spec 8).

    trellis [..., k/16, n/16, W] -> [..., (last-first)/16, n/16, W]; suh [..., k] ->
    [..., last-first]; svh unchanged; bias kept only when ``keep_bias`` (rank 0). The shard's
    in_features is its padded width (its inputs beyond the logical in_features must be zero).
    """
    _check_aligned(first, last, layer=layer, what="row")
    if last > weight.k:
        raise ShardingError(f"row range [{first}, {last}) exceeds k={weight.k}", layer=layer)
    return dataclasses.replace(
        weight, trellis=weight.trellis[..., first // TILE:last // TILE, :, :],
        suh=weight.suh[..., first:last], bias=weight.bias if keep_bias else None,
        in_features=last - first)


def column_shards(weight: Exl3Weight, tp: int, *, layer: str,
                  ranges: Sequence[Range] | None = None) -> list[Exl3Weight]:
    """Per-rank column-parallel shards (equal 128-aligned ranges unless ``ranges`` is given)."""
    ranges = ranges or even_partition(weight.n, tp, layer=layer, what="out_features (n)")
    return [slice_columns(weight, a, b, layer=layer) for a, b in ranges]


def row_shards(weight: Exl3Weight, tp: int, *, layer: str) -> list[Exl3Weight]:
    """Per-rank row-parallel shards; the bias stays on rank 0 only."""
    ranges = even_partition(weight.k, tp, layer=layer, what="in_features (k)")
    return [slice_rows(weight, a, b, layer=layer, keep_bias=r == 0)
            for r, (a, b) in enumerate(ranges)]


def _concat(parts: Sequence, axis: int):
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=axis)
    return jnp.concatenate([jnp.asarray(p) for p in parts], axis=axis)


def column_parallel_layout(weight: Exl3Weight, tp: int, *, layer: str,
                           ranges: Sequence[Range] | None = None) -> Exl3Weight:
    """The weight with its n axis rebuilt as the concatenation of the rank shards.

    Sharding the result evenly on n gives rank r exactly ``ranges[r]`` (duplicated columns when
    KV heads are replicated). out_features stays the logical size (trim the gathered output to
    it); the padded columns are zeroed, so shards never need trimming.
    """
    shards = column_shards(weight, tp, layer=layer, ranges=ranges)
    width = shards[0].n
    if any(s.n != width for s in shards):
        raise ShardingError("column shards have different widths", layer=layer)
    bias = None if weight.bias is None else _concat([s.bias for s in shards], -1)
    return dataclasses.replace(
        weight, trellis=_concat([s.trellis for s in shards], -2),
        svh=_concat([s.svh for s in shards], -1), bias=bias,
        out_features=min(weight.out_features, width * tp))


# --------------------------------------------------------------------------------------------
# partition specs and placing weights on a mesh

def _lead(weight: Exl3Weight) -> tuple[None, ...]:
    return (None,) * len(weight.stack_shape)


def column_specs(weight: Exl3Weight, axis: str = TP_AXIS) -> Exl3Weight:
    """PartitionSpecs (as an Exl3Weight) that split n over ``axis``; suh replicated."""
    lead = _lead(weight)
    return dataclasses.replace(
        weight, trellis=P(*lead, None, axis, None), suh=P(), svh=P(*lead, axis),
        bias=None if weight.bias is None else P(*lead, axis))


def row_specs(weight: Exl3Weight, axis: str = TP_AXIS) -> Exl3Weight:
    """PartitionSpecs that split k over ``axis``; svh and bias replicated."""
    lead = _lead(weight)
    return dataclasses.replace(
        weight, trellis=P(*lead, axis, None, None), suh=P(*lead, axis), svh=P(),
        bias=None if weight.bias is None else P())


def expert_specs(weight: Exl3Weight, axis: str = TP_AXIS) -> Exl3Weight:
    """PartitionSpecs that split the expert axis (the last stack axis: down [E, ...], w13
    [2, E, ...]) of a stacked weight over ``axis``."""
    if not weight.stack_shape:
        raise ValueError("expert_specs needs a stacked weight [E, ...]")
    spec = P(*(None,) * (len(weight.stack_shape) - 1), axis)
    return dataclasses.replace(weight, trellis=spec, suh=spec, svh=spec,
                               bias=None if weight.bias is None else spec)


def put_global(x, sharding: NamedSharding):
    """Place an array that every process holds in full (same values) on ``sharding``.

    Single process: a plain device_put. Several processes (jax.distributed): each process
    builds only the shards of its own devices from its host copy (make_array_from_callback).
    """
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x) -> np.ndarray:
    """A global array's full value as numpy, in every process.

    Fully addressable arrays are copied; under jax.distributed a replicated array is read from a
    local shard, a sharded one is all-gathered across processes first.
    """
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place(mesh: Mesh, weight: Exl3Weight, specs: Exl3Weight) -> Exl3Weight:
    """Put every leaf on the mesh with its NamedSharding (each device receives its shard)."""
    return jax.tree.map(lambda x, s: None if x is None
                        else put_global(x, NamedSharding(mesh, s)), weight, specs,
                        is_leaf=lambda x: x is None)


def shard_column(mesh: Mesh, weight: Exl3Weight, *, layer: str, axis: str = TP_AXIS,
                 ranges: Sequence[Range] | None = None) -> Exl3Weight:
    """Lay a column-parallel linear out on ``mesh`` (ranges: e.g. ``kv_head_partition``)."""
    tp = mesh.shape[axis]
    laid = column_parallel_layout(weight, tp, layer=layer, ranges=ranges)
    return place(mesh, laid, column_specs(laid, axis))


def shard_row(mesh: Mesh, weight: Exl3Weight, *, layer: str, axis: str = TP_AXIS) -> Exl3Weight:
    """Lay a row-parallel linear out on ``mesh`` (checks that k splits on 128 boundaries)."""
    even_partition(weight.k, mesh.shape[axis], layer=layer, what="in_features (k)")
    return place(mesh, weight, row_specs(weight, axis))


# --------------------------------------------------------------------------------------------
# per-shard forwards (call inside a shard_map body)

def column_parallel_matmul(x, w_local: Exl3Weight, *, backend: str | None = None):
    """One rank's column block: x [..., d] (replicated) -> y_local float32 [..., n_local]."""
    local = dataclasses.replace(w_local, out_features=w_local.n)
    return trellis_matmul(x, local, backend=backend)


def row_parallel_partial(x_local, w_local: Exl3Weight, axis: str = TP_AXIS, *,
                         backend: str | None = None):
    """One rank's partial product x_local @ W[rows] (+ bias on rank 0), before the psum.

    x_local: [..., k_local], the rank's slice of the (zero-padded) input. Returns float32
    [..., out_features]; summing over ranks gives the full output exactly (in exact arithmetic).
    """
    bias = w_local.bias
    local = dataclasses.replace(w_local, bias=None, in_features=w_local.k)
    y = trellis_matmul(x_local, local, backend=backend)
    if bias is not None:
        on_rank0 = jax.lax.axis_index(axis) == 0
        y = y + jnp.where(on_rank0, bias[..., :y.shape[-1]].astype(jnp.float32), 0.0)
    return y


def row_parallel_matmul(x_local, w_local: Exl3Weight, axis: str = TP_AXIS, *,
                        backend: str | None = None):
    """Row-parallel linear with its all-reduce: float32 [..., out_features], replicated."""
    return jax.lax.psum(row_parallel_partial(x_local, w_local, axis, backend=backend), axis)


def gate_up_stack(gate: Exl3Weight, up: Exl3Weight):
    """The gate/up experts [E, ...] in the layout ``ops`` runs them in: one w13 slab [2, E, ...]
    (``ops.stack_w13``) when they share K, codebook and shapes, else the pair (gate, up) (the
    all-experts reference, as ``nn.Exl3Experts`` does)."""
    return stack_w13(gate, up) if can_stack_w13(gate, up) else (gate, up)


def _each(gate_up, fn):
    """fn applied to a w13 slab, or to both weights of a (gate, up) pair."""
    return fn(gate_up) if isinstance(gate_up, Exl3Weight) else tuple(fn(w) for w in gate_up)


def _rank_experts(gate_up, down: Exl3Weight, down_axis: str | None):
    """One rank's experts as ``ops`` takes them. With ``down_axis`` (tensor-split or rank-sliced
    experts) the gate/up column shards keep all their columns (padded ones are exactly 0), down
    takes its k rows, and its bias is added on rank 0 of the split only."""
    if down_axis is None:
        return gate_up, down
    bias = down.bias
    if bias is not None:
        on_rank0 = jax.lax.axis_index(down_axis) == 0
        bias = jnp.where(on_rank0, bias, jnp.zeros((), bias.dtype))
    return (_each(gate_up, lambda w: dataclasses.replace(w, out_features=w.n)),
            dataclasses.replace(down, in_features=down.k, bias=bias))


def local_moe(x, gate_up, down: Exl3Weight, ids, weights, *, first_expert=0,
              down_axis: str | None = None, x_scale=None, backend: str | None = None):
    """Routed MoE output of the experts held here, inside a shard_map body: the rank's view of
    ``exl3_jax.ops.moe`` (which runs the expert loop / grouped kernel).

    Args:
      x: [T, H] (replicated); ids int [T, k] global expert ids, weights [T, k] (replicated).
      gate_up: this rank's gate/up experts as ``gate_up_stack`` makes them: a w13 slab
        [2, E_l, ...] (plane 0 gate, 1 up) or a pair (gate [E_l, ...], up [E_l, ...]);
        down: [E_l, ...]. Expert parallel: whole experts ``first_expert .. first_expert +
        E_l - 1`` (first_expert may be traced, e.g. ``axis_index * E_l``). Tensor-split
        experts (``down_axis`` = the axis they are split over): the I slice of every expert,
        gate/up column shards (``shard_experts(mode="tensor")`` or rank-sliced), down row
        shards.
      x_scale: optional float32 [T, 1]: x is a scaled fp16 operand (see ``ops.moe``).
      backend: the MoE backend of ``ops.moe`` (w13 slabs; a pair always runs the reference).
    Returns:
      float32 [T, H_out]: this rank's partial sum, to be psum-ed over the expert (or tensor)
      axis. Routes to experts held elsewhere carry no weight here (their local id falls outside
      [0, E_l)).
    """
    gate_up, down = _rank_experts(gate_up, down, down_axis)
    local_ids = jnp.asarray(ids) - first_expert                                    # [T, k]
    if isinstance(gate_up, Exl3Weight):
        return moe(x, local_ids, weights, gate_up, down, x_scale=x_scale, backend=backend)
    return moe_experts(x, local_ids, weights, *gate_up, down, x_scale=x_scale)


# --------------------------------------------------------------------------------------------
# shard_map forwards on laid-out weights

def _shard_map(mesh, body, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def tp_column_linear(mesh: Mesh, x, w: Exl3Weight, *, axis: str = TP_AXIS, gather: bool = True,
                     backend: str | None = None):
    """Column-parallel linear on a ``shard_column`` weight. x [..., d] replicated.

    Returns the full output [..., out_features] (gather=True, an all-gather via out_specs) or the
    rank blocks concatenated on the last axis [..., tp * n_local] (what each rank holds). With
    replicated KV heads (``ranges`` from ``kv_head_partition``) only gather=False is meaningful.
    """
    spec_x = P()
    out = _shard_map(mesh, lambda xx, ww: column_parallel_matmul(xx, ww, backend=backend),
                     (spec_x, column_specs(w, axis)), P(*(None,) * (x.ndim - 1), axis))(x, w)
    return out if not gather else out[..., :w.out_features]


def tp_row_linear(mesh: Mesh, x, w: Exl3Weight, *, axis: str = TP_AXIS,
                  backend: str | None = None):
    """Row-parallel linear on a ``shard_row`` weight: x [..., d] (d <= k, zero-extended and
    split over ``axis``) -> [..., out_features] after the psum, replicated."""
    x = pad_input(x, w.k)
    body = lambda xx, ww: row_parallel_matmul(xx, ww, axis, backend=backend)    # noqa: E731
    return _shard_map(mesh, body, (P(*(None,) * (x.ndim - 1), axis), row_specs(w, axis)),
                      P())(x, w)


def shard_attention(mesh: Mesh, q: Exl3Weight, k: Exl3Weight, v: Exl3Weight, o: Exl3Weight, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, layer: str,
                    axis: str = TP_AXIS) -> tuple[Exl3Weight, Exl3Weight, Exl3Weight, Exl3Weight]:
    """Lay out attention projections: q column-parallel by whole heads, k/v column-parallel by
    KV heads (replicated when tp > num_kv_heads), o row-parallel by the q heads' rows.

    Rank r then holds q heads [r*h, (r+1)*h) (h = num_heads / tp) and KV heads
    ``kv_head_partition`` assigns; with tp > num_kv_heads that is the one KV head its q heads
    use (q head j uses KV head j // (num_heads / num_kv_heads)). Inside shard_map, compute
    attention on num_heads/tp q heads and max(1, num_kv_heads/tp) KV heads, then
    ``row_parallel_matmul`` for o.
    """
    tp = mesh.shape[axis]
    head_partition(num_heads, head_dim, tp, layer=f"{layer}.q_proj")
    kv_ranges = kv_head_partition(num_kv_heads, head_dim, tp, layer=f"{layer}.k_proj")
    if num_heads % num_kv_heads:
        raise ShardingError(f"{num_heads} query heads are not a multiple of the {num_kv_heads} "
                            f"KV heads", layer=layer)
    return (shard_column(mesh, q, layer=f"{layer}.q_proj", axis=axis),
            shard_column(mesh, k, layer=f"{layer}.k_proj", axis=axis, ranges=kv_ranges),
            shard_column(mesh, v, layer=f"{layer}.v_proj", axis=axis, ranges=kv_ranges),
            shard_row(mesh, o, layer=f"{layer}.o_proj", axis=axis))


def shard_mlp(mesh: Mesh, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, *, layer: str,
              axis: str = TP_AXIS) -> tuple[Exl3Weight, Exl3Weight, Exl3Weight]:
    """Lay out a gated MLP: gate/up column-parallel on I, down row-parallel on I."""
    if gate.n != up.n or down.k != gate.n:
        raise ShardingError(f"gate/up n ({gate.n}, {up.n}) and down k ({down.k}) disagree",
                            layer=layer)
    return (shard_column(mesh, gate, layer=f"{layer}.gate_proj", axis=axis),
            shard_column(mesh, up, layer=f"{layer}.up_proj", axis=axis),
            shard_row(mesh, down, layer=f"{layer}.down_proj", axis=axis))


def tp_mlp(mesh: Mesh, x, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, *,
           act: Callable = jax.nn.silu, axis: str = TP_AXIS, backend: str | None = None):
    """down(act(gate(x)) * up(x)) with weights from ``shard_mlp``: x [T, H] -> float32 [T, H_out].

    gate/up each compute the rank's I columns (padded columns are exactly 0), down consumes them
    as its rank rows, one psum at the end.
    """
    def body(xx, g, u, d):
        h = (act(column_parallel_matmul(xx, g, backend=backend))
             * column_parallel_matmul(xx, u, backend=backend))
        return row_parallel_matmul(h, d, axis, backend=backend)
    specs = (P(), column_specs(gate, axis), column_specs(up, axis), row_specs(down, axis))
    return _shard_map(mesh, body, specs, P())(x, gate, up, down)


# --------------------------------------------------------------------------------------------
# mixture of experts: expert parallel and tensor-split experts

def shard_experts(mesh: Mesh, gate_up, down: Exl3Weight, *, layer: str, mode: str = "experts",
                  axis: str = TP_AXIS):
    """Lay out one layer's experts on ``mesh``: ``gate_up`` as ``gate_up_stack`` makes it (w13
    [2, E, ...] or a (gate, up) pair of [E, ...]) and down [E, ...]; returns them laid out.

    mode "experts": contiguous expert ranges per rank (E % size == 0).
    mode "tensor": every expert split like an MLP (gate/up column on I, down row on I); the
    shard of I must be a multiple of 128 (ShardingError naming the layer otherwise).
    """
    size = mesh.shape[axis]
    num_experts = down.stack_shape[0] if len(down.stack_shape) == 1 else None
    stacks = [gate_up] if isinstance(gate_up, Exl3Weight) else list(gate_up)
    lead_ok = all(w.stack_shape[-1:] == (num_experts,) and
                  len(w.stack_shape) == (2 if isinstance(gate_up, Exl3Weight) else 1)
                  for w in stacks)
    if num_experts is None or not lead_ok or (isinstance(gate_up, Exl3Weight)
                                              and gate_up.stack_shape[0] != 2):
        raise ShardingError(f"experts must be w13 [2, E] (or gate [E], up [E]) and down [E] "
                            f"stacks, got {[w.stack_shape for w in stacks]}, "
                            f"{down.stack_shape}", layer=layer)
    if mode == "experts":
        expert_partition(num_experts, size, layer=layer)
        return (_each(gate_up, lambda w: place(mesh, w, expert_specs(w, axis))),
                place(mesh, down, expert_specs(down, axis)))
    if mode == "tensor":
        if any(w.n != down.k for w in stacks):
            raise ShardingError(f"gate/up n ({[w.n for w in stacks]}) and down k ({down.k}) "
                                f"disagree", layer=layer)
        name = "gate_up_proj" if isinstance(gate_up, Exl3Weight) else "gate_proj"
        for proj, dim in ((name, stacks[0].n), ("down_proj", down.k)):
            even_partition(dim, size, layer=f"{layer}.experts.{proj}",
                           what="expert intermediate size")
        return (_each(gate_up, lambda w: shard_column(mesh, w, layer=f"{layer}.experts.{name}",
                                                      axis=axis)),
                shard_row(mesh, down, layer=f"{layer}.experts.down_proj", axis=axis))
    raise ValueError(f"unknown MoE parallel mode {mode!r}; use 'experts' or 'tensor'")


def ep_moe(mesh: Mesh, x, gate_up, down: Exl3Weight, topk_ids, topk_weights, *,
           axis: str = TP_AXIS, partials: bool = False, backend: str | None = None):
    """Expert-parallel routed MoE on ``shard_experts(mode="experts")`` weights.

    gate_up: w13 or (gate, up), see ``shard_experts``. x [T, H], topk_ids int [T, k],
    topk_weights [T, k] (replicated). Each rank runs its contiguous expert range; routes to other
    ranks' experts get no weight there; one psum. Returns float32 [T, H_out], or with
    ``partials=True`` the per-rank outputs before the psum [size, T, H_out].
    """
    num_local = down.stack_shape[0] // mesh.shape[axis]

    def body(xx, w, d, ids, wts):
        first = jax.lax.axis_index(axis) * num_local
        y = local_moe(xx, w, d, ids, wts, first_expert=first, backend=backend)
        return y[None] if partials else jax.lax.psum(y, axis)
    specs = (P(), _each(gate_up, lambda w: expert_specs(w, axis)), expert_specs(down, axis),
             P(), P())
    return _shard_map(mesh, body, specs, P(axis) if partials else P())(
        x, gate_up, down, topk_ids, topk_weights)


def tensor_split_moe(mesh: Mesh, x, gate_up, down: Exl3Weight, topk_ids, topk_weights,
                     *, axis: str = TP_AXIS, backend: str | None = None):
    """Routed MoE with every expert tensor-split (``shard_experts(mode="tensor")``): each rank
    computes all experts on its I slice; one psum. Returns float32 [T, H_out]."""
    def body(xx, w, d, ids, wts):
        return jax.lax.psum(local_moe(xx, w, d, ids, wts, down_axis=axis, backend=backend),
                            axis)
    specs = (P(), _each(gate_up, lambda w: column_specs(w, axis)), row_specs(down, axis), P(),
             P())
    return _shard_map(mesh, body, specs, P())(x, gate_up, down, topk_ids, topk_weights)


# --------------------------------------------------------------------------------------------
# rank-stacked weights: one independently encoded slice per rank (rank-sliced checkpoints)

def rank_stacked(mesh: Mesh, slices: Mapping[int, Exl3Weight], *,
                 axis: str = TP_AXIS) -> Exl3Weight:
    """A global weight with a leading rank axis [tp, ...] sharded over ``axis``, built from the
    per-rank slices this process holds.

    ``slices`` maps rank -> that rank's Exl3Weight (same shapes and statics on every rank); it
    needs exactly the ranks of this process' devices (all ranks in a single process, only the
    local ones under jax.distributed), so each process loads only its own slices. Use for
    rank-sliced checkpoints, whose slices are not cuts of a common tensor (their suh/svh differ).
    """
    tp = mesh.shape[axis]
    first = next(iter(slices.values()))
    for r, w in slices.items():
        if not 0 <= r < tp:
            raise ValueError(f"rank {r} is outside the mesh axis {axis!r} of size {tp}")
        if jax.tree.structure(w) != jax.tree.structure(first) or any(
                a.shape != b.shape for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(first))):
            raise ValueError(f"rank {r}'s slice differs in shape or metadata from the others")

    def build(leaf_of: Callable[[Exl3Weight], object]):
        if leaf_of(first) is None:
            return None
        shape = (tp,) + tuple(leaf_of(first).shape)
        sharding = NamedSharding(mesh, P(axis))
        pieces = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            r = index[0].start or 0
            if r not in slices:
                raise ValueError(f"this process holds a device of rank {r} but no slice for it")
            pieces.append(jax.device_put(jnp.asarray(leaf_of(slices[r]))[None], device))
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    return dataclasses.replace(first, trellis=build(lambda w: w.trellis),
                               suh=build(lambda w: w.suh), svh=build(lambda w: w.svh),
                               bias=build(lambda w: w.bias))


def rank_stacked_specs(weight: Exl3Weight, axis: str = TP_AXIS) -> Exl3Weight:
    """PartitionSpecs of a ``rank_stacked`` weight (leading rank axis over ``axis``)."""
    return dataclasses.replace(weight, trellis=P(axis), suh=P(axis), svh=P(axis),
                               bias=None if weight.bias is None else P(axis))


def unstack_rank(w_block: Exl3Weight) -> Exl3Weight:
    """Inside shard_map: a rank-stacked block [1, ...] -> this rank's weight [...]."""
    return jax.tree.map(lambda a: a[0], w_block)


def rank_sliced_layer(mesh: Mesh, checkpoints: Mapping[int, object], layer: int, *,
                      axis: str = TP_AXIS):
    """Load one MoE layer of a rank-sliced checkpoint onto ``mesh``.

    checkpoints: rank -> ``exl3_jax.format.rank_sliced.RankSlicedCheckpoint`` opened for that
    rank (the ranks of this process' devices). Returns (w13, down, tier_experts): dicts K ->
    rank-stacked Exl3Weight, w13 [tp, 2, n_K, ...] (gate, up; ``ops.stack_w13`` per rank) and
    down [tp, n_K, ...], and tier_experts K -> the global expert ids of that K tier
    (ascending), as ``rank_sliced_moe`` takes them.
    """
    tp = mesh.shape[axis]
    for r, ckpt in checkpoints.items():
        if ckpt.tp != tp or ckpt.tp_rank != r:
            raise ValueError(f"checkpoint opened for tp={ckpt.tp}, rank {ckpt.tp_rank} given as "
                             f"rank {r} of a mesh axis of size {tp}")
    stacks = {r: ckpt.load_layer(layer) for r, ckpt in checkpoints.items()}
    any_stack = next(iter(stacks.values()))["gate_proj"]
    tier_experts = {K: tuple(e for e, k in enumerate(any_stack.expert_k) if k == K)
                    for K in sorted(any_stack.tiers)}
    w13 = {K: rank_stacked(mesh, {r: stack_w13(s["gate_proj"].tiers[K], s["up_proj"].tiers[K])
                                  for r, s in stacks.items()}, axis=axis)
           for K in tier_experts}
    down = {K: rank_stacked(mesh, {r: s["down_proj"].tiers[K] for r, s in stacks.items()},
                            axis=axis) for K in tier_experts}
    return w13, down, tier_experts


def rank_sliced_moe(mesh: Mesh, x, w13: Mapping[int, Exl3Weight], down: Mapping[int, Exl3Weight],
                    tier_experts: Mapping[int, Sequence[int]], topk_ids, topk_weights, *,
                    axis: str = TP_AXIS, backend: str | None = None):
    """Routed MoE on rank-sliced experts (from ``rank_sliced_layer``): rank r runs every expert
    on its own slice (gate/up: its I_r output columns, down: its I_r input rows) through
    ``ops.moe_tiered`` (one stack per K tier), one psum.

    x [T, H], topk_ids int [T, k], topk_weights [T, k] replicated. Returns float32 [T, H].
    """
    tiers = sorted(tier_experts)
    num_experts = sum(len(tier_experts[K]) for K in tiers)
    expert_tier = np.full(num_experts, -1, np.int32)        # global expert -> (tier, slot)
    expert_slot = np.zeros(num_experts, np.int32)
    for t, K in enumerate(tiers):
        expert_tier[list(tier_experts[K])] = t
        expert_slot[list(tier_experts[K])] = np.arange(len(tier_experts[K]))

    def body(xx, w, d, ids, wts):
        stacks = [_rank_experts(unstack_rank(w[K]), unstack_rank(d[K]), axis) for K in tiers]
        y = moe_tiered(xx, ids, wts, stacks, expert_tier, expert_slot, backend=backend)
        return jax.lax.psum(y, axis)

    specs = tuple({K: rank_stacked_specs(ws[K], axis) for K in tiers} for ws in (w13, down))
    return _shard_map(mesh, body, (P(), *specs, P(), P()), P())(
        x, {K: w13[K] for K in tiers}, {K: down[K] for K in tiers}, topk_ids, topk_weights)


# --------------------------------------------------------------------------------------------
# a whole model (models.decoder.CausalLM) under tensor parallelism, with its KV cache

class RowParallelLinear(nnx.Module):
    """A row-parallel EXL3 linear as a model module: this rank's input rows, then the psum.

    ``weight``: a ``shard_row`` weight with in_features = the rank's k (its arrays are global
    while the model is laid out; inside the shard_map body only the rank's block arrives).
    x [..., k_local] -> [..., out_features] in x's dtype, replicated over ``axis``. Same
    numerics policy as ``Exl3Linear`` (``nn.exl3_forward``); the bias is added after the sum.
    """

    def __init__(self, weight: Exl3Weight, axis: str):
        self.weight = nnx.data(weight)
        self.axis = axis

    def __call__(self, x):
        partial = exl3_forward(x, dataclasses.replace(self.weight, bias=None))   # [..., n] f32
        y = jax.lax.psum(partial, self.axis)
        if self.weight.bias is not None:
            y = y + self.weight.bias[..., :y.shape[-1]].astype(jnp.float32)
        return y.astype(x.dtype)


class GatheredColumnLinear(nnx.Module):
    """A column-parallel EXL3 head: each rank computes its vocabulary block, then every rank
    gets the full logits (so sampling runs on replicated values).

    ``weight``: a ``shard_column`` weight with out_features = the rank's n; ``out_features``:
    the logical width of the whole head; ``tp``: the size of ``axis``. ``forward_f32`` (what
    ``CausalLM.head`` calls): x [..., H] -> float32 [..., out_features].
    """

    def __init__(self, weight: Exl3Weight, out_features: int, axis: str, tp: int):
        self.weight = nnx.data(weight)
        self.out_features = out_features
        self.axis, self.tp = axis, tp

    def forward_f32(self, x):
        block = exl3_forward(x, self.weight)                                   # [..., n_local]
        n_local = block.shape[-1]
        # the gather as a psum of disjoint blocks (exact: the other entries are 0), because
        # shard_map can check that a psum result is replicated (an all_gather's it cannot)
        full = jnp.zeros(block.shape[:-1] + (self.tp * n_local,), jnp.float32)
        full = jax.lax.dynamic_update_slice_in_dim(
            full, block, jax.lax.axis_index(self.axis) * n_local, axis=block.ndim - 1)
        return jax.lax.psum(full, self.axis)[..., :self.out_features]          # [..., vocab]

    def __call__(self, x):
        return self.forward_f32(x).astype(x.dtype)


class ShardedExperts(nnx.Module):
    """Routed experts of one MoE layer as a model module (replaces ``nn.Exl3Experts``).

    ``gate_up``: a w13 slab or a (gate, up) pair (``gate_up_stack``). mode "experts": the rank
    holds a contiguous expert range ([E/tp, ...] stacks); "tensor": the I slice of every expert
    (gate/up column, down row shards). Calls ``local_moe`` and psums over ``axis``: x [T, H],
    ids/weights [T, k] -> float32 [T, H].
    """

    def __init__(self, gate_up, down: Exl3Weight, *, num_experts: int, mode: str, axis: str):
        self.gate_up, self.down = nnx.data(gate_up), nnx.data(down)
        self.num_experts = num_experts        # all experts of the layer (the router's width)
        self.mode, self.axis = mode, axis

    def __call__(self, x, ids, weights):
        if self.mode == "experts":
            first = jax.lax.axis_index(self.axis) * self.down.stack_shape[0]
            down_axis = None
        else:
            first, down_axis = 0, self.axis
        # as nn.Exl3Experts: x in its own dtype (the kernels, or ops.trellis_matmul for the
        # reference backend, own the fp16 boundary; nn.numerics)
        y = local_moe(x, self.gate_up, self.down, ids, weights, first_expert=first,
                      down_axis=down_axis)
        return jax.lax.psum(y, self.axis)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedModel:
    """A ``CausalLM`` laid out on a mesh (from ``shard_model``), called like the model.

    ``self(state, tokens, cache, token_valid, last_only=...)`` runs the per-rank model graph in
    one ``jax.shard_map`` and returns (logits float32 [B, T or 1, vocab] replicated, cache);
    the KV cache keeps each rank's KV heads ([B, S, tp * kv_local, D] globally, split over
    ``axis``; replicated KV heads appear once per rank). ``init_cache``, ``put`` and ``host``
    complete the model-runner interface of ``exl3_jax.generate`` (``Generator(model,
    mesh=...)``). Hashed by identity (a static argument of the jitted generate functions).
    """
    graphdef: nnx.GraphDef          # the per-rank model: local head counts, rank-local linears
    specs: object                   # PartitionSpec of every state leaf
    mesh: Mesh
    axis: str
    cache_shape: tuple[int, int, int]   # (layers, KV heads over all ranks, head_dim)
    dtype: str                      # activation (and KV cache) dtype

    def cache_specs(self) -> KVCache:
        kv = P(None, None, self.axis, None)
        layers = self.cache_shape[0]
        return KVCache(k=(kv,) * layers, v=(kv,) * layers, valid=P(), pos=P(), slot=P())

    def init_cache(self, state, batch: int, size: int) -> KVCache:
        """An empty sharded cache (inside jit). ``state`` is unused (interface of generate)."""
        del state
        layers, heads, head_dim = self.cache_shape
        cache = init_cache(layers, batch, size, heads, head_dim, self.dtype)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.cache_specs())
        return jax.lax.with_sharding_constraint(cache, shardings)

    def __call__(self, state, tokens, cache: KVCache, token_valid=None, *,
                 last_only: bool = False):
        """tokens int32 [B, T], token_valid bool [B, T] (replicated) -> (logits, cache)."""
        if token_valid is None:
            token_valid = jnp.ones(tokens.shape, bool)

        def body(local_state, tok, local_cache, valid):
            model = nnx.merge(self.graphdef, local_state)
            return model(tok, local_cache, valid, last_only=last_only)

        cache_specs = self.cache_specs()
        return _shard_map(self.mesh, body, (self.specs, P(), cache_specs, P()),
                          (P(), cache_specs))(state, tokens, cache, token_valid)

    def put(self, x):
        """A host array every process holds -> replicated on the mesh."""
        return put_global(np.asarray(x), NamedSharding(self.mesh, P()))

    def host(self, x) -> np.ndarray:
        return to_host(x)


def _exl3_weight(module, name: str) -> Exl3Weight:
    if not isinstance(module, Exl3Linear):
        raise NotImplementedError(f"{name}: the tensor-parallel model needs EXL3 linears, got "
                                  f"{type(module).__name__}")
    return module.weight


def _column_local(weight: Exl3Weight, tp: int) -> Exl3Weight:
    """Statics of one rank's block of a laid-out column-parallel weight (all n_local columns;
    padded ones are exactly 0)."""
    return dataclasses.replace(weight, out_features=weight.n // tp)


def _row_local(weight: Exl3Weight, tp: int) -> Exl3Weight:
    """Statics of one rank's block of a row-parallel weight (its k_local input rows)."""
    return dataclasses.replace(weight, in_features=weight.k // tp)


def _shard_gated_mlp(mesh: Mesh, mlp, name: str, axis: str) -> None:
    """In place: gate/up -> rank-local column blocks, down -> RowParallelLinear."""
    tp = mesh.shape[axis]
    g, u, d = shard_mlp(mesh, *(_exl3_weight(getattr(mlp, f"{p}_proj"), f"{name}.{p}_proj")
                                for p in ("gate", "up", "down")), layer=name, axis=axis)
    mlp.gate_proj, mlp.up_proj = Exl3Linear(_column_local(g, tp)), Exl3Linear(_column_local(u, tp))
    mlp.down_proj = RowParallelLinear(_row_local(d, tp), axis)


def _on_mesh(x, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def shard_model(model, mesh: Mesh, *, moe_mode: str = "experts",
                axis: str = TP_AXIS) -> tuple[ShardedModel, nnx.State]:
    """Lay a ``models.decoder.CausalLM`` out on ``mesh`` for tensor/expert parallel inference.

    Per layer: q column-parallel by whole heads, k/v by KV heads (replicated when tp >
    num_kv_heads), o row-parallel + psum; a dense MLP (and shared experts) gate/up column, down
    row + psum; routed experts expert-parallel (``moe_mode="experts"``, contiguous ranges) or
    tensor-split (``"tensor"``) + psum, the router replicated; embeddings, norms and a tied or
    plain head replicated; an EXL3 lm_head column-parallel + all-gather. The per-rank graph is
    the model's own (``CausalLM.__call__``, attention with the KV cache, routing), with
    rank-local head counts and linears, so single-device and parallel runs share one code path.

    Every linear must be an EXL3 linear (dequantized caches are ignored). Raises
    ``ShardingError`` (naming the layer) when a weight cannot be split over ``mesh``, or
    ``NotImplementedError`` for a plain linear / plain experts / mixed-K (tiered) experts.

    Returns ``(sharded, state)``: ``sharded(state, tokens, cache, valid)`` as ``ShardedModel``
    describes, ``state`` the weights placed on the mesh (done once, here). Generation:
    ``exl3_jax.generate.Generator(model, mesh=mesh)``.
    """
    if moe_mode not in ("experts", "tensor"):
        raise ValueError(f"unknown MoE parallel mode {moe_mode!r}; use 'experts' or 'tensor'")
    for i, layer in enumerate(model.layers):     # before any weight is placed
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, TieredExl3Experts):
            raise NotImplementedError(
                f"model.layers.{i}.mlp: mixed-K experts ({len(experts.tiers)} (K, codebook) "
                f"tiers) are not yet supported under a mesh; run this model on one device")
    tp = mesh.shape[axis]
    local = nnx.clone(model)                 # same arrays; its linears are replaced below
    for i, layer in enumerate(local.layers):
        name = f"model.layers.{i}"
        att = layer.self_attn
        q, k, v, o = shard_attention(
            mesh, *(_exl3_weight(getattr(att, f"{p}_proj"), f"{name}.self_attn.{p}_proj")
                    for p in "qkvo"),
            num_heads=att.num_heads, num_kv_heads=att.num_kv_heads, head_dim=att.head_dim,
            layer=f"{name}.self_attn", axis=axis)
        att.q_proj, att.k_proj, att.v_proj = (Exl3Linear(_column_local(w, tp)) for w in (q, k, v))
        att.o_proj = RowParallelLinear(_row_local(o, tp), axis)
        att.num_heads, att.num_kv_heads = att.num_heads // tp, max(1, att.num_kv_heads // tp)
        mlp = layer.mlp
        if isinstance(mlp, MoEBlock):
            if not isinstance(mlp.experts, Exl3Experts):
                raise NotImplementedError(f"{name}.mlp: tensor parallelism needs EXL3 experts")
            ex = mlp.experts
            # The experts' own layout (gate_up_stack's): their w13 slab as it is, no re-stack.
            gate_up = ex.w13 if ex.w13 is not None else (ex.gate, ex.up)
            gate_up, down = shard_experts(mesh, gate_up, ex.down, layer=f"{name}.mlp",
                                          mode=moe_mode, axis=axis)
            if moe_mode == "tensor":
                gate_up = _each(gate_up, lambda w: _column_local(w, tp))
                down = _row_local(down, tp)
            mlp.experts = ShardedExperts(gate_up, down, num_experts=ex.num_experts,
                                         mode=moe_mode, axis=axis)
            if mlp.shared is not None:
                _shard_gated_mlp(mesh, mlp.shared, f"{name}.mlp.shared_experts", axis)
        else:
            _shard_gated_mlp(mesh, mlp, f"{name}.mlp", axis)
    if isinstance(local.lm_head, Exl3Linear):
        head = shard_column(mesh, local.lm_head.weight, layer="lm_head", axis=axis)
        local.lm_head = GatheredColumnLinear(_column_local(head, tp),
                                             local.lm_head.out_features, axis, tp)
    graphdef, state = nnx.split(local)
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: a if _on_mesh(a, mesh) else put_global(a, replicated), state)
    specs = jax.tree.map(lambda a: a.sharding.spec, state)
    c = model.config
    kv_local = max(1, c.num_kv_heads // tp)
    sharded = ShardedModel(graphdef, specs, mesh, axis,
                           cache_shape=(c.num_layers, tp * kv_local, c.head_dim),
                           dtype=model.dtype)
    return sharded, state


__all__ = [
    "GatheredColumnLinear", "Range", "RowParallelLinear", "ShardedExperts", "ShardedModel",
    "ShardingError", "TP_AXIS", "column_parallel_layout", "column_parallel_matmul",
    "column_shards", "column_specs", "even_partition", "expert_partition", "expert_specs",
    "ep_moe", "gate_up_stack", "head_partition", "kv_head_partition", "kv_replicas", "local_moe",
    "make_mesh", "place", "put_global", "rank_sliced_layer", "rank_sliced_moe",
    "rank_stacked", "rank_stacked_specs", "row_parallel_matmul", "row_parallel_partial",
    "row_shards", "row_specs", "shard_attention", "shard_column", "shard_experts", "shard_mlp",
    "shard_model", "shard_row", "slice_columns", "slice_rows", "tensor_split_moe", "to_host",
    "tp_column_linear", "tp_mlp", "tp_row_linear", "unstack_rank",
]
