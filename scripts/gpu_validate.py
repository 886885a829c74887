"""Validate the GPU Trellis GEMM kernels on a CUDA machine; writes one JSON report.

  python scripts/gpu_validate.py --out $OUT/gpu_validate.json [--budget-s 420] [--quick] [--group]
  python scripts/gpu_validate.py --memcheck decode|prefill|tiles|wgmma|group|row
                                                                   (under compute-sanitizer)
  python scripts/gpu_validate.py --sass DIR                    (cubins + cuobjdump SASS)

Sections (each recorded even if another fails):
  decode_exact: the kernels' decoded weights bit-exact vs exl3_jax.trellis.decode_trellis, every
    codebook x rate: the dequantize kernel's W_hat compared bitwise (and its rotated form, the
    prefill plan's weight, against the fp32 dequantized weight), and the decode+MMA kernel
    fed one-hot fp16 rows with the rotations off (e_i @ W_hat = W_hat[i] exactly in fp32), 32
    rows per call and one (the m = 1 plan: split pairs, whose MMA takes each weight unrounded,
    decode_trellis(unrounded=True)).
  gemm: relative L2 error vs the fp32 reference (linear_reference) for every codebook x rate and
    m in {1, 2, 3, 7, 8, 16, 31, 32, 33, 128, 1000, 4096}, with the auto plan and, for m <= 32,
    also the prefill plan (m > 32: also the large-token-tile plan); kernel outputs are
    NaN-poisoned (aliased output buffers) so an unwritten element shows up as NaN.
  group (--group): linear groups (members (n, n/4, n/4) and (n, n), sharing x, one launch of
    each kernel) vs each member's fp32 reference, NaN-poisoned partials and the production
    dispatch (ops.trellis_matmul_group), m in {1, 3, 16, 32}.
  row_linear: one token through the row linear (ffi/trellis_linear.py: one custom call, the
    default at m = 1), also with NaN-poisoned partials, vs the fp32 reference (relative L2 <=
    1e-3), and its distance from the decode plan's three calls (EXL3_JAX_ROW_LINEAR=0; its own
    K-split and warp order, so not bitwise); single linears and groups of the Llama-3-8B and
    test shapes.
  dispatch: exl3_jax.ops.trellis_matmul on the GPU backend vs the reference backend.
  row_scale: the fp16 boundary inside the Hadamard kernels (ffi/hadamard.py): rows whose rotated
    operand would overflow fp16 (a row aligned with a Hadamard row; a bf16 row of ~1e6) plus an
    ordinary row, bf16, through a decode linear, a prefill linear and a group (and each row
    alone through the row linear, single and group), vs float64 NumPy
    (finite, per-row relative L2 <= 2e-3); and the input kernel's scales bitwise equal to
    trellis_gemm.row_scale.
  bench: a timing table vs a bf16 jnp.dot in a jitted loop (exl3_jax.ffi.bench).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_bench_common import env_var

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ops.plans import RING_SLOTS, select_plan
from exl3_jax.trellis import decode_trellis, dequantize, linear_reference

M_LIST = (1, 2, 3, 7, 8, 16, 31, 32, 33, 128, 1000, 4096)
INT_RATES = (2, 3, 4, 5, 6, 7, 8)
HALF_RATES = (2.5, 3.5)
NAN_F16X2 = np.uint32(0x7E007E00)
DEQUANT_ROTATED_TOL = 8e-4     # relative L2 of the prefill plan's fp16 weight to the fp32 one


def configs(quick: bool = False):
    out = [(cb, K) for cb in ("3inst", "mcg", "mul1") for K in INT_RATES]
    out += [("mul1", K) for K in HALF_RATES]
    if quick:
        out = [("mcg", 3), ("mcg", 4), ("mul1", 4), ("3inst", 2), ("mul1", 2.5), ("mcg", 8),
               ("mcg", 6), ("3inst", 5)]
    return out


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------


def poisoned_forward(x, w, plan):
    xh, scale = tg.input_transform(x, w.suh)
    return tg.output_transform(tg.rotated_matmul(xh, w, plan, poison=True), w.svh, w.bias,
                               scale)


def layout_diagnosis(got, want) -> dict:
    """Where a mismatching [k, n] result's rows and columns occur in the reference: for each
    axis, how many of got's lines equal some line of want exactly, and the most common offsets
    (found index - index). A permuted stage or fragment layout shows as a few offsets (e.g. an
    XOR pattern of 8 rows), a wrong decode as no line found."""
    import collections
    res = {}
    for axis, (g, w) in (("rows", (got, want)), ("cols", (got.T, want.T))):
        where = {bytes(np.ascontiguousarray(line).view(np.uint8)): i for i, line in enumerate(w)}
        found = [(i, where.get(bytes(np.ascontiguousarray(line).view(np.uint8))))
                 for i, line in enumerate(g)]
        hits = [(i, j) for i, j in found if j is not None]
        res[f"{axis}_found"] = f"{len(hits)}/{len(found)}"
        res[f"{axis}_offsets"] = collections.Counter(j - i for i, j in hits).most_common(4)
    return res


def check_decode_exact(cb, K, k, n, kinds=None):
    """One jitted program per config: the dequantize kernel once, the MMA kernel on k one-hot rows
    in chunks of 32 (lax.map; packed pairs, fp16 weights) and one row at a time (the m = 1
    plan: split pairs for 3inst / mcg, whose MMA sums each weight's two fp16 halves in fp32, so
    the reference is the unrounded value), and the token-tile kernels (tiles; on Hopper wgmma)
    on all k one-hot rows at once (m = k), so the config costs one XLA compile. A mismatch
    records its first few (row, column, got, want): a permuted fragment or stage layout shows
    as a pattern there."""
    from exl3_jax.ffi.aot import device_arch
    w = gb.random_weight(k, n, K, cb, seed=11)
    ref = np.asarray(decode_trellis(w.trellis, cb))                  # fp16 [k, n]
    plans = {32: select_plan(32, k, n, force="decode"), 1: select_plan(1, k, n, force="decode")}
    cfgs = {m: tg._mma_config(w, plan) for m, plan in plans.items()}
    tile_plans = {kind: forced_plan(k, k, n, kind)
                  for kind in (("tiles", "wgmma") if device_arch() == "sm_90a"
                               else ("tiles",))
                  if kinds is None or kind in kinds}

    @jax.jit
    def run(w, eye):
        w_hat = tg.dequantize_f16(w, rotate=False,
                                  out_init=jnp.full((n * k // 2,), NAN_F16X2, jnp.uint32))
        # the prefill plan's weight: both rotations, suh, svh and a scale of 2 folded in
        w_full = tg.dequantize_f16(w, rotate=True, scale=jnp.full((1,), 2.0, jnp.float32),
                                   out_init=jnp.full((n * k // 2,), NAN_F16X2, jnp.uint32))
        rows = {}
        for m, plan in plans.items():
            # No aliased NaN init here: inside lax.map on the H200 the aliased output came
            # back all zeros (the kernel's direct and aliased calls were exact; session 19's
            # probe_onehot.py). Unwritten elements still show, as mismatches.
            part = jax.lax.map(
                lambda e, plan=plan: tg.mma_partials(e, w, plan),
                eye.reshape(k // m, m, k))                     # [k/m, splits, m_pad, n]
            rows[m] = jnp.sum(part[:, :, :m], axis=1).reshape(k, n)
        tiles = {kind: tg.rotated_matmul(eye, w, plan, poison=True)   # NaN-poisoned partials
                 for kind, plan in tile_plans.items()}
        return w_hat, w_full, rows, tiles

    w_hat, w_full, rows, tiles = run(w, jnp.eye(k, dtype=jnp.float16))
    rows.update(tiles)
    w_hat, w_full = np.asarray(w_hat), np.asarray(w_full, np.float64)
    res = {"codebook": cb, "K": K, "k": k, "n": n, "splits": cfgs[32].splits,
           "m1_split_pairs": cfgs[1].split_pairs, "bytesum": cfgs[1].bytesum}
    res["dequant_mismatches"] = int(np.sum(w_hat.view(np.uint16) != ref.view(np.uint16)))
    W = 2.0 * np.asarray(dequantize(w.trellis, w.suh, w.svh, cb), np.float64)
    res["dequant_rotated_rel"] = float(np.linalg.norm(w_full - W) / np.linalg.norm(W))
    res["dequant_rotated_nonfinite"] = int(np.sum(~np.isfinite(w_full)))
    # split pairs and the byte-sum mul1 kernels multiply the value before its fp16 rounding
    want = {m: np.asarray(decode_trellis(w.trellis, cb,
                                         unrounded=cfg.split_pairs or cfg.bytesum), np.float32)
            for m, cfg in cfgs.items()}
    for kind in tile_plans:
        want[kind] = ref.astype(np.float32)
    keys = [(32, "mma_mismatches"), (1, "mma_m1_mismatches")] + [
        (kind, f"{kind}_mismatches") for kind in tile_plans]
    for m, key in keys:
        got = np.asarray(rows[m], np.float32)
        bad = got.view(np.uint32) != want[m].view(np.uint32)
        res[key] = int(np.sum(bad))
        if res[key]:
            res[key.replace("mismatches", "first_bad")] = [
                [int(r), int(c), float(got[r, c]), float(want[m][r, c])]
                for r, c in zip(*np.nonzero(bad))][:6]
            res[key.replace("mismatches", "layout")] = layout_diagnosis(got, want[m])
    res["dequant_bit_exact"] = res["dequant_mismatches"] == 0
    # fp16 rounding of the rotated weight (ffi/trellis_dequant.py: ~5e-4 emulated)
    res["dequant_rotated_ok"] = (res["dequant_rotated_rel"] <= DEQUANT_ROTATED_TOL
                                 and res["dequant_rotated_nonfinite"] == 0)
    res["mma_bit_exact"] = res["mma_mismatches"] == 0 and res["mma_m1_mismatches"] == 0
    res["token_tiles_bit_exact"] = all(res[f"{kind}_mismatches"] == 0 for kind in tile_plans)
    return res


def forced_plan(m, k, n, kind, codebook=None):
    """The plan of a forced kind on this device's arch for weights in ``codebook``
    (trellis_gemm.plan_for_shape: the production plan of that kind, e.g. the ring past 2^26
    weights on Hopper);
    "wgmma_tight": the wgmma plan through the smallest weight ring (MIN_WEIGHT_RING chunk
    slots per warp), with one K-split and no fused epilogue, so each CTA's chunks wrap around
    the ring and its stages are reused as soon as the rules allow; "wgmma_fused": with one
    K-split and the output transform in its epilogue; "decode_ring": the decode plan with its
    loads through a RING_SLOTS cp.async ring of at most 2-step chunks (MmaConfig.ring; where the
    kernel's layout allows, else direct loads); "prefill": the prefill plan at any m."""
    if kind == "wgmma_tight":
        from exl3_jax.ffi.trellis_wgmma import MIN_WEIGHT_RING
        return dataclasses.replace(tg.plan_for_shape(m, k, n, force="wgmma"), splits=1,
                                   fused_out=False, weight_ring=MIN_WEIGHT_RING)
    if kind == "wgmma_fused":
        return dataclasses.replace(tg.plan_for_shape(m, k, n, force="wgmma"), splits=1,
                                   fused_out=True)
    if kind == "decode_ring":
        plan = tg.plan_for_shape(m, k, n, force="decode", codebook=codebook)
        return dataclasses.replace(plan, ring=RING_SLOTS, unroll=min(plan.unroll, 2))
    return tg.plan_for_shape(m, k, n, force=kind, codebook=codebook)


def check_gemm(cb, K, k, n, ms, kinds=None):
    """Every m and plan of one config in one jitted program (one XLA compile per config)."""
    w = gb.random_weight(k, n, K, cb, seed=5)
    bias = jnp.asarray(np.random.default_rng(9).standard_normal(n) * 0.1, jnp.float16)
    w = type(w)(w.trellis, w.suh, w.svh, bias, w.codebook, w.K, w.in_features, w.out_features)
    # every m through the prefill plan, m <= 32 through the decode plan and m > 32 through the
    # large-token-tile plans too ("tiles", ffi/trellis_tiles.py; on Hopper "wgmma",
    # ffi/trellis_wgmma.py)
    # (on Hopper the wgmma plan at every m, and for m > 32 its smallest weight ring with two
    # wgmmas in flight and its fused output transform: "wgmma_tight", "wgmma_fused"; the
    # poisoned path checks the partials)
    from exl3_jax.ffi.aot import device_arch
    hopper = device_arch() == "sm_90a"
    cases = [(m, kind) for m in ms
             for kind in (("decode", "decode_ring", "prefill")
                          + (("wgmma",) if hopper else ())
                          if m <= 32 else
                          ("tiles", "prefill") + (
                              ("wgmma", "wgmma_tight", "wgmma_fused") if hopper else ()))
             if kinds is None or kind.split("_")[0] in kinds or kind in kinds]
    plans = [forced_plan(m, k, n, kind, cb) for m, kind in cases]
    xs = {m: jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
          for m in ms}
    # bf16 activations are materialized outside the jitted program: inside it XLA may keep the
    # f32 -> bf16 rounding away from the reference (excess precision), which shows up as a
    # ~1.6e-3 "error" that is only the bf16 rounding of x (seen on the H200).
    xb = {m: jax.device_put(np.asarray(xs[m]).astype(jnp.bfloat16)) for m in ms}

    @jax.jit
    def run(xs, xb, w):
        # "poisoned": jnp transforms around the GEMM kernels writing into NaN-filled buffers;
        # "prod": the production path (Hadamard kernels + GEMM kernels), bf16 activations.
        poisoned = [poisoned_forward(xs[m], w, plan) for (m, _), plan in zip(cases, plans)]
        prod = [tg.trellis_matmul_gpu(xb[m], w, plan=plan)
                for (m, _), plan in zip(cases, plans)]
        refs = {m: linear_reference(xs[m], w.trellis, w.suh, w.svh, w.codebook, w.bias)
                for m in ms}
        refs_bf16 = {m: linear_reference(xb[m], w.trellis, w.suh, w.svh, w.codebook, w.bias)
                     for m in ms}
        return poisoned, prod, refs, refs_bf16

    poisoned, prod, refs, refs_bf16 = run(xs, xb, w)
    rows = []
    for path, outs, rs in (("poisoned", poisoned, refs), ("prod", prod, refs_bf16)):
        for (m, kind), y in zip(cases, outs):
            y = np.asarray(y, np.float64)
            ref = np.asarray(rs[m], np.float64)
            nan = int(np.sum(~np.isfinite(y)))
            rel = (float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) if nan == 0
                   else float("inf"))
            rows.append(dict(codebook=cb, K=K, m=m, plan=kind, path=path, rel_l2=rel,
                             nonfinite=nan, ok=bool(nan == 0 and rel <= 1e-3)))
    return rows


GROUP_M = (1, 3, 16, 32)          # m_tile 8, 8 (padded rows), 16, 32


def check_group(cb, K, k, members, ms=GROUP_M):
    """A linear group (q/k/v-like members sharing x) through one decode launch: poisoned
    group kernel (NaN-filled partials) and the production dispatch (ops.trellis_matmul_group,
    bf16 x) vs each member's fp32 reference; some members carry a bias."""
    from exl3_jax.ops import trellis_matmul_group
    ws = []
    for i, n in enumerate(members):
        w = gb.random_weight(k, n, K, cb, seed=21 + i)
        bias = (jnp.asarray(np.random.default_rng(30 + i).standard_normal(n) * 0.1, jnp.float16)
                if i % 2 == 0 else None)
        ws.append(type(w)(w.trellis, w.suh, w.svh, bias, w.codebook, w.K, w.in_features,
                          w.out_features))
    nt = sum(members)
    plans = [tg.plan_for_shape(m, k, nt, force="decode", codebook=cb)   # this arch's, ring too
             for m in ms]
    xs = {m: jnp.asarray(np.random.default_rng(100 + m).standard_normal((m, k)), jnp.float32)
          for m in ms}
    xb = {m: jax.device_put(np.asarray(xs[m]).astype(jnp.bfloat16)) for m in ms}

    @jax.jit
    def run(xs, xb, ws):
        poisoned = [tg.trellis_matmul_group(xs[m], ws, plan, poison=True)
                    for m, plan in zip(ms, plans)]
        prod = [jnp.concatenate(trellis_matmul_group(xb[m], ws, backend="gpu"), axis=-1)
                for m in ms]
        ref = {m: jnp.concatenate([linear_reference(xs[m], w.trellis, w.suh, w.svh, w.codebook,
                                                    w.bias) for w in ws], axis=-1) for m in ms}
        ref_b = {m: jnp.concatenate([linear_reference(xb[m], w.trellis, w.suh, w.svh,
                                                      w.codebook, w.bias) for w in ws], axis=-1)
                 for m in ms}
        return poisoned, prod, ref, ref_b

    poisoned, prod, ref, ref_b = run(xs, xb, ws)
    rows = []
    for path, outs, rs in (("poisoned", poisoned, ref), ("prod", prod, ref_b)):
        for m, y in zip(ms, outs):
            y = np.asarray(y, np.float64)
            r = np.asarray(rs[m], np.float64)
            nan = int(np.sum(~np.isfinite(y)))
            # worst member: a wrong member tile or activation segment shows there even when the
            # whole output's error is dominated by a larger member
            starts = np.cumsum([0, *members])
            rel = max(float(np.linalg.norm(y[:, a:b] - r[:, a:b]) / np.linalg.norm(r[:, a:b]))
                      for a, b in zip(starts[:-1], starts[1:])) if nan == 0 else float("inf")
            rows.append(dict(codebook=cb, K=K, members=list(members), m=m, path=path,
                             rel_l2=rel, nonfinite=nan, ok=bool(nan == 0 and rel <= 1e-3)))
    return rows


ROW_SHAPES = ((1024, 512, None), (4096, 4096, None), (14336, 4096, None),
              (4096, 6144, (4096, 1024, 1024)), (4096, 28672, (14336, 14336)))


def row_shapes(spec: str | None):
    """ROW_SHAPES, or --row-shapes 'KxN[:m1+m2+..],...' (members: a group's widths)."""
    if not spec:
        return ROW_SHAPES
    out = []
    for item in spec.split(","):
        shape, _, members = item.partition(":")
        k, n = (int(v) for v in shape.split("x"))
        out.append((k, n, tuple(int(v) for v in members.split("+")) if members else None))
    return tuple(out)


def check_row_linear(cb, K, k, n, members):
    """One bf16 token through the row linear and the three-call decode path (module docstring);
    member 0 carries a bias."""
    from exl3_jax.ops import trellis_matmul_group
    ws = []
    for i, nn in enumerate(members or (n,)):
        w = gb.random_weight(k, nn, K, cb, seed=61 + i)
        bias = (jnp.asarray(np.random.default_rng(70 + i).standard_normal(nn) * 0.1, jnp.float16)
                if i == 0 else None)
        ws.append(type(w)(w.trellis, w.suh, w.svh, bias, w.codebook, w.K, w.in_features,
                          w.out_features))
    x = jax.device_put(np.random.default_rng(k + n).standard_normal((1, k)).astype(jnp.bfloat16))
    target = ws if members else ws[0]
    outs = {}
    # "all": the row linear at any size (past its size gate too, e.g. the gate/up group)
    with env_var(tg.ROW_LINEAR_ENV, "all"):
        cfg = tg._row_linear_config(target, select_plan(1, k, n, force="decode"))
    for flag in ("all", "0"):
        with env_var(tg.ROW_LINEAR_ENV, flag):       # read at trace time: a new jit each
            fwd = jax.jit(lambda x, ws: jnp.concatenate(trellis_matmul_group(x, ws, backend="gpu"),
                                                        axis=-1) if members else
                          tg.trellis_matmul_gpu(x, ws[0]))
            outs[flag] = np.asarray(fwd(x, ws))
    poisoned = np.asarray(jax.jit(lambda x, ws: tg.row_linear(
        x, ws if members else ws[0], cfg, poison=True))(x, ws), np.float64)
    ref = np.concatenate([np.asarray(linear_reference(x, w.trellis, w.suh, w.svh, w.codebook,
                                                      w.bias), np.float64) for w in ws], axis=-1)
    three = np.asarray(outs["0"], np.float64)
    row = dict(codebook=cb, K=K, k=k, n=n, members=list(members or ()), splits=cfg.mma.splits,
               warps_n=cfg.mma.warps_n, rel_l2_vs_three_calls=float(
                   np.linalg.norm(outs["all"] - three) / np.linalg.norm(three)))
    for name, y in (("row", np.asarray(outs["all"], np.float64)), ("poisoned", poisoned)):
        nan = int(np.sum(~np.isfinite(y)))
        row[f"{name}_nonfinite"] = nan
        row[f"{name}_rel_l2"] = (float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                                 if nan == 0 else float("inf"))
    row["ok"] = bool(row["row_rel_l2"] <= 1e-3 and row["poisoned_rel_l2"] <= 1e-3)
    return row


def check_dispatch(k=1024, n=512):
    from exl3_jax.ops import trellis_matmul
    w = gb.random_weight(k, n, 3, "mcg", seed=3)
    out = []
    for m in (1, 40):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((2, m, k)), jnp.bfloat16)
        yg = np.asarray(jax.jit(lambda x, w: trellis_matmul(x, w, backend="gpu"))(x, w))
        yr = np.asarray(jax.jit(lambda x, w: trellis_matmul(x, w, backend="reference"))(x, w))
        rel = float(np.linalg.norm(yg - yr) / np.linalg.norm(yr))
        out.append(dict(m=m, shape=list(yg.shape), rel_l2=rel, ok=rel <= 1e-3))
    return out


def check_row_scale(k=1024, n=512):
    """The fp16 boundary of the Hadamard kernels on rows that need it (module docstring)."""
    from exl3_jax.ops import trellis_matmul_group
    from exl3_jax.trellis import dequantize
    rng = np.random.default_rng(41)
    ws = []
    for i, nn in enumerate((n, n // 4)):
        w = gb.random_weight(k, nn, 4, "mcg", seed=51 + i)
        bias = jnp.asarray(rng.standard_normal(nn) * 0.1, jnp.float16)
        ws.append(type(w)(w.trellis, w.suh, w.svh, bias, w.codebook, w.K, w.in_features,
                          w.out_features))
    suh0 = np.asarray(ws[0].suh, np.float64)
    x = rng.standard_normal((3, k))
    x[1] = 6000.0 / suh0            # x * suh = 6000: H128 gathers 67882 into one element
    x[2] *= 1e6                     # beyond fp16 altogether
    xb = jax.device_put(x.astype(jnp.bfloat16))
    x64 = np.asarray(xb, np.float64)
    dense = [np.asarray(dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64) for w in ws]
    refs = [x64 @ d + np.asarray(w.bias, np.float64) for d, w in zip(dense, ws)]

    @jax.jit
    def run(xb, ws):
        return {"decode": [tg.trellis_matmul_gpu(xb, ws[0], plan="decode")],
                "prefill": [tg.trellis_matmul_gpu(xb, ws[0], plan="prefill")],
                "group": trellis_matmul_group(xb, ws, backend="gpu"),
                "row": [jnp.concatenate([tg.trellis_matmul_gpu(xb[r:r + 1], ws[0], plan="decode")
                                         for r in range(3)])],
                "row_group": [jnp.concatenate(ys) for ys in zip(*[
                    trellis_matmul_group(xb[r:r + 1], ws, backend="gpu") for r in range(3)])],
                "scales": tg.hadamard_in(xb, ws[0].suh, 8, "fragments")[1][:3],
                "want_scales": tg.row_scale(xb, ws[0].suh)[:, 0]}

    out = run(xb, ws)
    rows = []
    for path in ("decode", "prefill", "group", "row", "row_group"):
        for i, y in enumerate(out[path]):
            y = np.asarray(y, np.float64)
            rel = [float(np.linalg.norm(y[r] - refs[i][r]) / np.linalg.norm(refs[i][r]))
                   for r in range(3)]
            fin = bool(np.all(np.isfinite(y)))
            rows.append(dict(path=path, member=i, rel_l2_rows=rel, finite=fin,
                             ok=fin and max(rel) <= 2e-3))
    got, want = np.asarray(out["scales"]), np.asarray(out["want_scales"])
    rows.append(dict(path="scales", got=got.tolist(), want=want.tolist(),
                     ok=bool(np.array_equal(got, want) and got[0] == 1 and got[1] > 1)))
    return rows


# ---------------------------------------------------------------------------------------------


def run_validation(args) -> dict:
    t_start = time.time()
    deadline = t_start + args.budget_s
    report = {"versions": gb.versions(), "sections": {}}
    k, n = args.k, args.n
    m_list = tuple(int(v) for v in args.m.split(",")) if args.m else M_LIST
    kinds = set(args.kinds.split(",")) if args.kinds else None

    def section(name, fn):
        t0 = time.time()
        try:
            report["sections"][name] = {"result": fn(), "seconds": time.time() - t0}
        except Exception as e:   # noqa: BLE001
            report["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()[-4000:],
                                        "seconds": time.time() - t0}
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
        write(report, args.out)

    def decode_exact():
        rows = []
        for cb, K in configs(args.quick):
            try:
                r = check_decode_exact(cb, K, k, n, kinds)
            except Exception as e:   # noqa: BLE001
                r = {"codebook": cb, "K": K, "error": f"{type(e).__name__}: {e}"[:2000]}
            rows.append(r)
            log(f"[decode_exact] {cb:5} K={K:<4} " + " ".join(
                f"{key}={r[key]}" for key in ("dequant_bit_exact", "dequant_rotated_rel",
                                              "mma_bit_exact",
                                              "token_tiles_bit_exact", "dequant_mismatches",
                                              "mma_mismatches", "mma_m1_mismatches",
                                              "tiles_mismatches", "wgmma_mismatches",
                                              "tiles_first_bad", "wgmma_first_bad",
                                              "tiles_layout", "wgmma_layout", "error")
                if key in r))
        return rows

    def gemm():
        rows = []
        for cb, K in configs(args.quick):
            if time.time() > deadline:
                rows.append({"skipped": "budget"})
                break
            try:
                rs = check_gemm(cb, K, k, n, m_list, kinds)
            except Exception as e:   # noqa: BLE001
                rs = [{"codebook": cb, "K": K, "error": f"{type(e).__name__}: {e}"[:2000],
                       "ok": False}]
            rows += rs
            worst = max((r.get("rel_l2", float("inf")) for r in rs), default=None)
            log(f"[gemm] {cb:5} K={K:<4} all_ok={all(r.get('ok') for r in rs)} "
                f"worst_rel_l2={worst:.3g}" + "".join(
                    f" FAIL(m={r.get('m')},{r.get('plan')},{r.get('path')},rel={r.get('rel_l2')},"
                    f"nan={r.get('nonfinite')},{r.get('error', '')})"
                    for r in rs if not r.get("ok")))
        return rows

    def group():
        rows = []
        quarter = max(128, n // 4 // 128 * 128)      # members' n: multiples of 128
        three, two = (n, quarter, quarter), (n, n)
        cases = [(cb, K, members) for cb, K in configs(args.quick) for members in (three, two)]
        if args.quick:
            cases = [("mcg", 3, three), ("mul1", 4, two), ("mcg", 4, three), ("3inst", 2, two)]
        for cb, K, members in cases:
            if time.time() > deadline:
                rows.append({"skipped": "budget"})
                break
            try:
                rs = check_group(cb, K, k, members)
            except Exception as e:   # noqa: BLE001
                rs = [{"codebook": cb, "K": K, "members": list(members),
                       "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}]
            rows += rs
            log(f"[group] {cb:5} K={K:<4} {members} all_ok={all(r.get('ok') for r in rs)} "
                f"worst_rel_l2={max(r.get('rel_l2', float('inf')) for r in rs):.3g}")
        return rows

    def row_linear():
        rows = []
        # every config once, each on the next shape (a config count of 5 covers all 5 twice)
        for (cb, K), (rk, rn, members) in zip(itertools.cycle(configs(args.quick)),
                                               row_shapes(args.row_shapes) * 2):
            if time.time() > deadline:
                rows.append({"skipped": "budget"})
                break
            try:
                r = check_row_linear(cb, K, rk, rn, members)
            except Exception as e:   # noqa: BLE001
                r = {"codebook": cb, "K": K, "k": rk, "n": rn,
                     "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
            rows.append(r)
            log(f"[row_linear] {json.dumps(r)[:400]}")
        return rows

    wanted = set(args.sections.split(",")) if args.sections else None
    for name, fn in (("decode_exact", decode_exact), ("row_linear", row_linear),
                     ("group", group), ("gemm", gemm), ("dispatch", check_dispatch),
                     ("row_scale", check_row_scale)):
        if (wanted is None and (name != "group" or args.group)) or (wanted and name in wanted):
            section(name, fn)
    if not args.no_bench:
        bench_deadline = t_start + args.budget_s + args.bench_s
        section("bench", lambda: gb.bench(
            [(4096, 14336), (8192, 28672)], [3, 4], ["mcg", "mul1"], list(gb.ISSUE_M),
            deadline=bench_deadline, log=log))
    report["seconds"] = time.time() - t_start
    write(report, args.out)
    summarize(report)
    return report


def summarize(report):
    s = report["sections"]
    for name, sec in s.items():
        if "error" in sec:
            log(f"SUMMARY {name}: ERROR {sec['error']}")
            continue
        res = sec["result"]
        if name == "decode_exact":
            ok = [r for r in res if r.get("dequant_bit_exact") and r.get("mma_bit_exact")
                  and r.get("dequant_rotated_ok")]
            log(f"SUMMARY decode_exact: {len(ok)}/{len(res)} configs bit-exact (both kernels; "
                f"rotated dequantize within {DEQUANT_ROTATED_TOL}); "
                f"token-tile kernels bit-exact in "
                f"{sum(bool(r.get('token_tiles_bit_exact')) for r in res)}/{len(res)}")
        elif name in ("gemm", "group", "row_linear"):
            # a {"skipped": "budget"} row marks cases the time budget left out: not failures
            run = [r for r in res if "skipped" not in r]
            ok = [r for r in run if r.get("ok")]
            left = f"; {len(res) - len(run)} left out by --budget-s" if len(run) < len(res) else ""
            worst = max((r.get("rel_l2", 0) for r in ok), default=None)
            log(f"SUMMARY {name}: {len(ok)}/{len(run)} cases rel_l2<=1e-3 and no NaN; "
                f"worst passing rel_l2={worst}{left}")
        elif name in ("dispatch", "row_scale"):
            log(f"SUMMARY {name}: {res}")
        elif name == "bench":
            log(f"SUMMARY bench: {len(res)} rows")


def write(report, path):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


# ---------------------------------------------------------------------------------------------


def run_memcheck(kind: str) -> int:
    """One small configuration per plan (and a linear group; "row": one token through the row
    linear, a group with a bias and a single linear), for compute-sanitizer memcheck."""
    if kind == "row":
        k, members = 1024, (512, 256, 256)
        ws = [gb.random_weight(k, n, 4, "mcg", seed=i) for i, n in enumerate(members)]
        bias0 = jnp.asarray(np.random.default_rng(7).standard_normal(members[0]), jnp.float16)
        ws[0] = type(ws[0])(ws[0].trellis, ws[0].suh, ws[0].svh, bias0, "mcg", 4, k, members[0])
        w1 = gb.random_weight(k, 384, 3, "mul1", seed=5)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, k)), jnp.float32)
        bad = 0
        for name, target, n in (("group", ws, sum(members)), ("single", w1, 384)):
            cfg = tg._row_linear_config(target, select_plan(1, k, n, force="decode"))
            y = np.asarray(jax.jit(lambda x, t: tg.row_linear(x, t, cfg, poison=True))(x, target))
            refs = [linear_reference(x, w.trellis, w.suh, w.svh, w.codebook, w.bias)
                    for w in (target if isinstance(target, list) else [target])]
            ref = np.concatenate([np.asarray(r) for r in refs], axis=1)
            rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            log(f"memcheck run row {name}: splits={cfg.mma.splits} rel_l2={rel:.3g} "
                f"finite={np.isfinite(y).all()}")
            bad += not rel < 1e-3
        return 1 if bad else 0
    if kind == "group":     # the group kernel alone in the jitted program, references eagerly
        k, members, m = 1024, (512, 256, 256), 5
        ws = [gb.random_weight(k, n, 3, "mcg", seed=i) for i, n in enumerate(members)]
        bias0 = jnp.asarray(np.random.default_rng(7).standard_normal(members[0]), jnp.float16)
        ws[0] = type(ws[0])(ws[0].trellis, ws[0].suh, ws[0].svh, bias0, "mcg", 3, k, members[0])
        plan = select_plan(m, k, sum(members), force="decode")
        x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.float32)
        y = np.asarray(jax.jit(lambda x, ws: tg.trellis_matmul_group(x, ws, plan))(x, ws))
        ref = np.concatenate([np.asarray(linear_reference(x, w.trellis, w.suh, w.svh,
                                                          w.codebook, w.bias)) for w in ws],
                             axis=1)
        rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        log(f"memcheck run group: m={m} members={members} plan={plan} rel_l2={rel:.3g} "
            f"finite={np.isfinite(y).all()}")
        return 0 if rel < 1e-3 else 1
    # decode: m = 5, and one token through the three calls (the one-token layout: the row
    # linear off, as past its size gate)
    k, n = 1024, 512
    w = gb.random_weight(k, n, 3, "mcg")
    bad = 0
    # decode: m = 5 and 1; the token-tile plans: two token tiles (a padded one included)
    runs = {"decode": [(5, "decode"), (1, "decode"), (5, "decode_ring"), (1, "decode_ring")],
            "prefill": [(40, "prefill")],
            "tiles": [(200, "tiles")],
            "wgmma": [(200, "wgmma"), (200, "wgmma_tight"), (200, "wgmma_fused")]}[kind]
    for m, variant in runs:
        plan = forced_plan(m, k, n, variant)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.float32)
        with env_var(tg.ROW_LINEAR_ENV, "0" if m == 1 else "1"):
            y = np.asarray(jax.jit(lambda x, w: tg.trellis_matmul_gpu(x, w, plan=plan))(x, w))
        ref = np.asarray(linear_reference(x, w.trellis, w.suh, w.svh, w.codebook))
        rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        log(f"memcheck run {kind}: m={m} plan={plan} rel_l2={rel:.3g} "
            f"finite={np.isfinite(y).all()}")
        bad += rel >= 1e-3
    return int(bad > 0)


def dump_sass(outdir: str, caps=(0,), shapes=((4096, 14336),),
              configs=(("mcg", 3, 1), ("mul1", 4, 16))) -> int:
    """Compile representative kernels with cute.compile (each with every register cap in
    ``caps``, MmaConfig.min_ctas), save cubins and cuobjdump SASS with register counts."""
    import subprocess

    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from exl3_jax.ffi.trellis_geometry import lane_geometry
    from exl3_jax.ffi.trellis_mma import MmaConfig, launch_trellis_mma

    os.makedirs(outdir, exist_ok=True)
    texts = []
    for (k, n), (cb, K, m), cap in itertools.product(shapes, configs, caps):
        plan = select_plan(m, k, n, force="decode")
        cfg = MmaConfig(cb, K, -(-m // plan.m_tile), k, n, plan.m_tile, plan.n_tiles,
                        plan.warps, plan.splits, plan.unroll, min_ctas=cap,
                        one_token=m == 1).validate()
        words = lane_geometry(K).words
        x_words = tg.x_rows(cfg) * k // (2 if cfg.x_layout in ("rows", "quads") else 1)
        fx = make_fake_compact_tensor(cutlass.Uint32, (x_words,), assumed_align=16)
        fw = make_fake_compact_tensor(cutlass.Uint32, (k // 16 * n // 16 * words,),
                                      assumed_align=16)
        fo = make_fake_compact_tensor(cutlass.Float32, (cfg.splits * cfg.m_pad * n,),
                                      assumed_align=16)
        c = cute.compile(launch_trellis_mma, cuda.CUstream(0), fx, fw, fo, cfg=cfg,
                         options="--keep-ptx --keep-cubin")
        path = os.path.join(outdir, f"mma_{k}x{n}_{cb}_K{K}_m{m}_cap{cap}.cubin")
        with open(path, "wb") as f:
            f.write(c.__cubin__)
        r = subprocess.run(["cuobjdump", "-sass", "-res-usage", path], capture_output=True,
                           text=True)
        regs = re.findall(r"REG:(\d+)", r.stdout)
        log(f"{k}x{n} {cb} K={K} m={m} min_ctas={cap}: registers {regs}")
        texts.append(f"==== {cb} K={K} m={m} cfg={cfg}\n{r.stdout}\n{r.stderr}")
    with open(os.path.join(outdir, "sass.txt"), "w") as f:
        f.write("\n".join(texts))
    log(f"sass written to {outdir}/sass.txt")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="stop starting new gemm configs after this many seconds")
    p.add_argument("--bench-s", type=float, default=150.0, help="extra seconds for the bench")
    p.add_argument("--quick", action="store_true", help="8 representative configs only")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--group", action="store_true", help="also validate linear groups")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of decode_exact,row_linear,group,gemm,dispatch,"
                        "row_scale (default: all; group only with --group)")
    p.add_argument("--m", default=None, help="gemm section's m values (default: the issue's)")
    p.add_argument("--row-shapes", default=None,
                   help="row_linear section's shapes, 'KxN[:m1+m2+..],...' (default: Llama-3-8B "
                        "and test shapes)")
    p.add_argument("--kinds", default=None,
                   help="plan kinds of the gemm section and of decode_exact's token-tile "
                        "kernels, e.g. decode,prefill or tiles,wgmma,wgmma_tight,wgmma_fused "
                        "(default: every kind the device runs)")
    p.add_argument("--memcheck", choices=("decode", "prefill", "tiles", "wgmma", "group", "row"))
    p.add_argument("--sass", metavar="DIR")
    p.add_argument("--sass-caps", default="0", help="register caps (min CTAs per SM) for --sass")
    p.add_argument("--sass-shapes", default="4096x14336")
    p.add_argument("--sass-configs", default="mcg3:1,mul14:16",
                   help="codebook K : m, e.g. mcg3:1 (K one digit)")
    a = p.parse_args(argv)
    if a.memcheck:
        return run_memcheck(a.memcheck)
    if a.sass:
        configs = [(c.split(":")[0][:-1], int(c.split(":")[0][-1]), int(c.split(":")[1]))
                   for c in a.sass_configs.split(",")]
        shapes = [tuple(map(int, s.split("x"))) for s in a.sass_shapes.split(",")]
        return dump_sass(a.sass, [int(c) for c in a.sass_caps.split(",")], shapes, configs)
    rep = run_validation(a)
    bad = [n for n, s in rep["sections"].items() if "error" in s]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
