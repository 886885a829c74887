"""Unit tests of exl3_jax.nn against NumPy references on fresh random inputs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.nn import (Exl3Experts, Exl3Linear, F16_MAX, Linear, MoEBlock, PlainExperts,
                         RopeConfig, Router, apply_rope, fp16_operand, gqa_attention,
                         resolve_dtype, rms_norm, route_sigmoid_topk, route_softmax_topk)
from exl3_jax.nn.attention import advance, init_cache
from exl3_jax.trellis import Exl3Weight, dequantize
from helpers_models import random_linear

jax.config.update("jax_default_matmul_precision", "highest")


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_dequant = jax.jit(dequantize, static_argnums=3)


def make_weight(rng, in_f, out_f, K=4, codebook="mcg", bias=False):
    t, suh, svh, b = random_linear(rng, in_f, out_f, K, bias)
    w = Exl3Weight.create(jnp.asarray(t), jnp.asarray(suh), jnp.asarray(svh), codebook,
                          None if b is None else jnp.asarray(b), in_features=in_f,
                          out_features=out_f)
    W = np.asarray(_dequant(t, suh, svh, codebook), np.float64)[:in_f, :out_f]
    return w, W, (None if b is None else b[:out_f].astype(np.float64))


# -- Exl3Linear and the numerics policy -----------------------------------------------------------

@pytest.mark.parametrize("codebook,bias", [("mcg", False), ("mul1", True), ("3inst", False)])
def test_exl3_linear_fp32_matches_dequantized(rng, codebook, bias):
    w, W, b = make_weight(rng, 200, 150, K=3, codebook=codebook, bias=bias)   # k 256, n 256
    lin = Exl3Linear(w)
    x = rng.standard_normal((2, 5, 200)).astype(np.float32)
    want = x.astype(np.float64) @ W + (0 if b is None else b)
    y = jax.jit(lambda x: lin(x))(jnp.asarray(x))
    assert y.shape == (2, 5, 150) and y.dtype == jnp.float32
    assert rel_l2(y, want) < 1e-5
    lin.cache_dequantized()
    assert rel_l2(jax.jit(lambda x: lin(x))(jnp.asarray(x)), want) < 1e-5


def test_exl3_linear_bf16_within_tolerance(rng):
    w, W, _ = make_weight(rng, 192, 320, codebook="mul1")
    x = rng.standard_normal((7, 192)).astype(np.float32)
    lin = Exl3Linear(w)
    y = jax.jit(lambda x: lin(x))(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    want = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ W
    assert rel_l2(y, want) < 2e-2


def test_fp16_boundary_scales_out_of_range_rows(rng):
    """bf16 rows beyond the fp16 range are scaled by a power of two (not clamped, no inf)."""
    w, W, b = make_weight(rng, 128, 128, codebook="mcg", bias=True)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[0] *= 1e6                     # |x| up to ~4e6: overflows fp16
    x[1, 5] = 2.5e5                 # one huge entry
    xb = jnp.asarray(x, jnp.bfloat16)
    assert not np.all(np.isfinite(np.asarray(xb.astype(jnp.float16), np.float32)))  # naive cast
    x16, scale = fp16_operand(xb)
    assert np.all(np.abs(np.asarray(x16, np.float32)) <= F16_MAX)
    s = np.asarray(scale)[:, 0]
    assert s[0] > 1 and s[1] > 1 and s[2] == 1
    assert np.all(np.log2(s) == np.round(np.log2(s)))                       # powers of two
    np.testing.assert_array_equal(np.asarray(x16[2], np.float32), np.asarray(xb[2], np.float32))
    lin = Exl3Linear(w)
    y = np.asarray(jax.jit(lambda x: lin(x))(xb), np.float64)
    want = np.asarray(xb, np.float64) @ W + b
    assert np.all(np.isfinite(y))
    for r in range(3):
        assert rel_l2(y[r], want[r]) < 2e-2


def test_resolve_dtype_rejects_unknown():
    assert resolve_dtype("float32") == jnp.float32
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")
    with pytest.raises(ValueError, match="unknown activation dtype"):
        resolve_dtype("fp8")


def test_plain_linear_hf_orientation(rng):
    W = rng.standard_normal((6, 4)).astype(np.float32)        # HF [out, in]
    b = rng.standard_normal(6).astype(np.float32)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y = Linear.from_hf(W, b)(jnp.asarray(x))
    np.testing.assert_allclose(y, x @ W.T + b, rtol=1e-5, atol=1e-5)


# -- norms, RoPE, attention -----------------------------------------------------------------------

def test_rms_norm(rng):
    x = rng.standard_normal((4, 24)).astype(np.float32) * 3
    g = rng.standard_normal(24).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(g), 1e-5), want, rtol=1e-5,
                               atol=1e-5)


def np_inv_freq(dim, theta, scaling=None):
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    if scaling and scaling["rope_type"] == "llama3":   # HF _compute_llama3_parameters
        f, lo, hi, old = (scaling["factor"], scaling["low_freq_factor"],
                          scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        out = []
        for v in inv:
            wl = 2 * math.pi / v
            if wl < old / hi:
                out.append(v)
            elif wl > old / lo:
                out.append(v / f)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * v / f + s * v)
        inv = np.array(out)
    return inv


def np_rope(x, pos, rotary_dim, inv):
    """HF rotate_half RoPE on the first rotary_dim channels, float64."""
    x = x.astype(np.float64)
    ang = pos[..., None].astype(np.float64) * inv                     # [B, T, r/2]
    emb = np.concatenate([ang, ang], -1)[:, :, None, :]
    cos, sin = np.cos(emb), np.sin(emb)
    xr = x[..., :rotary_dim]
    half = rotary_dim // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return np.concatenate([xr * cos + rot * sin, x[..., rotary_dim:]], -1)


@pytest.mark.parametrize("scaling,partial", [
    (None, 1.0),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 1.0),
    (None, 0.5)])
def test_rope_matches_numpy(rng, scaling, partial):
    D = 64
    cfg = RopeConfig.from_hf(D, 10000.0, scaling, partial)
    x = rng.standard_normal((2, 5, 3, D)).astype(np.float32)
    pos = rng.integers(0, 300, size=(2, 5))
    inv = np_inv_freq(cfg.rotary_dim, 10000.0, scaling)
    want = np_rope(x, pos, cfg.rotary_dim, inv)
    got = jax.jit(apply_rope, static_argnums=2)(jnp.asarray(x), jnp.asarray(pos), cfg)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    if partial < 1:
        np.testing.assert_array_equal(np.asarray(got)[..., 32:], x[..., 32:])


def test_rope_rejects_unknown_type():
    with pytest.raises(NotImplementedError, match="yarn"):
        RopeConfig.from_hf(64, 1e4, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_gqa_attention_matches_numpy(rng, cache_dtype):
    # fp32 caches: fp32 HIGHEST math, to fp32 rounding. bf16 caches: bf16 operands with fp32
    # accumulation; q and the probabilities are rounded to bf16 (relative 2^-9), so the output
    # moves by well under 1% of its scale, against a float64 reference on the same cache.
    B, T, S, Hq, Hkv, D = 2, 3, 40, 6, 2, 64
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), cache_dtype)
    v = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), cache_dtype)
    mask = rng.random((B, T, S)) < 0.6
    mask[..., 0] = True
    got = jax.jit(gqa_attention, static_argnums=4)(jnp.asarray(q), k, v, jnp.asarray(mask),
                                                   D ** -0.5)
    assert got.dtype == jnp.float32
    k64, v64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (k, v))
    kr, vr = np.repeat(k64, Hq // Hkv, axis=2), np.repeat(v64, Hq // Hkv, axis=2)
    s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), kr) * D ** -0.5
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhts,bshd->bthd", p, vr)
    tol = 1e-5 if cache_dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_cache_mask_and_positions_with_left_padding():
    cache = init_cache(1, 2, 8, 1, 4, jnp.float32)
    valid = jnp.array([[False, False, True, True], [True, True, True, True]])
    pos, mask, cache = jax.jit(advance)(cache, valid)
    np.testing.assert_array_equal(pos, [[0, 0, 0, 1], [0, 1, 2, 3]])
    assert not mask[0, 3, 0] and mask[0, 3, 2] and mask[0, 3, 3] and not mask[0, 2, 3]
    assert int(cache.slot) == 4 and list(np.asarray(cache.pos)) == [2, 4]
    pos, mask, cache = jax.jit(advance)(cache, jnp.ones((2, 1), bool))
    np.testing.assert_array_equal(pos, [[2], [4]])
    np.testing.assert_array_equal(mask[0, 0], [0, 0, 1, 1, 1, 0, 0, 0])


@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                             ("bfloat16", "float32"), ("float32", "bfloat16")])
def test_plain_weight_products_are_exact_and_summed_in_fp32(rng, x_dtype, w_dtype):
    """Linear.forward_f32 and Router.logits vs float64 NumPy on the same (rounded) values:
    16-bit operands of one dtype go into the dot as they are (exact products, fp32 sums);
    other pairs run in fp32."""
    x = jnp.asarray(rng.standard_normal((3, 2048)), x_dtype)
    w = jnp.asarray(rng.standard_normal((2048, 128)) / 45.0, w_dtype)       # [H, E]
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    native = x_dtype == w_dtype
    for fn in (Linear(w).forward_f32, Router(w.T).logits):
        got = np.asarray(jax.jit(fn)(x))
        assert got.dtype == np.float32
        # fp32 summation of 2048 terms: error ~ sqrt(2048) * 2^-24 of the terms' magnitude
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
        dots = [e for e in jax.make_jaxpr(fn)(x).eqns if e.primitive.name == "dot_general"]
        assert [v.aval.dtype for v in dots[0].invars] == (
            [jnp.dtype(x_dtype)] * 2 if native else [jnp.dtype(jnp.float32)] * 2)


def test_router_keeps_16_bit_weights_and_widens_others():
    assert Router(np.zeros((4, 8), jnp.bfloat16)).weight.dtype == jnp.bfloat16
    assert Router(np.zeros((4, 8), np.float16)).weight.dtype == jnp.float16
    assert Router(np.zeros((4, 8), np.float64)).weight.dtype == jnp.float32
    r = Router(np.zeros((4, 8), np.float32))
    assert (r.in_features, r.out_features) == (8, 4)


# -- MoE routing and combine ----------------------------------------------------------------------

def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route_softmax(logits, k, renorm):
    ids, ws = [], []
    for row in logits.astype(np.float64):
        p = np_softmax(row)
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / (p[top].sum() if renorm else 1.0)
        ids.append(top)
        ws.append(w)
    return np.array(ids), np.array(ws)


def np_route_sigmoid(logits, bias, k, renorm, scale):
    ids, ws = [], []
    for row in logits.astype(np.float64):
        s = 1 / (1 + np.exp(-row))
        top = np.argsort(-(s + bias), kind="stable")[:k]
        w = s[top] / ((s[top].sum() + 1e-20) if renorm else 1.0)
        ids.append(top)
        ws.append(w * scale)
    return np.array(ids), np.array(ws)


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_router_matches_numpy(rng, renorm):
    logits = rng.standard_normal((9, 8)).astype(np.float32) * 2
    ids, w = jax.jit(route_softmax_topk, static_argnums=(1, 2))(jnp.asarray(logits), 3, renorm)
    want_ids, want_w = np_route_softmax(logits, 3, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_sigmoid_router_matches_numpy(rng, renorm):
    logits = rng.standard_normal((9, 8)).astype(np.float32) * 2
    bias = rng.standard_normal(8).astype(np.float32)      # large enough to change the choice
    ids, w = jax.jit(route_sigmoid_topk, static_argnums=(2, 3, 4))(
        jnp.asarray(logits), jnp.asarray(bias), 2, renorm, 2.5)
    want_ids, want_w = np_route_sigmoid(logits, bias, 2, renorm, 2.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
    plain_ids, _ = np_route_sigmoid(logits, np.zeros(8), 2, renorm, 2.5)
    assert (plain_ids != want_ids).any(), "bias should change some selections"


def np_moe(x, ids, w, Wg, Wu, Wd):
    """Loop over tokens and their selected experts (float64)."""
    out = np.zeros((x.shape[0], Wd.shape[-1]))
    for t in range(x.shape[0]):
        for e, we in zip(ids[t], w[t]):
            g, u = x[t] @ Wg[e], x[t] @ Wu[e]
            out[t] += we * ((g / (1 + np.exp(-g)) * u) @ Wd[e])
    return out


@pytest.fixture(scope="module")
def experts():
    """Stacked random EXL3 experts (E=4, hidden 160 -> k 256, intermediate 96 -> 128) and their
    dequantized float64 matrices."""
    import secrets
    seed = secrets.randbits(32)
    print(f"experts seed: {seed}")
    rng = np.random.default_rng(seed)
    E, H, I = 4, 160, 96
    ws = {n: [make_weight(rng, *dims, codebook="mul1") for _ in range(E)]
          for n, dims in (("g", (H, I)), ("u", (H, I)), ("d", (I, H)))}
    stacks = tuple(Exl3Weight(
        trellis=jnp.stack([w.trellis for w, _, _ in ws[n]]),
        suh=jnp.stack([w.suh for w, _, _ in ws[n]]), svh=jnp.stack([w.svh for w, _, _ in ws[n]]),
        bias=None, codebook="mul1", K=4, in_features=ws[n][0][0].in_features,
        out_features=ws[n][0][0].out_features) for n in "gud")
    dense = tuple(np.stack([W for _, W, _ in ws[n]]) for n in "gud")
    return stacks, dense


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_moe_block_exl3_matches_numpy(rng, experts, kind):
    """Routing + expert compute + combine of the EXL3 MoE block vs a per-token NumPy loop over
    the selected experts with dequantized weights (fp32 and bf16 modes, cached and not)."""
    (sg, su, sd), dense = experts
    E, H, k, T = 4, 160, 2, 6
    G = (rng.standard_normal((E, H)) * 0.3).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    kw = dict(top_k=k, router_kind=kind, renormalize=True, routed_scaling_factor=1.5,
              score_bias=bias if kind == "sigmoid" else None)
    block = MoEBlock(Router(G), Exl3Experts(sg, su, sd), **kw)
    logits = x.astype(np.float64) @ G.T.astype(np.float64)
    ids, w = (np_route_softmax(logits, k, True) if kind == "softmax"
              else np_route_sigmoid(logits, bias, k, True, 1.5))
    want = np_moe(x.astype(np.float64), ids, w, *dense)
    run = jax.jit(lambda x: block(x))
    assert rel_l2(run(jnp.asarray(x)), want) < 1e-5
    if kind == "sigmoid":
        xb = jnp.asarray(x, jnp.bfloat16)
        x64 = np.asarray(xb, np.float64)                  # route the bf16-rounded input
        ids_b, w_b = np_route_sigmoid(x64 @ G.T.astype(np.float64), bias, k, True, 1.5)
        assert rel_l2(run(xb), np_moe(x64, ids_b, w_b, *dense)) < 2e-2
    else:
        block.experts.cache_dequantized()
        assert rel_l2(jax.jit(lambda x: block(x))(jnp.asarray(x)), want) < 1e-5
    plain = MoEBlock(Router(G), PlainExperts(*(jnp.asarray(d, jnp.float32)
                                                       for d in dense)), **kw)
    assert rel_l2(plain(jnp.asarray(x)), want) < 1e-5


def test_moe_block_rejects_bad_setup(rng):
    G = Router(np.zeros((4, 8), np.float32))
    ex = PlainExperts(jnp.zeros((3, 8, 4)), jnp.zeros((3, 8, 4)), jnp.zeros((3, 4, 8)))
    with pytest.raises(TypeError, match="router must be an nn.Router"):
        MoEBlock(Linear.from_hf(np.zeros((3, 8), np.float32)), ex, top_k=2,
                 router_kind="softmax", renormalize=True)
    with pytest.raises(ValueError, match=r"router weight must be \[experts, hidden\]"):
        Router(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="router has 4 outputs for 3 experts"):
        MoEBlock(G, ex, top_k=2, router_kind="softmax", renormalize=True)
    with pytest.raises(ValueError, match="unknown router kind"):
        MoEBlock(G, ex, top_k=2, router_kind="relu", renormalize=True)
