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
body of your own, use ``column_parallel_matmul`` / ``row_parallel_matmul`` / ``local_moe``.

Rank-sliced checkpoints (spec 7) carry one independently encoded slice per rank, which is not a
cut of a common tensor; ``rank_stacked`` puts such slices on the mesh with a leading rank axis
(each process supplies only the ranks of its own devices, so under jax.distributed every process
reads only its own slices), and ``rank_sliced_layer`` / ``rank_sliced_moe`` load and run a layer.

Meshes use ``AxisType.Auto`` axes (jax 0.10.2 defaults to Explicit, under which shard_map rejects
unsharded inputs; shared/spec/jax_gpu_paths.md 7.4), so the same code runs on 0.10.2 and 0.11.2.

Example (a gated MLP at tp=4; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=4
before importing jax)::

    mesh = make_mesh(4)
    g, u, d = shard_mlp(mesh, gate, up, down, layer="model.layers.0.mlp")   # once, at load
    y = jax.jit(lambda x, g, u, d: tp_mlp(mesh, x, g, u, d))(x, g, u, d)   # [T, H] float32

A decoder layer of your own: lay out with ``shard_attention`` / ``shard_mlp`` and write one
``jax.shard_map`` body with in_specs ``column_specs`` / ``row_specs`` of those weights, calling
``column_parallel_matmul`` for q/k/v/gate/up and ``row_parallel_matmul`` for o/down.
A whole ``models.decoder.CausalLM`` does exactly that in ``make_tp_forward`` / ``tp_logits``::

    logits = tp_logits(model, make_mesh(4), tokens, moe_mode="experts")   # [B, T, vocab] fp32
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .format.spec import HADAMARD_BLOCK, TILE
from .ops import combine_matrix, pad_input, trellis_matmul
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
    """PartitionSpecs that split the leading expert axis of a stacked weight over ``axis``."""
    if not weight.stack_shape:
        raise ValueError("expert_specs needs a stacked weight [E, ...]")
    return dataclasses.replace(weight, trellis=P(axis), suh=P(axis), svh=P(axis),
                               bias=None if weight.bias is None else P(axis))


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


def _stacked_matmul(x, w_stack: Exl3Weight, backend, *, column_shards: bool):
    """x [T, d] through every linear of a stack [E, ...] -> [E, T, n_out].

    Whole experts are trimmed to their logical out_features (n_out = out_features); column
    shards laid out by ``column_parallel_layout`` keep their full width (n_out = n_local, the
    padded columns are exactly 0).
    """
    if column_shards:
        return jax.vmap(lambda w: column_parallel_matmul(x, w, backend=backend))(w_stack)
    return jax.vmap(lambda w: trellis_matmul(x, w, backend=backend))(w_stack)


def local_moe(x, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, combine, *,
              act: Callable = jax.nn.silu, down_axis: str | None = None,
              backend: str | None = None):
    """Routed MoE output of the experts held here: sum_e combine[:, e] * down_e(act(g_e) * u_e).

    x [T, H]; gate/up stacked [E_l, ...] (possibly column shards of every expert), down stacked
    [E_l, ...]; for tensor-split experts (gate/up column shards from ``shard_experts(mode=
    "tensor")``, down row shards) pass ``down_axis``, the axis they are split over;
    combine float32 [T, E_l] (zero = not routed here). Returns float32 [T, H_out], the partial sum
    to be psum-ed over the expert (or tensor) axis. Unrouted pairs contribute exactly 0, even when
    an expert output is not finite.
    """
    split = down_axis is not None
    h = (act(_stacked_matmul(x, gate, backend, column_shards=split))
         * _stacked_matmul(x, up, backend, column_shards=split))                    # [E, T, I_l]
    if down_axis is None:
        y = jax.vmap(lambda hi, w: trellis_matmul(hi, w, backend=backend))(h, down)
    else:
        y = jax.vmap(lambda hi, w: row_parallel_partial(hi, w, down_axis, backend=backend))(
            h, down)                                                               # [E, T, H]
    c = jnp.moveaxis(combine, -1, 0)[..., None]                                    # [E, T, 1]
    return jnp.sum(jnp.where(c != 0, c * y, 0.0), axis=0)


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

def shard_experts(mesh: Mesh, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, *,
                  layer: str, mode: str = "experts", axis: str = TP_AXIS
                  ) -> tuple[Exl3Weight, Exl3Weight, Exl3Weight]:
    """Lay out stacked experts [E, ...] on ``mesh``.

    mode "experts": contiguous expert ranges per rank (E % size == 0).
    mode "tensor": every expert split like an MLP (gate/up column on I, down row on I); the
    shard of I must be a multiple of 128 (ShardingError naming the layer otherwise).
    """
    size = mesh.shape[axis]
    if len(gate.stack_shape) != 1 or len({gate.stack_shape, up.stack_shape,
                                          down.stack_shape}) != 1:
        raise ShardingError(f"experts must be stacked on one leading axis, got "
                            f"{gate.stack_shape}, {up.stack_shape}, {down.stack_shape}",
                            layer=layer)
    if mode == "experts":
        expert_partition(gate.stack_shape[0], size, layer=layer)
        return tuple(place(mesh, w, expert_specs(w, axis)) for w in (gate, up, down))
    if mode == "tensor":
        names = ("gate_proj", "up_proj", "down_proj")
        for name, w, dim in zip(names, (gate, up, down), (gate.n, up.n, down.k)):
            even_partition(dim, size, layer=f"{layer}.experts.{name}",
                           what="expert intermediate size")
        return shard_mlp(mesh, gate, up, down, layer=f"{layer}.experts", axis=axis)
    raise ValueError(f"unknown MoE parallel mode {mode!r}; use 'experts' or 'tensor'")


def ep_moe(mesh: Mesh, x, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight, topk_ids,
           topk_weights, *, act: Callable = jax.nn.silu, axis: str = TP_AXIS,
           partials: bool = False, backend: str | None = None):
    """Expert-parallel routed MoE on ``shard_experts(mode="experts")`` weights.

    x [T, H], topk_ids int [T, k], topk_weights [T, k] (replicated). Each rank runs its contiguous
    expert range; routes to other ranks' experts contribute exactly 0; one psum. Returns float32
    [T, H_out], or with ``partials=True`` the per-rank outputs before the psum [size, T, H_out].
    """
    num_local = gate.stack_shape[0] // mesh.shape[axis]

    def body(xx, g, u, d, ids, wts):
        first = jax.lax.axis_index(axis) * num_local
        y = local_moe(xx, g, u, d, combine_matrix(ids, wts, num_local, first), act=act,
                      backend=backend)
        return y[None] if partials else jax.lax.psum(y, axis)
    specs = (P(), expert_specs(gate, axis), expert_specs(up, axis), expert_specs(down, axis),
             P(), P())
    return _shard_map(mesh, body, specs, P(axis) if partials else P())(
        x, gate, up, down, topk_ids, topk_weights)


def tensor_split_moe(mesh: Mesh, x, gate: Exl3Weight, up: Exl3Weight, down: Exl3Weight,
                     topk_ids, topk_weights, *, act: Callable = jax.nn.silu,
                     axis: str = TP_AXIS, backend: str | None = None):
    """Routed MoE with every expert tensor-split (``shard_experts(mode="tensor")``): each rank
    computes all experts on its I slice; one psum. Returns float32 [T, H_out]."""
    num_experts = gate.stack_shape[0]

    def body(xx, g, u, d, ids, wts):
        combine = combine_matrix(ids, wts, num_experts)
        return jax.lax.psum(local_moe(xx, g, u, d, combine, act=act, down_axis=axis,
                                      backend=backend), axis)
    specs = (P(), column_specs(gate, axis), column_specs(up, axis), row_specs(down, axis),
             P(), P())
    return _shard_map(mesh, body, specs, P())(x, gate, up, down, topk_ids, topk_weights)


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
    return expert_specs(weight, axis)


def unstack_rank(w_block: Exl3Weight) -> Exl3Weight:
    """Inside shard_map: a rank-stacked block [1, ...] -> this rank's weight [...]."""
    return jax.tree.map(lambda a: a[0], w_block)


def rank_sliced_layer(mesh: Mesh, checkpoints: Mapping[int, object], layer: int, *,
                      axis: str = TP_AXIS):
    """Load one MoE layer of a rank-sliced checkpoint onto ``mesh``.

    checkpoints: rank -> ``exl3_jax.format.rank_sliced.RankSlicedCheckpoint`` opened for that
    rank (the ranks of this process' devices). Returns (gate, up, down, tier_experts): for each
    projection a dict K -> rank-stacked Exl3Weight [tp, n_K, ...], and tier_experts K -> the
    global expert ids of that K tier (ascending), as ``rank_sliced_moe`` takes them.
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
    out = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out.append({K: rank_stacked(mesh, {r: s[proj].tiers[K] for r, s in stacks.items()},
                                    axis=axis) for K in tier_experts})
    return (*out, tier_experts)


def rank_sliced_moe(mesh: Mesh, x, gate: Mapping[int, Exl3Weight],
                    up: Mapping[int, Exl3Weight], down: Mapping[int, Exl3Weight],
                    tier_experts: Mapping[int, Sequence[int]], topk_ids, topk_weights, *,
                    act: Callable = jax.nn.silu, axis: str = TP_AXIS,
                    backend: str | None = None):
    """Routed MoE on rank-sliced experts (from ``rank_sliced_layer``): rank r runs every expert
    on its own slice (gate/up: its I_r output columns, down: its I_r input rows), one psum.

    x [T, H], topk_ids int [T, k], topk_weights [T, k] replicated. Returns float32 [T, H].
    """
    num_experts = sum(len(v) for v in tier_experts.values())
    tiers = sorted(tier_experts)

    def body(xx, g, u, d, ids, wts):
        combine = combine_matrix(ids, wts, num_experts)               # [T, E]
        y = 0.0
        for K in tiers:
            sel = np.asarray(tier_experts[K])
            y = y + local_moe(xx, unstack_rank(g[K]), unstack_rank(u[K]), unstack_rank(d[K]),
                              combine[:, sel], act=act, down_axis=axis, backend=backend)
        return jax.lax.psum(y, axis)

    specs = tuple({K: rank_stacked_specs(w[K], axis) for K in tiers} for w in (gate, up, down))
    return _shard_map(mesh, body, (P(), *specs, P(), P()), P())(
        x, {K: gate[K] for K in tiers}, {K: up[K] for K in tiers}, {K: down[K] for K in tiers},
        topk_ids, topk_weights)


# --------------------------------------------------------------------------------------------
# a whole model (models.decoder.CausalLM) under tensor parallelism

def _exl3_weight(module, name: str) -> Exl3Weight:
    from .nn import Exl3Linear
    if not isinstance(module, Exl3Linear):
        raise NotImplementedError(f"{name}: the tensor-parallel model forward needs EXL3 "
                                  f"linears, got {type(module).__name__}")
    return module.weight


def make_tp_forward(model, mesh: Mesh, *, moe_mode: str = "experts", axis: str = TP_AXIS,
                    backend: str | None = None):
    """Lay a ``models.decoder.CausalLM`` out on ``mesh`` and build its tensor-parallel forward.

    Per layer: attention by heads (q column-parallel by whole heads, k/v by KV heads, replicated
    when tp > num_kv_heads, o row-parallel + psum), a dense MLP gate/up column / down row + psum,
    MoE experts expert-parallel (``moe_mode="experts"``) or tensor-split (``"tensor"``) with a
    replicated router and shared experts split like an MLP; embeddings and norms replicated;
    the EXL3 lm_head column-parallel (a tied / plain head runs replicated). The decoder stack is
    one ``jax.shard_map``; the head a column-parallel shard_map after it.

    Full sequences without a cache (causal mask, positions 0..T-1), fp32 activations whatever
    ``model.dtype`` is. Every linear must be an EXL3 linear (not ``cache_dequantized``). Raises
    ``ShardingError`` (naming the layer) when a weight cannot be split over ``mesh``.

    Returns ``(forward, params)``: ``forward(params, tokens int [B, T])`` is jitted and returns
    float32 logits [B, T, vocab]; ``params`` is the pytree of weights placed on the mesh (done
    once here).
    """
    from .nn import Exl3Experts, Exl3Linear, MoEBlock, apply_rope, gqa_attention
    from .nn.moe import route_sigmoid_topk, route_softmax_topk
    from .nn.norm import rms_norm

    if moe_mode not in ("experts", "tensor"):
        raise ValueError(f"unknown MoE parallel mode {moe_mode!r}; use 'experts' or 'tensor'")
    c = model.config
    tp = mesh.shape[axis]
    rep = lambda a: put_global(jnp.asarray(a), NamedSharding(mesh, P()))   # noqa: E731
    params: dict = {"embed": rep(model.embed_tokens.table[...]),
                    "norm": rep(model.norm.weight[...]), "layers": []}
    specs: dict = {"embed": P(), "norm": P(), "layers": []}
    statics = []
    for i, layer in enumerate(model.layers):
        name = f"model.layers.{i}"
        att = layer.self_attn
        q, k, v, o = (_exl3_weight(getattr(att, f"{p}_proj"), f"{name}.self_attn.{p}_proj")
                      for p in "qkvo")
        q, k, v, o = shard_attention(mesh, q, k, v, o, num_heads=att.num_heads,
                                     num_kv_heads=att.num_kv_heads, head_dim=att.head_dim,
                                     layer=f"{name}.self_attn", axis=axis)
        lp = {"ln1": rep(layer.input_layernorm.weight[...]),
              "ln2": rep(layer.post_attention_layernorm.weight[...]),
              "q": q, "k": k, "v": v, "o": o}
        ls = {"ln1": P(), "ln2": P(), "q": column_specs(q, axis), "k": column_specs(k, axis),
              "v": column_specs(v, axis), "o": row_specs(o, axis)}
        st = dict(heads=att.num_heads // tp, kv_heads=max(1, att.num_kv_heads // tp),
                  head_dim=att.head_dim, rope=att.rope,
                  eps1=layer.input_layernorm.eps, eps2=layer.post_attention_layernorm.eps,
                  qk_norm=att.q_norm is not None)
        if att.q_norm is not None:
            lp["qn"], lp["kn"] = rep(att.q_norm.weight[...]), rep(att.k_norm.weight[...])
            ls["qn"], ls["kn"] = P(), P()
            st["qn_eps"], st["kn_eps"] = att.q_norm.eps, att.k_norm.eps
        mlp = layer.mlp
        if isinstance(mlp, MoEBlock):
            if not isinstance(mlp.experts, Exl3Experts):
                raise NotImplementedError(f"{name}.mlp: tensor parallelism needs EXL3 experts")
            ex = mlp.experts
            g, u, d = shard_experts(mesh, ex.gate, ex.up, ex.down, layer=f"{name}.mlp",
                                    mode=moe_mode, axis=axis)
            router = mlp.router
            lp["router_w"] = rep(router.w[...])
            ls["router_w"] = P()
            if router.b is not None:
                lp["router_b"], ls["router_b"] = rep(router.b[...]), P()
            if mlp.score_bias is not None:
                lp["score_bias"], ls["score_bias"] = rep(mlp.score_bias[...]), P()
            lp.update(eg=g, eu=u, ed=d)
            if moe_mode == "experts":
                ls.update(eg=expert_specs(g, axis), eu=expert_specs(u, axis),
                          ed=expert_specs(d, axis))
            else:
                ls.update(eg=column_specs(g, axis), eu=column_specs(u, axis),
                          ed=row_specs(d, axis))
            st.update(kind="moe", top_k=mlp.top_k, router_kind=mlp.router_kind,
                      renormalize=mlp.renormalize, scaling=mlp.routed_scaling_factor,
                      num_experts=ex.num_experts,
                      num_local=ex.num_experts // tp if moe_mode == "experts" else ex.num_experts,
                      shared=mlp.shared is not None)
            if mlp.shared is not None:
                sh = mlp.shared
                sg, su, sd = shard_mlp(
                    mesh, *(_exl3_weight(getattr(sh, f"{p}_proj"),
                                         f"{name}.mlp.shared_experts.{p}_proj")
                            for p in ("gate", "up", "down")),
                    layer=f"{name}.mlp.shared_experts", axis=axis)
                lp.update(sg=sg, su=su, sd=sd)
                ls.update(sg=column_specs(sg, axis), su=column_specs(su, axis),
                          sd=row_specs(sd, axis))
        else:
            g, u, d = shard_mlp(mesh, *(_exl3_weight(getattr(mlp, f"{p}_proj"),
                                                     f"{name}.mlp.{p}_proj")
                                        for p in ("gate", "up", "down")),
                                layer=f"{name}.mlp", axis=axis)
            lp.update(g=g, u=u, d=d)
            ls.update(g=column_specs(g, axis), u=column_specs(u, axis), d=row_specs(d, axis))
            st["kind"] = "mlp"
        params["layers"].append(lp)
        specs["layers"].append(ls)
        statics.append(st)

    head = model.lm_head
    if head is None:
        head_kind = "tied"
    elif isinstance(head, Exl3Linear):
        head_kind = "exl3"
        params["head"] = shard_column(mesh, head.weight, layer="lm_head", axis=axis)
    else:
        head_kind = "plain"
        params["head"] = {"w": rep(head.w[...])}
        if head.b is not None:
            params["head"]["b"] = rep(head.b[...])
    final_eps = model.norm.eps
    hi = jax.lax.Precision.HIGHEST

    def mm_col(x, w):
        return column_parallel_matmul(x, w, backend=backend)

    def decoder(p, tokens):                              # per rank; tokens [B, T] replicated
        B, T = tokens.shape
        x = jnp.take(p["embed"], tokens, axis=0).astype(jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        for lp, st in zip(p["layers"], statics):
            D = st["head_dim"]
            h = rms_norm(x, lp["ln1"], st["eps1"])
            q = mm_col(h, lp["q"]).reshape(B, T, st["heads"], D)
            k = mm_col(h, lp["k"]).reshape(B, T, st["kv_heads"], D)
            v = mm_col(h, lp["v"]).reshape(B, T, st["kv_heads"], D)
            if st["qk_norm"]:
                q = rms_norm(q, lp["qn"], st["qn_eps"])
                k = rms_norm(k, lp["kn"], st["kn_eps"])
            q, k = apply_rope(q, positions, st["rope"]), apply_rope(k, positions, st["rope"])
            a = gqa_attention(q, k, v, mask, D ** -0.5).reshape(B, T, st["heads"] * D)
            x = x + row_parallel_matmul(a, lp["o"], axis, backend=backend)
            h = rms_norm(x, lp["ln2"], st["eps2"])
            if st["kind"] == "mlp":
                y = row_parallel_matmul(jax.nn.silu(mm_col(h, lp["g"])) * mm_col(h, lp["u"]),
                                        lp["d"], axis, backend=backend)
            else:
                ht = h.reshape(B * T, -1)
                logits = jnp.einsum("th,he->te", ht, lp["router_w"].astype(jnp.float32),
                                    precision=hi)
                if "router_b" in lp:
                    logits = logits + lp["router_b"].astype(jnp.float32)
                if st["router_kind"] == "softmax":
                    ids, wts = route_softmax_topk(logits, st["top_k"], st["renormalize"])
                else:
                    ids, wts = route_sigmoid_topk(logits, lp.get("score_bias"), st["top_k"],
                                                  st["renormalize"], st["scaling"])
                if moe_mode == "experts":
                    first = jax.lax.axis_index(axis) * st["num_local"]
                    y = local_moe(ht, lp["eg"], lp["eu"], lp["ed"],
                                  combine_matrix(ids, wts, st["num_local"], first),
                                  backend=backend)
                else:
                    y = local_moe(ht, lp["eg"], lp["eu"], lp["ed"],
                                  combine_matrix(ids, wts, st["num_experts"]),
                                  down_axis=axis, backend=backend)
                if st["shared"]:
                    y = y + row_parallel_partial(
                        jax.nn.silu(mm_col(ht, lp["sg"])) * mm_col(ht, lp["su"]), lp["sd"],
                        axis, backend=backend)
                y = jax.lax.psum(y, axis).reshape(B, T, -1)
            x = x + y
        return rms_norm(x, p["norm"], final_eps)

    def forward(p, tokens):
        body_params = {key: p[key] for key in ("embed", "norm", "layers")}
        x = _shard_map(mesh, decoder, (specs, P()), P())(body_params, tokens)
        if head_kind == "exl3":
            return tp_column_linear(mesh, x, p["head"], axis=axis, backend=backend)
        if head_kind == "tied":
            return jnp.einsum("...h,vh->...v", x, p["embed"].astype(jnp.float32), precision=hi)
        y = jnp.einsum("...i,io->...o", x, p["head"]["w"].astype(jnp.float32), precision=hi)
        return y + p["head"]["b"].astype(jnp.float32) if "b" in p["head"] else y

    return jax.jit(forward), params


def tp_logits(model, mesh: Mesh, tokens, *, moe_mode: str = "experts", axis: str = TP_AXIS,
              backend: str | None = None):
    """Tensor-parallel full-sequence logits of a ``CausalLM``: float32 [B, T, vocab].

    Lays the weights out and compiles on every call; to run several batches, call
    ``make_tp_forward`` once and reuse its ``(forward, params)``. See ``make_tp_forward``.
    """
    forward, params = make_tp_forward(model, mesh, moe_mode=moe_mode, axis=axis,
                                      backend=backend)
    return forward(params, jnp.asarray(tokens, jnp.int32))


__all__ = [
    "Range", "ShardingError", "TP_AXIS", "column_parallel_layout", "column_parallel_matmul",
    "column_shards", "column_specs", "even_partition", "expert_partition", "expert_specs",
    "ep_moe", "head_partition", "kv_head_partition", "kv_replicas", "local_moe",
    "make_mesh", "make_tp_forward", "place", "put_global",
    "rank_sliced_layer",
    "rank_sliced_moe", "rank_stacked", "rank_stacked_specs", "row_parallel_matmul",
    "row_parallel_partial", "row_shards", "row_specs", "shard_attention", "shard_column",
    "shard_experts",
    "shard_mlp", "shard_row", "slice_columns", "slice_rows", "tensor_split_moe", "to_host",
    "tp_column_linear", "tp_logits", "tp_mlp", "tp_row_linear", "unstack_rank",
]
