"""The GPU kernels' own PTX run on the CPU (EXL3_JAX_EMULATE=1, ffi/emulate.py): the production
dispatch on fresh random inputs, the rings and packing kernels against direct references, planted
bugs the interpreter must catch, and the TP logits check (the H200 validation scripts themselves:
test_emulated_validation.py).

What this proves without a GPU: every plan's kernels (decode, row linear, groups, prefill
dequantize, the tiles and wgmma token-tile kernels with their weight-ring and fused-epilogue
options, the Hadamard kernels) decode bit-exactly, compute the GEMM within the issue's bound,
write every output element, stay inside their buffers, and keep the synchronisation rules the
interpreter checks (shared-memory races, wgmma and cp.async ordering). What it cannot prove:
speed, and the hardware's reading of the ISA where it differs from the interpreter's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers_cute import ROOT, emulated_env, needs_cutlass

pytestmark = pytest.mark.long


def _emulated(argv, timeout, arch="sm_90a", env=None):
    proc = subprocess.run([sys.executable, *argv], env=dict(emulated_env(arch), **(env or {})),
                          capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT / "scripts")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# The dispatch on inputs drawn fresh: x @ W + b vs the fp32 reference at the issue's bound.
DISPATCH = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.trellis import Exl3Weight, linear_reference
from exl3_jax.format.spec import width_from_rate
rng = np.random.default_rng(int(sys.argv[1]))
for cb, K, k, n, m, plan in json.loads(sys.argv[2]):
    trellis = rng.integers(-32768, 32768, size=(k // 16, n // 16, width_from_rate(K)))
    w = Exl3Weight.create(jnp.asarray(trellis.astype(np.int16)),
                          jnp.asarray(rng.choice([-1.0, 1.0], size=k).astype(np.float16)),
                          jnp.asarray((rng.uniform(0.5, 1.5, size=n) / 64).astype(np.float16)),
                          cb, jnp.asarray(rng.standard_normal(n).astype(np.float16)))
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x: tg.trellis_matmul_gpu(x, w, plan=plan))(x))
    ref = np.asarray(linear_reference(x.astype(jnp.float32), w.trellis, w.suh, w.svh, cb,
                                      w.bias), np.float64)
    print(json.dumps(dict(case=[cb, K, k, n, m, plan], nonfinite=int((~np.isfinite(y)).sum()),
                          rel=float(np.linalg.norm(y - ref) / np.linalg.norm(ref)))), flush=True)
"""

CASES = [("mcg", 4, 256, 256, 1, None), ("mul1", 3.5, 512, 256, 1, None),
         ("3inst", 6, 256, 384, 5, None), ("mul1", 2, 256, 256, 16, None),
         ("mcg", 3, 512, 256, 12, None), ("3inst", 4, 256, 256, 24, "decode"),
         ("mcg", 3, 512, 256, 32, None), ("mcg", 5, 256, 256, 40, "prefill"),
         ("mul1", 4, 256, 256, 70, "tiles"), ("mcg", 4, 512, 256, 100, "wgmma"),
         ("3inst", 3, 256, 256, 200, "wgmma")]


@needs_cutlass
@pytest.mark.parametrize("arch,env,ms", [
    ("sm_90a", {}, (1, 200)), ("sm_120a", {}, (1, 200)),
    ("sm_90a", {"EXL3_JAX_PAIR_FRAGMENTS": "0"}, (9, 32)),
    ("sm_90a", {"EXL3_JAX_SPLIT_GROUPS": "3"}, (9, 24)),
    ("sm_90a", {"EXL3_JAX_WGMMA": "256,2,1"}, (200, 200))])
def test_dispatch_on_fresh_inputs_through_the_emulated_kernels(rng, arch, env, ms):
    """Both targets' PTX (sm_120a: the RTX PRO 6000's, no wgmma) on inputs drawn fresh; the
    packed kernels' B words as row-major pairs (the opt-out of the "pairs" layout), 3inst /
    mcg split pairs over 2-3 token groups (the opt-in split_groups) on the m they serve, and
    the wgmma plan's 256-token tile over 200 rows (padded, the fused epilogue)."""
    cases = [c for c in CASES if (arch == "sm_90a" or c[-1] != "wgmma")
             and ms[0] <= c[4] <= ms[1]]
    seed = int(rng.integers(2**31))
    proc = _emulated(["-c", DISPATCH, str(seed), json.dumps(cases)], timeout=900, arch=arch,
                     env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    for row in rows:
        assert row["nonfinite"] == 0 and row["rel"] <= 1e-3, row


# The input transform kernel against the spec's arithmetic, bit for bit: fp16(had128(x * suh /
# s)) with hadamard128(exact=True) (fp32 butterflies in the reference stage order, one multiply
# by the fp32 1/sqrt(128)), s the kernel's row scale. Every Hadamard kernel shares
# cute_ops.hadamard128_lane (the MoE glue, FC1's rotate-in, the output transforms), so a change
# of its stage order or rounding (e.g. the fma form of the shuffle stages) shows here. Rows
# span magnitudes 1e-3..1e6, so some take a row scale s > 1.
HADAMARD_IN = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.trellis import hadamard128
rng = np.random.default_rng(int(sys.argv[1]))
for m, k, dtype in json.loads(sys.argv[2]):
    x = jnp.asarray(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 6, (m, 1)), dtype)
    suh = jnp.asarray(rng.uniform(0.5, 2, k) * rng.choice([-1, 1], k), jnp.float16)
    xh, s = jax.jit(lambda x: tg.hadamard_in(x, suh, m_pad=m))(x)
    s = np.asarray(s)
    xs = np.asarray(x, np.float32) * np.asarray(suh, np.float32) / s[:, None]
    want = np.asarray(hadamard128(jnp.asarray(xs), exact=True)).astype(np.float16)
    got = np.asarray(xh).reshape(m, k)
    print(json.dumps(dict(case=[m, k, dtype], scaled=int((s > 1).sum()),
                          differ=int((got.view(np.uint16) != want.view(np.uint16)).sum()))))
"""


@needs_cutlass
def test_input_transform_kernel_is_the_spec_hadamard_bit_for_bit(rng):
    # A swap of two shuffle stages changes ~1 in 1600 fp32-input elements after the fp16
    # rounding (~10 of the 17k here); bf16 inputs stay exact in fp32 and show nothing.
    cases = [[16, 1024, "bfloat16"], [8, 2048, "float32"], [6, 384, "float16"],
             [5, 128, "float32"]]
    proc = _emulated(["-c", HADAMARD_IN, str(int(rng.integers(2**31))), json.dumps(cases)],
                     timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), proc.stdout[-2000:]
    assert sum(r["scaled"] for r in rows) > 0, rows      # the row-scale path ran too
    for row in rows:
        assert row["differ"] == 0, row


# The route-packing kernel (ffi/route_pack.py) on ids drawn fresh (-1 and out-of-range ids mixed
# in) against the loop-based NumPy oracle, table by table; then one MoE layer whose sorted plan
# packs with it (EXL3_JAX_MOE_PACK=kernel) against the packed reference.
PACK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from exl3_jax.ffi import emulate, trellis_moe as tm
from exl3_jax.ffi.route_pack import pack_routes_gpu
from exl3_jax.ops.moe_routing import pack_routes_numpy
import importlib
moe_ops = importlib.import_module("exl3_jax.ops.moe")
from exl3_jax.ffi.bench import random_moe_weights
rng = np.random.default_rng(int(sys.argv[1]))
cases, layer = json.loads(sys.argv[2]), json.loads(sys.argv[3])
for T, top_k, E, bm, pattern in cases:
    ids = rng.integers(-1, E, size=(T, top_k)).astype(np.int32)
    ids[rng.random((T, top_k)) < 0.05] = E + 7
    if pattern == "none":           # no route has an expert: no block in use
        ids[:] = -1
    elif pattern == "one":          # every valid route to one expert: its blocks are all
        ids[ids >= 0] = int(rng.integers(E))
    got = jax.jit(lambda i: pack_routes_gpu(i, E, bm))(jnp.asarray(ids))
    want = pack_routes_numpy(ids, E, bm)
    print(json.dumps(dict(case=[T, top_k, E, bm, pattern], equal={
        k: bool(np.array_equal(np.asarray(getattr(got, k)), v)) for k, v in want.items()})),
        flush=True)
if layer:
    T, top_k, E, H, I = layer
    w13, down = random_moe_weights(H, I, E, 4, "mcg", seed=int(rng.integers(2**31)))
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, (T, top_k)), jnp.float32)
    emulate.LAUNCH_LOG.clear()
    got = np.asarray(jax.jit(lambda x, i, w: tm.moe_gpu(x, i, w, w13, down, plan="prefill"))(
        x, ids, w))
    kernels = sorted({r["kernel"] for r in emulate.LAUNCH_LOG})
    ref = np.asarray(moe_ops.moe(x, ids, w, w13, down, backend="packed"), np.float64)
    print(json.dumps(dict(layer=layer, kernels=kernels, nonfinite=int((~np.isfinite(got)).sum()),
                          rel=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))),
          flush=True)
"""

# (T, top_k, E, block_m, pattern): one round of 32 lanes to three rounds per warp (2400
# routes) with ranks in registers, ten rounds with ranks through route_row (past REGISTER_ROUNDS),
# a non-power-of-two expert count (the scan's padding), experts that no route hits,
# every block size of the two plan families; no route with an expert, all routes to one.
PACK_CASES = [[1, 8, 128, 8, ""], [5, 2, 4, 8, ""], [40, 4, 8, 16, ""], [9, 3, 5, 48, ""],
              [64, 8, 16, 64, ""], [300, 8, 32, 128, ""], [130, 8, 1000, 8, ""],
              [200, 4, 100, 32, ""], [50, 4, 16, 16, "none"], [300, 4, 64, 32, "one"],
              [1200, 8, 64, 128, ""]]


@needs_cutlass
@pytest.mark.parametrize("arch,cases,layer", [
    ("sm_90a", PACK_CASES, [40, 2, 8, 256, 256]), ("sm_120a", PACK_CASES[:2], [])])
def test_route_packing_kernel_matches_the_numpy_packing(rng, arch, cases, layer):
    proc = _emulated(["-c", PACK, str(int(rng.integers(2**31))), json.dumps(cases),
                      json.dumps(layer)], timeout=900, arch=arch,
                     env={"EXL3_JAX_MOE_PACK": "kernel"})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases) + bool(layer), proc.stdout[-2000:]
    for row in rows[:len(cases)]:
        assert all(row["equal"].values()), row
    if layer:     # the layer's sorted plan packed by the kernel (its launch recorded)
        assert rows[-1]["nonfinite"] == 0 and rows[-1]["rel"] <= 2e-3, rows[-1]
        assert any("pack_routes" in k for k in rows[-1]["kernels"]), rows[-1]


# FC1 of per-route plans with its rotation shared by a thread-block cluster (each CTA rotates
# 1 / cluster of the row into every CTA's shared memory) against each CTA rotating the whole
# row itself (EXL3_JAX_MOE_CLUSTER=1): the same rounding of the same values, so bit for bit
# the same layer, and both at the reference's bound.
CLUSTER = """
import json, os, sys
import jax, numpy as np
sys.path.insert(0, %r)
import gpu_validate_moe as gv
from exl3_jax.ffi import emulate, trellis_moe as tm
from exl3_jax.ops.moe_plans import moe_plan
import importlib
moe_ops = importlib.import_module("exl3_jax.ops.moe")
rng = np.random.default_rng(int(sys.argv[1]))
for T, top_k, E, H, I, spec in json.loads(sys.argv[2]):
    w13, down = gv.random_moe(rng, E, H, I, 4, "mcg")
    x, ids, w = gv.draw_tokens(rng, T, H, top_k, E, invalid=0.2)
    ids = np.asarray(ids).copy()
    ids[0, 0] = rng.integers(E)          # at least one route with an expert: ref != 0
    plan = moe_plan(T, top_k, E, H, I, kind="decode", packing="per_route")
    outs, clusters = [], []
    for env in (spec, "1"):
        os.environ[tm.CLUSTER_ENV] = env
        emulate.LAUNCH_LOG.clear()
        outs.append(np.asarray(jax.jit(lambda x: tm.moe_gpu(x, ids, w, w13, down,
                                                            plan=plan))(x)))
        clusters.append(sorted({str(r.get("cluster")) for r in emulate.LAUNCH_LOG}))
    ref = np.asarray(moe_ops.moe(x, ids, w, w13, down, backend="packed"), np.float64)
    print(json.dumps(dict(case=[T, top_k, E, H, I, spec], clusters=clusters,
                          same=bool(np.array_equal(outs[0].view(np.uint32),
                                                   outs[1].view(np.uint32))),
                          nonfinite=int((~np.isfinite(outs[0])).sum()),
                          rel=float(np.linalg.norm(outs[0] - ref) / np.linalg.norm(ref)))),
          flush=True)
""" % str(ROOT / "scripts")

# (T, top_k, E, H, I, EXL3_JAX_MOE_CLUSTER): auto's 8 (8 row blocks, 8 n-tile CTAs), auto's
# 4 (12 n-tile CTAs), a forced 2; one and three tokens, invalid routes among them.
CLUSTER_CASES = [[1, 2, 8, 1024, 256, "auto"], [3, 2, 32, 512, 384, "auto"],
                 [1, 4, 16, 1024, 256, "2"]]


@needs_cutlass
def test_fc1_cluster_rotation_is_bitwise_the_per_cta_rotation(rng):
    proc = _emulated(["-c", CLUSTER, str(int(rng.integers(2**31))), json.dumps(CLUSTER_CASES)],
                     timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(CLUSTER_CASES), proc.stdout[-2000:]
    for row, want in zip(rows, ["(8, 1, 1)", "(4, 1, 1)", "(2, 1, 1)"]):
        assert want in row["clusters"][0] and row["clusters"][1] == ["None"], row
        assert row["same"] and row["nonfinite"] == 0 and row["rel"] <= 2e-3, row


@needs_cutlass
def test_issue_counts_see_the_cluster_rotation_remove_fc1_work():
    """scripts/emulated_issue_counts.py on a small per-route layer (clusters of 8): FC1 issues
    fewer warp-instructions with the shared rotation, and the other kernels exactly as many."""
    proc = _emulated(["emulated_issue_counts.py", "moe", "1,2,8,1024,256",
                      "--env", "EXL3_JAX_MOE_CLUSTER=1,auto"], timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    runs = {v: [r for r in rows if r.get("variant") == v] for v in ("1", "auto")}
    assert len(runs["1"]) == len(runs["auto"]) == 4, proc.stdout[-2000:]
    for off, on in zip(runs["1"], runs["auto"]):
        assert off["kernel"] == on["kernel"] and off["issued"] > 0, (off, on)
        if on["cluster"]:                 # FC1: 8 CTAs a cluster, less issued
            assert on["cluster"] == [8, 1, 1] and on["issued"] < 0.97 * off["issued"], on
        else:
            assert on["issued"] == off["issued"], (off, on)


# The decode kernel with its loads through the cp.async ring (MmaConfig.ring) against the same
# plan with direct loads: the same chunks per warp in the same order, so bit for bit the same.
RING = """
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ffi.bench import random_weight
from exl3_jax.ops.plans import select_plan
from exl3_jax.trellis import linear_reference
rng = np.random.default_rng(int(sys.argv[1]))
for cb, K, k, n, m, ring, unroll, splits, *members in json.loads(sys.argv[2]):
    ws = [random_weight(k, ni, K, cb, seed=int(rng.integers(2**31))) for ni in members or [n]]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    direct = dataclasses.replace(select_plan(m, k, n, force="decode"), unroll=unroll,
                                 splits=splits)
    plan = dataclasses.replace(direct, ring=ring)
    cfg = tg._group_config(ws, plan) if members else tg._mma_config(ws[0], plan)
    assert cfg.ring == ring, cfg
    if members:      # a linear group (q/k/v-like): one launch over the members' tiles
        f = lambda x, p: tg.trellis_matmul_group(x, ws, p)
    else:
        f = lambda x, p: tg.trellis_matmul_gpu(x, ws[0], plan=p)
    y0, y1 = (np.asarray(jax.jit(f, static_argnums=1)(x, p)) for p in (direct, plan))
    ref = np.concatenate([np.asarray(linear_reference(x, w.trellis, w.suh, w.svh, cb, w.bias),
                                     np.float64) for w in ws], axis=1)
    print(json.dumps(dict(case=[cb, K, k, n, m, ring, unroll, splits], chunks=cfg.warp_chunks,
                          layout=cfg.x_layout, same=bool((y0 == y1).all()),
                          nonfinite=int((~np.isfinite(y1)).sum()),
                          rel=float(np.linalg.norm(y1 - ref) / np.linalg.norm(ref)))),
          flush=True)
"""

# (codebook, K, k, n, m, ring slots, unroll, splits): one token ("token" layout) and 2-8 tokens
# ("fragments"), chunks per warp from 1 (fewer than the ring's lead) to 4 (wrapping around),
# weight pieces that do not divide over the lanes (K = 3, 2.5, 3.5), mul1's affine epilogue,
# linear groups (members' n last: one launch, each member's tiles and activation segment).
# Ring slots 0: the direct loads alone (checked against the reference only) in the m = 16
# plan's 8-step chunks, which the dispatch cases' small shapes never reach (split pairs for
# mcg K4, packed pairs for mul1). Then mul1's production ring for 2-8 tokens past 2^26
# weights (plans.decode_plan; 8 tokens' B fragments halve its 8-step chunks to 4), and packed
# pairs through the ring (the "pairs" layout: 2 and 3 token groups, 3 of them with padded rows).
RING_CASES = [("mcg", 4, 1024, 256, 1, 3, 2, 1), ("mul1", 4, 1024, 256, 1, 2, 4, 1),
              ("3inst", 3, 512, 256, 1, 3, 1, 1), ("mcg", 3, 1024, 256, 5, 3, 2, 1),
              ("mul1", 2.5, 512, 256, 1, 4, 1, 4), ("mul1", 3.5, 256, 256, 1, 3, 1, 1),
              ("mcg", 4, 512, 256, 16, 2, 1, 1), ("mcg", 4, 512, 512, 1, 3, 2, 1, 256, 128, 128),
              ("mul1", 4, 512, 512, 5, 2, 1, 1, 256, 256),
              ("mcg", 4, 1024, 256, 16, 0, 8, 1), ("mul1", 3, 1024, 256, 16, 0, 8, 1),
              ("mul1", 3, 1024, 256, 6, 3, 4, 1),
              ("mul1", 4, 1024, 256, 16, 3, 2, 1), ("mcg", 3, 512, 256, 20, 2, 1, 1)]


# The byte-sum mul1 kernels (EXL3_JAX_MUL1_BYTESUM=1, layout "quads"): one token's row through
# the ring (K4's two-pipe extraction, K3's byte windows, a half rate, a linear group), 5 and 16
# tokens' blocks through it, and 16 tokens' with direct loads.
BYTESUM_RING_CASES = [("mul1", 4, 1024, 256, 1, 3, 2, 1), ("mul1", 3, 512, 256, 1, 2, 4, 1),
                      ("mul1", 2.5, 512, 256, 1, 4, 1, 4), ("mul1", 4, 1024, 256, 16, 0, 8, 1),
                      ("mul1", 4, 512, 512, 1, 3, 2, 1, 256, 256),
                      ("mul1", 4, 1024, 256, 5, 3, 2, 1), ("mul1", 3, 1024, 256, 16, 2, 1, 1)]


@needs_cutlass
def test_mul1_bytesum_ring_equals_direct_loads(rng):
    proc = _emulated(["-c", RING, str(int(rng.integers(2**31))), json.dumps(BYTESUM_RING_CASES)],
                     timeout=900, env={"EXL3_JAX_ROW_LINEAR": "0", "EXL3_JAX_MUL1_BYTESUM": "1"})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(BYTESUM_RING_CASES) and {r["layout"] for r in rows} == {"quads"}
    for row in rows:
        assert row["same"] and row["nonfinite"] == 0 and row["rel"] <= 1e-3, row


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_decode_ring_equals_direct_loads(rng, arch):
    seed = int(rng.integers(2**31))
    cases = RING_CASES if arch == "sm_90a" else RING_CASES[:2]
    proc = _emulated(["-c", RING, str(seed), json.dumps(cases)], timeout=900, arch=arch,
                     env={"EXL3_JAX_ROW_LINEAR": "0"})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    assert {r["layout"] for r in rows if r["case"][5]} == ({"token", "fragments", "pairs"}
                                                          if arch == "sm_90a" else {"token"})
    assert {r["chunks"] for r in rows} >= ({1, 2, 4} if arch == "sm_90a" else {2, 4}), rows
    for row in rows:
        assert row["same"] and row["rel"] <= 1e-3, row


# mul1 split pairs over 1-4 token groups (EXL3_JAX_SPLIT_GROUPS): the affine epilogue adds
# MUL1_RESIDUAL times each token's sum of its rotated row, summed by one extra MMA per k16
# step and token group. Random rows make that term small (a group reading group 0's sums
# stays within 1e-3), so each token's rotated row here is nearly constant per 128-block (x *
# suh = c_t sqrt(128) e_0 in every block, plus a little noise): then the term is a
# token-specific share of every output, and a wrong sum is off by percents.
AFFINE = """
import json, sys
import jax.numpy as jnp, numpy as np
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ffi.bench import random_weight
from exl3_jax.ops.plans import select_plan
from exl3_jax.trellis import linear_reference
rng = np.random.default_rng(int(sys.argv[1]))
for K, k, n, m in json.loads(sys.argv[2]):
    w = random_weight(k, n, K, "mul1", seed=int(rng.integers(2**31)))
    plan = select_plan(m, k, n, force="decode")
    cfg = tg._mma_config(w, plan)
    c = rng.uniform(0.5, 2.0, size=(m, 1)) * rng.choice([-1.0, 1.0], size=(m, 1))
    x = rng.standard_normal((m, k)) * 0.05
    x[:, ::128] += c * np.sqrt(128) / np.asarray(w.suh, np.float64)[::128]
    x = jnp.asarray(x, jnp.float32)
    y = np.asarray(tg.trellis_matmul_gpu(x, w, plan=plan))
    ref = np.asarray(linear_reference(x, w.trellis, w.suh, w.svh, "mul1", w.bias), np.float64)
    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    print(json.dumps(dict(case=[K, k, n, m], split=cfg.split_pairs, layout=cfg.x_layout,
                          groups=cfg.m_groups,
                          nonfinite=int((~np.isfinite(y)).sum()), rel=rel)), flush=True)
    if rel > 1e-3:
        sys.exit(f"mul1 affine sums off: {[K, k, n, m]} rel {rel:.2e}")
"""


@needs_cutlass
@pytest.mark.parametrize("arch,bytesum", [("sm_90a", False), ("sm_120a", False),
                                          ("sm_90a", True)])
def test_mul1_split_pairs_sum_each_token_groups_activations(rng, arch, bytesum):
    """Split pairs over 1-4 token groups, or (bytesum) the byte-sum kernels, which take the
    same sums of x from their packed B pairs (one token through the decode kernel itself, the
    row linear off)."""
    cases = [(4, 256, 256, 1), (3, 256, 256, 5), (4, 256, 256, 16), (3, 512, 256, 24),
             (2, 256, 256, 32)]
    env = ({"EXL3_JAX_MUL1_BYTESUM": "1", "EXL3_JAX_ROW_LINEAR": "0"} if bytesum
           else {"EXL3_JAX_SPLIT_GROUPS": "4"})
    proc = _emulated(["-c", AFFINE, str(int(rng.integers(2**31))), json.dumps(cases)],
                     timeout=900, arch=arch, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["groups"] for r in rows] == [1, 1, 2, 3, 4]
    assert {(r["split"], r["layout"]) for r in rows} == (
        {(False, "quads")} if bytesum else {(True, "token"), (True, "fragments")})
    for row in rows:
        assert row["nonfinite"] == 0 and row["rel"] <= 1e-3, row


MOE = """
import sys
import jax, numpy as np
sys.path.insert(0, %r)
import gpu_validate_moe as gv
import ffi.trellis_moe as tm
rng = np.random.default_rng(1)
w13, down = gv.random_moe(rng, 8, 512, 256, 4, "mcg")
x, ids, w = gv.draw_tokens(rng, 3, 512, 2, 8)
print(np.asarray(jax.jit(lambda x: tm.moe_gpu(x, ids, w, w13, down))(x)).shape)
""" % str(ROOT / "scripts")

# name -> (kernel file, its text, the text without the synchronisation, driver script, extra
# environment, driver arguments, the error the interpreter must report)
BUGS = {
    "decode-ring-read-before-its-copies-land": (
        "trellis_mma.py",
        "        cp_async_wait(cfg.ring - 2)                # chunk c's copies by this lane"
        " have landed\n",
        "",
        RING.replace("from exl3_jax.ffi import trellis_gemm as tg",
                     "import ffi.trellis_gemm as tg"),
        {"EXL3_JAX_ROW_LINEAR": "0"}, ["1", json.dumps([("mcg", 4, 1024, 256, 1, 3, 2, 1)])],
        "shared bytes accessed before their cp.async landed"),
    "wgmma-without-stage-barrier": (
        "trellis_wgmma.py",
        "        cp_async_wait(1)                          # chunk c + 1 has landed\n"
        "        proxy_fence_shared()\n        cute.arch.sync_threads()\n",
        "        cp_async_wait(1)                          # chunk c + 1 has landed\n"
        "        proxy_fence_shared()\n",
        DISPATCH.replace("from exl3_jax.ffi import trellis_gemm as tg",
                         "import ffi.trellis_gemm as tg"),
        # one K-split (4 chunks of 64 k), the partials epilogue
        dict(EXL3_JAX_WGMMA="128,2,1,0"),
        ["1", json.dumps([("mcg", 4, 256, 256, 100, "wgmma")])],
        "wgmma reads bytes written since the CTA's last barrier"),
    "moe-fc2-row-read-before-the-copy-barrier": (
        # a per-route plan (one token, top-2 of 8) whose FC2 warps read words other warps
        # copied (I = 768: 4 warps of one k16 step per chunk)
        "trellis_moe.py",
        "                    xs[first + idx] = xw[src + idx]\n"
        "            cute.arch.sync_threads()\n",
        "                    xs[first + idx] = xw[src + idx]\n",
        MOE.replace("draw_tokens(rng, 3,", "draw_tokens(rng, 1,").replace(
            "random_moe(rng, 8, 512, 256,", "random_moe(rng, 8, 512, 768,"), {}, [],
        "shared-memory race"),
    "moe-fc1-cluster-row-read-before-the-cluster-barrier": (
        # FC1's warps read the rotated row that other CTAs of its cluster stored into its
        # shared memory (per-route, one token, top-2 of 8: clusters of 4)
        "trellis_moe.py",
        "                cluster_arrive()\n                cluster_wait()\n",
        "",
        MOE.replace("draw_tokens(rng, 3,", "draw_tokens(rng, 1,"),
        {"EXL3_JAX_MOE_CLUSTER": "auto"}, [], "shared-memory race"),
    "mul1-token-groups-share-group-0s-sums": (
        # not a synchronisation: the numbers go wrong, and AFFINE's inputs make it show
        "trellis_mma.py",
        "        own = (xsum[4 * g] + xsum[4 * g + 2])",
        "        own = (xsum[0] + xsum[2])",
        AFFINE.replace("from exl3_jax.ffi import trellis_gemm as tg",
                       "import ffi.trellis_gemm as tg"),
        {"EXL3_JAX_SPLIT_GROUPS": "2"}, ["1", json.dumps([(4, 256, 256, 16)])],
        "mul1 affine sums off"),
    "mul1-bytesum-with-split-pairs-halving": (
        # the byte-sum kernels' B pairs hold each x once: halving their sums (as split pairs'
        # words, which hold it twice, need) is a wrong codebook bias
        "trellis_mma.py",
        "    bias = float(MUL1_K_BIAS) if cfg.bytesum else 0.5 * float(MUL1_RESIDUAL)",
        "    bias = 0.5 * float(MUL1_K_BIAS) if cfg.bytesum else 0.5 * float(MUL1_RESIDUAL)",
        AFFINE.replace("from exl3_jax.ffi import trellis_gemm as tg",
                       "import ffi.trellis_gemm as tg"),
        {"EXL3_JAX_MUL1_BYTESUM": "1"}, ["1", json.dumps([(4, 256, 256, 16)])],
        "mul1 affine sums off"),
    "moe-combine-without-pdl-wait": (
        "trellis_moe.py",
        "    cute.arch.griddepcontrol_wait()            # FC2's partials, activation's row scales\n",
        "",
        MOE, {}, [],
        "before griddepcontrol.wait, racing launch"),
}


@needs_cutlass
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_kernel_bug_is_caught_by_the_emulation(tmp_path, bug):
    """The checks can fail: a kernel source edited to drop one synchronisation (rebuilt by the
    DSL; one entry instead reads the wrong token group's sums) is reported, though its numbers
    may still come out right (the interpreter runs
    warps in lockstep and launches in order; only the ordering checks see it). The same
    driver on the unedited source passes."""
    name, old, new, driver, env, argv, message = BUGS[bug]
    for broken in (False, True):
        tree = tmp_path / ("broken" if broken else "intact")
        (tree / "ffi").mkdir(parents=True)
        for f in (ROOT / "ffi").glob("*.py"):
            text = f.read_text()
            if f.name == name:
                assert text.count(old) == 1, bug
                text = text.replace(old, new) if broken else text
            (tree / "ffi" / f.name).write_text(text)
        code = "import sys; sys.path.insert(0, %r)\n" % str(tree) + driver
        proc = subprocess.run([sys.executable, "-c", code, *argv], env=dict(emulated_env(), **env),
                              capture_output=True, text=True, timeout=900, cwd=tree)
        if broken:
            assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
        else:
            assert proc.returncode == 0, proc.stderr[-3000:]
            for row in (json.loads(line) for line in proc.stdout.splitlines()
                        if line.startswith("{")):          # the dispatch driver's results
                assert row["nonfinite"] == 0 and row["rel"] <= 1e-3, row


@needs_cutlass
def test_parallel_runs_with_the_emulated_kernels():
    """Issue #8's logits check (tests/test_parallel_generate_gpu.py, written for 2 GPUs) with
    the GPU kernels inside shard_map on two simulated CPU devices: a dense model and a MoE
    model (expert-parallel and tensor-split) at TP = 2 against one device."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_parallel_generate_gpu.py"],
                          env=dict(emulated_env(), XLA_FLAGS=flags), cwd=ROOT / "tests",
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-2000:]
