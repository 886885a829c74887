"""Call 64 (session 33): the route-packing kernel (ffi/route_pack.py) on the GPU, one process:
its tables against XLA's counting sort (moe_routing.pack_routes, exactly) at the geometries'
sizes with invalid ids mixed in; the packing alone, kernel vs XLA (every table); the
Qwen3-30B-A3B layer with its packing (bench.routes_of_call) under each, alternated twice. One
JSON line per row.

  python scripts/gpu_calls/call64_pack_kernel.py [--m 8,32,128,512,1024,4096]
      [--layer-m 8,128,1024,4096]
"""
import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_moe as tm
from exl3_jax.ffi.route_pack import pack_routes_gpu
from exl3_jax.ops.moe_routing import pack_routes

ap = argparse.ArgumentParser()
ap.add_argument("--m", default="8,32,128,512,1024,4096")
ap.add_argument("--layer-m", default="8,128,1024,4096")
args = ap.parse_args()
packs = {"kernel": pack_routes_gpu, "xla": pack_routes}
T = lambda f, *a: round(1e6 * gb.time_in_loop(f, a, iters=64, reps=3), 2)  # noqa: E731
rng = np.random.default_rng(0)

# 1. Tables, exactly: Qwen3 (E 128), GLM-5.2 TP4 (E 256) and a 1000-expert case, ids -1 and
# out of range mixed in.
for m in [int(v) for v in args.m.split(",")]:
    for E, top_k in ((128, 8), (256, 8), (1000, 4)):
        ids = np.array(gb.random_topk(m, E, top_k, seed=m)[0])
        ids[rng.random(ids.shape) < 0.03] = -1
        ids[rng.random(ids.shape) < 0.01] = E + 5
        plan = tm.plan_for(m, top_k, E, 2048, 768, "prefill")
        got, want = (jax.jit(lambda i, f=f: f(i, E, plan.block_m))(jnp.asarray(ids))
                     for f in packs.values())
        print(json.dumps(dict(check="tables", m=m, E=E, top_k=top_k, block_m=plan.block_m,
                              equal=all(bool(jnp.array_equal(a, b)) for a, b in zip(
                                  jax.tree.leaves(got), jax.tree.leaves(want))))), flush=True)

# 2-3. Times (Qwen3-30B-A3B, auto plans).
H, I, E, top_k = gb.MOE_GEOMETRIES["qwen3-30b-a3b"]
w13, down = gb.random_moe_weights(H, I, E, 4, "mcg")
for m in [int(v) for v in args.m.split(",")]:
    ids, wts = gb.random_topk(m, E, top_k, seed=m)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, H)), jnp.bfloat16)
    plan = tm.plan_for(m, top_k, E, H, I)
    row = dict(check="times", m=m, plan=plan.kind, packing=plan.packing, block_m=plan.block_m)
    if plan.packing != "sorted":
        print(json.dumps(row | {"skipped": "per-route packing"}), flush=True)
        continue
    for rep in range(2):
        for k, f in packs.items():
            row.setdefault(f"pack_{k}_us", []).append(T(lambda i, f=f: jnp.concatenate(
                [a.ravel() for a in jax.tree.leaves(f(i, E, plan.block_m))]), ids))
            if str(m) in args.layer_m.split(","):
                os.environ[tm.PACK_ENV] = k          # read by pack_for at trace time
                row.setdefault(f"layer_{k}_us", []).append(T(lambda x: tm.moe_gpu(
                    x, gb.routes_of_call(x, ids), wts, w13, down), x))
    print(json.dumps(row), flush=True)
