"""Tensor and expert parallelism (exl3_jax.parallel) on simulated CPU devices.

The shard_map tests need 8 devices. XLA_FLAGS=--xla_force_host_platform_device_count=8 only
works when set before jax initialises its backend, and setting it here would change the device
count for every other test file in the same pytest process. So when this process has fewer
devices, every test of this module delegates to ONE child pytest process (started on first use,
with the flag and JAX_PLATFORMS=cpu) and reports that child's verdict for itself; with enough
devices (e.g. the child, or a run with the flag already set) the tests run in place. Tests that
need no devices (pure partition rules) take no ``request`` and always run in place.

References are independent of the code under test: float64 NumPy on the original-basis weights
from ``exl3_jax.trellis.dequantize``, and the unsharded ``trellis_matmul``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from exl3_jax import parallel as par
from exl3_jax.ops import combine_matrix, stack_w13, trellis_matmul
from helpers_devices import ChildDevices
from exl3_jax.trellis import Exl3Weight, dequantize

DEVICES = 8
CHILD_ENV = "EXL3_JAX_PARALLEL_CHILD"
REL_L2 = 1e-5          # fp32 sharded vs unsharded (issue 7)

# -------------------------------------------------------------------------------------------
# delegation to a child process with simulated devices

_child = ChildDevices(__file__, CHILD_ENV, DEVICES)
delegated = _child.delegated


# -------------------------------------------------------------------------------------------
# helpers

def random_weight(rng, k, n, *, K=3, codebook="mcg", bias=False, lead=(), in_features=None,
                  out_features=None) -> Exl3Weight:
    """A random EXL3 linear (random int16 trellis is a valid encoding), jax leaves."""
    trellis = rng.integers(-32768, 32768, lead + (k // 16, n // 16, 16 * K), dtype=np.int16)
    suh = (rng.standard_normal(lead + (k,)) * 0.1).astype(np.float16)
    svh = (rng.standard_normal(lead + (n,)) * 0.1).astype(np.float16)
    b = rng.standard_normal(lead + (n,)).astype(np.float16) if bias else None
    return Exl3Weight.create(jnp.asarray(trellis), jnp.asarray(suh), jnp.asarray(svh), codebook,
                             None if b is None else jnp.asarray(b), in_features=in_features,
                             out_features=out_features)


_dequantize = jax.jit(dequantize, static_argnums=3)


def dense(w: Exl3Weight) -> np.ndarray:
    """Original-basis float64 weight [..., in_features, out_features] (logical sizes)."""
    full = np.asarray(_dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64)
    return full[..., :w.in_features, :w.out_features]


def dense_bias(w: Exl3Weight):
    return 0.0 if w.bias is None else np.asarray(w.bias, np.float64)[..., :w.out_features]


def silu(a):
    return a / (1.0 + np.exp(-a))


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def mlp_reference(x, gate, up, down):
    x = np.asarray(x, np.float64)
    h = silu(x @ dense(gate) + dense_bias(gate)) * (x @ dense(up) + dense_bias(up))
    return h @ dense(down) + dense_bias(down)


def moe_reference(x, gate, up, down, ids, weights):
    """Per token, per route: float64 loop over the dequantized experts (spec 5.2)."""
    x = np.asarray(x, np.float64)
    Wg, Wu, Wd = dense(gate), dense(up), dense(down)
    out = np.zeros((x.shape[0], Wd.shape[-1]))
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(ids[t]), np.asarray(weights[t], np.float64)):
            h = silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])
            out[t] += w * (h @ Wd[e])
    return out


def random_routes(rng, tokens, num_experts, topk):
    ids = np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(tokens)])
    logits = rng.standard_normal((tokens, topk))
    w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return jnp.asarray(ids.astype(np.int32)), jnp.asarray(w.astype(np.float32))


def fp32_input(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


# -------------------------------------------------------------------------------------------
# pure partition rules (no devices needed: they run in this process)

def test_even_partition_is_128_aligned_or_names_the_layer():
    assert par.even_partition(1024, 4, layer="l") == [(0, 256), (256, 512), (512, 768),
                                                       (768, 1024)]
    with pytest.raises(par.ShardingError, match=r"model\.layers\.3\.mlp\.up_proj.*192"):
        par.even_partition(384, 2, layer="model.layers.3.mlp.up_proj")
    with pytest.raises(par.ShardingError, match=r"lm_head.*equal shards"):
        par.even_partition(640, 3, layer="lm_head")
    with pytest.raises(par.ShardingError, match="below 128"):
        par.even_partition(256, 4, layer="x")


def test_misaligned_slices_raise_naming_the_layer(request, rng):
    if delegated(request):
        return
    w = random_weight(rng, 256, 384)
    with pytest.raises(par.ShardingError, match=r"model\.layers\.0\.self_attn\.q_proj.*128"):
        par.slice_columns(w, 64, 192, layer="model.layers.0.self_attn.q_proj")
    with pytest.raises(par.ShardingError, match=r"o_proj.*row range"):
        par.slice_rows(w, 0, 192, layer="o_proj", keep_bias=True)
    with pytest.raises(par.ShardingError, match=r"exceeds n=384"):
        par.slice_columns(w, 256, 512, layer="q")
    with pytest.raises(par.ShardingError, match=r"model\.layers\.1\.mlp\.gate_proj"):
        par.shard_mlp(par.make_mesh(2), random_weight(rng, 256, 384),
                      random_weight(rng, 256, 384), random_weight(rng, 384, 256),
                      layer="model.layers.1.mlp")


def test_slices_dequantize_to_blocks_of_the_full_weight(rng):
    w = random_weight(rng, 384, 512, bias=True, out_features=450)
    full = np.asarray(_dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64)
    for r, shard in enumerate(par.column_shards(w, 2, layer="c")):
        got = np.asarray(_dequantize(shard.trellis, shard.suh, shard.svh, shard.codebook))
        cols = slice(256 * r, 256 * r + 256)
        want = full[:, cols] * (np.arange(cols.start, cols.stop) < 450)     # padding zeroed
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(full).max())
        assert shard.n == shard.out_features == 256 and shard.k == 384
    rows = par.row_shards(w, 3, layer="r")
    assert [s.bias is not None for s in rows] == [True, False, False]
    for r, shard in enumerate(rows):
        got = np.asarray(_dequantize(shard.trellis, shard.suh, shard.svh, shard.codebook))
        np.testing.assert_allclose(got, full[128 * r:128 * r + 128], rtol=1e-6,
                                   atol=1e-6 * np.abs(full).max())


def test_kv_head_partition_replicates_when_tp_exceeds_kv_heads():
    assert par.kv_head_partition(2, 128, 2, layer="k") == [(0, 128), (128, 256)]
    assert par.kv_head_partition(2, 128, 4, layer="k") == [(0, 128), (0, 128), (128, 256),
                                                           (128, 256)]
    assert par.kv_head_partition(4, 128, 2, layer="k") == [(0, 256), (256, 512)]
    assert par.kv_head_partition(1, 128, 8, layer="k") == [(0, 128)] * 8
    assert par.head_partition(8, 128, 4, layer="q") == [(0, 256), (256, 512), (512, 768),
                                                        (768, 1024)]
    with pytest.raises(par.ShardingError, match=r"q_proj: 8 heads cannot be split evenly"):
        par.head_partition(8, 128, 3, layer="q_proj")
    with pytest.raises(par.ShardingError, match=r"q_proj.*below 128"):
        par.head_partition(4, 64, 4, layer="q_proj")
    with pytest.raises(par.ShardingError, match=r"model\.layers\.0\.self_attn\.k_proj.*128"):
        par.kv_head_partition(2, 64, 4, layer="model.layers.0.self_attn.k_proj")
    with pytest.raises(par.ShardingError, match="multiple of the 2 KV heads"):
        par.kv_head_partition(2, 128, 3, layer="v_proj")
    with pytest.raises(par.ShardingError, match="cannot be split evenly"):
        par.kv_head_partition(3, 128, 2, layer="v_proj")


def test_shard_attention_rejects_unsplittable_heads(request, rng):
    if delegated(request):
        return
    q, k = random_weight(rng, 256, 512), random_weight(rng, 256, 256)
    o = random_weight(rng, 512, 256)
    with pytest.raises(par.ShardingError, match=r"model\.layers\.5\.self_attn\.k_proj.*128"):
        par.shard_attention(par.make_mesh(4), q, k, k, o, num_heads=8, num_kv_heads=2,
                            head_dim=64, layer="model.layers.5.self_attn")
    with pytest.raises(par.ShardingError, match=r"self_attn\.q_proj: 6 heads"):
        par.shard_attention(par.make_mesh(4), q, k, k, o, num_heads=6, num_kv_heads=2,
                            head_dim=128, layer="self_attn")


def test_expert_partition_is_contiguous():
    assert par.expert_partition(8, 4, layer="m") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(par.ShardingError, match=r"model\.layers\.2\.mlp.*8 experts"):
        par.expert_partition(8, 3, layer="model.layers.2.mlp")


def test_combine_matrix_of_a_local_expert_range_matches_a_loop(rng):
    ids, w = random_routes(rng, 6, 8, 3)
    got = np.asarray(combine_matrix(ids, w, 4, first_expert=2))
    want = np.zeros((6, 4))
    for t in range(6):
        for e, wt in zip(np.asarray(ids[t]), np.asarray(w[t])):
            if 2 <= e < 6:
                want[t, e - 2] += wt
    np.testing.assert_array_equal(got, want.astype(np.float32))


# -------------------------------------------------------------------------------------------
# shard_map forwards

def test_make_mesh_has_auto_axes_and_accepts_unsharded_inputs(request):
    if delegated(request):
        return
    mesh = par.make_mesh(4)
    assert mesh.axis_names == ("tp",) and mesh.shape["tp"] == 4
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    out = jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=P("tp"),
                        out_specs=P())(jnp.arange(8.0))
    np.testing.assert_array_equal(np.asarray(out), [12.0, 16.0])
    mesh2 = par.make_mesh(axes={"dp": 2, "tp": 4})
    assert dict(mesh2.shape) == {"dp": 2, "tp": 4}
    with pytest.raises(ValueError, match="needs 16 devices"):
        par.make_mesh(16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_mlp_matches_unsharded(request, rng, tp):
    """gate/up column-parallel, down row-parallel (+psum); logical I=500 padded to 512."""
    if delegated(request):
        return
    H, I = 256, 512
    gate = random_weight(rng, H, I, out_features=500)
    up = random_weight(rng, H, I, out_features=500, K=4)
    down = random_weight(rng, I, H, in_features=500, bias=True)
    x = fp32_input(rng, 7, H)
    unsharded = jax.jit(lambda x, g, u, d: trellis_matmul(
        jax.nn.silu(trellis_matmul(x, g)) * trellis_matmul(x, u), d))(x, gate, up, down)
    assert rel_l2(unsharded, mlp_reference(x, gate, up, down)) <= REL_L2

    mesh = par.make_mesh(tp)
    g, u, d = par.shard_mlp(mesh, gate, up, down, layer="model.layers.0.mlp")
    assert g.trellis.sharding.shard_shape(g.trellis.shape) == (H // 16, I // 16 // tp, 48)
    assert d.suh.sharding.shard_shape(d.suh.shape) == (I // tp,)
    got = jax.jit(lambda *a: par.tp_mlp(mesh, *a))(x, g, u, d)
    assert got.shape == (7, H) and got.dtype == jnp.float32
    assert rel_l2(got, unsharded) <= REL_L2


@pytest.mark.parametrize("tp", [4])
def test_tp_column_and_row_linears_with_bias(request, rng, tp):
    if delegated(request):
        return
    mesh = par.make_mesh(tp)
    col = random_weight(rng, 384, 1024, bias=True, out_features=1000)
    x = fp32_input(rng, 5, 384)
    got = jax.jit(lambda *a: par.tp_column_linear(mesh, *a))(
        x, par.shard_column(mesh, col, layer="lm_head"))
    assert got.shape == (5, 1000)
    assert rel_l2(got, np.asarray(x, np.float64) @ dense(col) + dense_bias(col)) <= REL_L2

    row = random_weight(rng, 1024, 384, bias=True, in_features=1000)
    x = fp32_input(rng, 5, 1000)
    got = jax.jit(lambda *a: par.tp_row_linear(mesh, *a))(
        x, par.shard_row(mesh, row, layer="o_proj"))
    want = np.asarray(x, np.float64) @ dense(row) + dense_bias(row)     # bias counted once
    assert rel_l2(got, want) <= REL_L2


@pytest.mark.parametrize("tp", [2, 4])
def test_gqa_attention_with_kv_head_replication(request, rng, tp):
    """8 query heads and 2 KV heads of 128: one KV head per rank at tp=2; at tp=4 each KV head
    is replicated on two ranks. q/k/v column-parallel, o row-parallel (+psum)."""
    if delegated(request):
        return
    H, hd, nq, nkv, T = 256, 128, 8, 2, 6
    q, k, v = (random_weight(rng, H, nq * hd), random_weight(rng, H, nkv * hd),
               random_weight(rng, H, nkv * hd))
    o = random_weight(rng, nq * hd, H, bias=True)
    x = fp32_input(rng, T, H)

    def attention(xq, xk, xv, heads, kv_heads):            # [T, heads*hd] -> [T, heads*hd]
        xq = xq.reshape(T, heads, hd)
        rep = heads // kv_heads
        xk = jnp.repeat(xk.reshape(T, kv_heads, hd), rep, axis=1)
        xv = jnp.repeat(xv.reshape(T, kv_heads, hd), rep, axis=1)
        s = jnp.einsum("qhd,khd->hqk", xq, xk, precision="highest") / np.sqrt(hd)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), xv,
                          precision="highest").reshape(T, heads * hd)

    X = np.asarray(x, np.float64)
    ref = np.asarray(attention(*(jnp.asarray(X @ dense(w)) for w in (q, k, v)), nq, nkv))
    ref = ref @ dense(o) + dense_bias(o)

    mesh = par.make_mesh(tp)
    qs, ks, vs, os_ = par.shard_attention(mesh, q, k, v, o, num_heads=nq, num_kv_heads=nkv,
                                          head_dim=hd, layer="model.layers.0.self_attn")

    def body(xx, wq, wk, wv, wo):
        a = attention(par.column_parallel_matmul(xx, wq), par.column_parallel_matmul(xx, wk),
                      par.column_parallel_matmul(xx, wv), nq // tp, max(1, nkv // tp))
        return par.row_parallel_matmul(a, wo)

    specs = (P(), par.column_specs(qs), par.column_specs(ks), par.column_specs(vs),
             par.row_specs(os_))
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))(
        x, qs, ks, vs, os_)
    assert rel_l2(got, ref) <= REL_L2
    # the k blocks each rank holds are the replicated heads
    blocks = jax.jit(lambda *a: par.tp_column_linear(mesh, *a, gather=False))(x, ks)
    blocks = np.asarray(blocks).reshape(T, tp, hd)
    full_k = X @ dense(k)
    for r in range(tp):
        head = r // max(1, tp // nkv)
        assert rel_l2(blocks[:, r], full_k[:, head * hd:(head + 1) * hd]) <= REL_L2


def moe_weights(rng, E=8, H=256, I=256, I_logical=None, K=4, up_K=None):
    """Random experts (gate, up, down) [E, ...]; gate and up share K and codebook (one w13
    slab) unless ``up_K`` differs (then ``par.gate_up_stack`` keeps them as a pair)."""
    I_logical = I_logical or I
    gate = random_weight(rng, H, I, lead=(E,), out_features=I_logical, K=K)
    up = random_weight(rng, H, I, lead=(E,), out_features=I_logical, K=up_K or K)
    down = random_weight(rng, I, H, lead=(E,), in_features=I_logical, K=3)
    return gate, up, down


def test_local_moe_without_parallelism_matches_the_loop(rng):
    gate, up, down = moe_weights(rng, I_logical=200)
    x = fp32_input(rng, 9, 256)
    ids, w = random_routes(rng, 9, 8, 2)
    got = jax.jit(lambda x, w13, d, i, wt: par.local_moe(x, w13, d, i, wt))(
        x, stack_w13(gate, up), down, ids, w)
    assert rel_l2(got, moe_reference(x, gate, up, down, ids, w)) <= REL_L2


@pytest.mark.parametrize("ep, up_K", [(2, 4), (4, 4), (4, 3)])
def test_expert_parallel_matches_no_ep(request, rng, ep, up_K):
    """up_K = 4: gate/up as one w13 slab; up_K = 3: a (gate, up) pair."""
    if delegated(request):
        return
    gate, up, down = moe_weights(rng, I_logical=200, up_K=up_K)
    x = fp32_input(rng, 9, 256)
    ids, w = random_routes(rng, 9, 8, 2)
    gate_up = par.gate_up_stack(gate, up)
    assert isinstance(gate_up, Exl3Weight) == (up_K == 4)
    no_ep = jax.jit(lambda *a: par.local_moe(*a))(x, gate_up, down, ids, w)
    assert rel_l2(no_ep, moe_reference(x, gate, up, down, ids, w)) <= REL_L2
    mesh = par.make_mesh(ep)
    gate_up, ds = par.shard_experts(mesh, gate_up, down, layer="model.layers.1.mlp")
    for g in jax.tree.leaves(gate_up, is_leaf=lambda a: isinstance(a, Exl3Weight)):
        expert_axis = g.trellis.ndim - 4                   # w13 [2, E, ...] or gate/up [E, ...]
        assert g.trellis.sharding.shard_shape(g.trellis.shape)[expert_axis] == 8 // ep
    assert ds.trellis.sharding.shard_shape(ds.trellis.shape)[0] == 8 // ep
    got = jax.jit(lambda *a: par.ep_moe(mesh, *a))(x, gate_up, ds, ids, w)
    assert rel_l2(got, no_ep) <= REL_L2


@pytest.mark.parametrize("backend", ["reference", "packed"])
def test_routes_to_non_local_experts_contribute_exactly_zero(request, rng, backend):
    """All tokens route to experts 0..3 (ranks 0, 1 at ep=4): ranks 2, 3 output exact zeros.
    With the route-packed backend (which never runs an unrouted pair) that holds even when
    experts 6, 7 would give inf; the "reference" backend combines every expert's output with
    the dense routing matrix (0 * inf = nan), so it is checked on finite experts."""
    if delegated(request):
        return
    gate, up, down = moe_weights(rng)
    if backend == "packed":
        svh = np.asarray(down.svh).copy()
        svh[6:] = np.inf
        down = dataclasses.replace(down, svh=jnp.asarray(svh))
    x = fp32_input(rng, 5, 256)
    ids = jnp.asarray(rng.integers(0, 4, (5, 2)).astype(np.int32))
    w = jnp.asarray(rng.random((5, 2)).astype(np.float32))
    mesh = par.make_mesh(4)
    w13, d = par.shard_experts(mesh, stack_w13(gate, up), down, layer="moe")
    both = jax.jit(lambda *a: (par.ep_moe(mesh, *a, partials=True, backend=backend),
                               par.ep_moe(mesh, *a, backend=backend)))
    partials, total = (np.asarray(a) for a in both(x, w13, d, ids, w))
    assert partials.shape == (4, 5, 256)
    assert np.all(partials[2:] == 0.0)
    assert np.all(np.isfinite(total))
    np.testing.assert_allclose(total, partials.sum(0), rtol=1e-6, atol=1e-6)
    assert rel_l2(total, moe_reference(x, gate, up, down, ids, w)) <= REL_L2


def test_tensor_split_experts_match_no_ep(request, rng):
    if delegated(request):
        return
    gate, up, down = moe_weights(rng, I_logical=200)
    x = fp32_input(rng, 9, 256)
    ids, w = random_routes(rng, 9, 8, 2)
    want = moe_reference(x, gate, up, down, ids, w)
    mesh = par.make_mesh(2)
    w13, d = par.shard_experts(mesh, stack_w13(gate, up), down, layer="model.layers.1.mlp",
                               mode="tensor")
    assert w13.trellis.sharding.shard_shape(w13.trellis.shape) == (2, 8, 16, 8, 64)
    assert d.trellis.sharding.shard_shape(d.trellis.shape) == (8, 8, 16, 48)
    got = jax.jit(lambda *a: par.tensor_split_moe(mesh, *a))(x, w13, d, ids, w)
    assert rel_l2(got, want) <= REL_L2


def test_tensor_split_below_128_is_rejected(request, rng):
    if delegated(request):
        return
    gate, up, down = moe_weights(rng)                  # I = 256: 64 per rank at tp=4
    w13 = stack_w13(gate, up)
    with pytest.raises(par.ShardingError,
                       match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*below 128"):
        par.shard_experts(par.make_mesh(4), w13, down, layer="model.layers.1.mlp",
                          mode="tensor")
    with pytest.raises(par.ShardingError, match=r"model\.layers\.1\.mlp.*3 equal"):
        par.shard_experts(par.make_mesh(3), w13, down, layer="model.layers.1.mlp")
    with pytest.raises(par.ShardingError, match=r"moe: experts must be w13 \[2, E\]"):
        par.shard_experts(par.make_mesh(2), gate, down, layer="moe")


# -------------------------------------------------------------------------------------------
# rank-sliced checkpoints on the mesh

def write_rank_sliced_checkpoint(path, rng, *, ks, H=256, I=256, tp=2):
    """A rank-sliced MoE checkpoint (layer 1) cut from full random experts of K ``ks[e]``.

    Returns (path, [(gate, up, down) full Exl3Weight per expert])."""
    from exl3_jax.format import Exl3Writer
    from exl3_jax.format import rank_sliced as rs
    from exl3_jax.format.spec import marker_as_int32
    E, I_r = len(ks), I // tp
    meta = {"format": "exl3-trellis", "bits": "mixed", "k_values": sorted(set(ks)),
            "bits_per_expert": "tier_bitmap.json:k", "codebook": "mcg",
            "experts_per_layer": E, "moe_layers": [1, 1], "tensor_schema": rs.TENSOR_SCHEMA,
            "tp": tp}
    experts = [(random_weight(rng, H, I, K=K), random_weight(rng, H, I, K=K),
                random_weight(rng, I, H, K=K)) for K in ks]
    with Exl3Writer(path, {rs.METADATA_KEY: meta}) as writer:
        for e, ws in enumerate(experts):
            for proj, w in zip(rs.PROJECTIONS, ws):
                trellis, suh, svh = (np.asarray(a) for a in (w.trellis, w.suh, w.svh))
                for r in range(tp):
                    c = slice(r * I_r, (r + 1) * I_r)
                    t = slice(c.start // 16, c.stop // 16)
                    parts = ({"trellis": trellis[t], "suh": suh[c], "svh": svh}
                             if proj == "down_proj" else
                             {"trellis": trellis[:, t], "suh": suh, "svh": svh[c]})
                    parts["mcg"] = np.array(marker_as_int32("mcg"), np.int32)
                    for field, a in parts.items():
                        writer.add_tensor(rs.rank_tensor_name(1, e, proj, r, field), a)
    (path / "tier_bitmap.json").write_text(f'{{"1": {{"k": {list(ks)}}}}}')
    return path, experts


def test_rank_sliced_moe_on_the_mesh_matches_the_full_experts(request, rng, tmp_path):
    """TP=2 over a mixed-K (two tiers) rank-sliced layer equals the unsliced experts' MoE."""
    if delegated(request):
        return
    from exl3_jax.format.rank_sliced import RankSlicedCheckpoint
    ks = (3, 4, 4, 3)
    path, experts = write_rank_sliced_checkpoint(tmp_path / "ckpt", rng, ks=ks)
    mesh = par.make_mesh(2)
    ckpts = {r: RankSlicedCheckpoint(path, tp=2, tp_rank=r) for r in range(2)}
    w13, down, tiers = par.rank_sliced_layer(mesh, ckpts, 1)
    assert tiers == {3: (0, 3), 4: (1, 2)}
    assert w13[4].trellis.shape == (2, 2, 2, 16, 8, 64)           # [tp, gate/up, n_K, ...]
    assert w13[4].trellis.sharding.shard_shape(w13[4].trellis.shape)[0] == 1
    assert down[3].trellis.shape == (2, 2, 8, 16, 48)
    x = fp32_input(rng, 6, 256)
    ids, w = random_routes(rng, 6, 4, 2)
    got = jax.jit(lambda x, g, d, i, wt: par.rank_sliced_moe(mesh, x, g, d, tiers, i, wt))(
        x, w13, down, ids, w)
    X = np.asarray(x, np.float64)
    want = np.zeros((6, 256))
    for t in range(6):
        for e, wt in zip(np.asarray(ids[t]), np.asarray(w[t], np.float64)):
            g, u, d = (dense(m) for m in experts[e])
            want[t] += wt * ((silu(X[t] @ g) * (X[t] @ u)) @ d)
    assert rel_l2(got, want) <= REL_L2
    with pytest.raises(ValueError, match="rank 1 given as rank 0"):
        par.rank_sliced_layer(mesh, {0: ckpts[1]}, 1)
    g3 = ckpts[0].load_experts(1, "gate_proj").tiers[3]
    with pytest.raises(ValueError, match="rank 1's slice differs"):
        par.rank_stacked(mesh, {0: g3, 1: ckpts[1].load_experts(1, "gate_proj").tiers[4]})
    with pytest.raises(ValueError, match="holds a device of rank 1 but no slice"):
        par.rank_stacked(mesh, {0: g3})
