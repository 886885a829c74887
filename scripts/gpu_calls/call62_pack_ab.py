"""Call 62 (session 33): the route packing (exl3_jax.ops.moe_routing.pack_routes) of this tree
against an older moe_routing.py (--old, e.g. `git show 10e054d:exl3_jax/ops/moe_routing.py`), on
the GPU, one process: the tables equal (exactly), the packing alone (all its tables; also this
tree's "count" method forced) and, at --layer-m, the Qwen3-30B-A3B layer (auto plan, K4 mcg)
with each, alternated twice; one JSON line per m. A record: it ran on the session's
intermediate tree, whose pack_routes still took method=; main's takes none (one packing).

  python scripts/gpu_calls/call62_pack_ab.py --old /tmp/old_routing.py --m 4096,1024,512,128,64
"""
import argparse
import functools
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_moe as tm
from exl3_jax.ops import moe_routing

ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True)
ap.add_argument("--m", default="4096,1024,512,128,64")
ap.add_argument("--layer-m", default="4096,1024", help="token counts that also time the layer")
args = ap.parse_args()
spec = importlib.util.spec_from_file_location("old_routing", args.old)
old = importlib.util.module_from_spec(spec)
sys.modules["old_routing"] = old          # its dataclasses look their module up
spec.loader.exec_module(old)
packs = {"new": moe_routing.pack_routes, "old": old.pack_routes,
         "count": functools.partial(moe_routing.pack_routes, method="count")}

H, I, E, top_k = gb.MOE_GEOMETRIES["qwen3-30b-a3b"]
w13, down = gb.random_moe_weights(H, I, E, 4, "mcg")
T = lambda f, *a: round(1e6 * gb.time_in_loop(f, a, iters=64, reps=3), 2)  # noqa: E731
for m in [int(v) for v in args.m.split(",")]:
    ids, wts = gb.random_topk(m, E, top_k, seed=m)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, H)), jnp.bfloat16)
    plan = tm.plan_for(m, top_k, E, H, I)
    row = dict(m=m, plan=plan.kind, packing=plan.packing, block_m=plan.block_m)
    if plan.packing != "sorted":
        print(json.dumps(row | {"skipped": "per-route packing"}), flush=True)
        continue
    tabs = {k: jax.jit(lambda i, f=f: f(i, E, plan.block_m))(ids) for k, f in packs.items()}
    row["equal"] = all(bool(jnp.array_equal(a, b)) for k in ("new", "count") for a, b in
                       zip(jax.tree.leaves(tabs[k]), jax.tree.leaves(tabs["old"])))
    for rep in range(2):
        for k, f in packs.items():
            row.setdefault(f"pack_{k}_us", []).append(T(lambda i, f=f: jnp.concatenate(
                [a.ravel() for a in jax.tree.leaves(f(i, E, plan.block_m))]), ids))
            if k == "count" or str(m) not in args.layer_m.split(","):
                continue
            tm.pack_routes = f             # what moe_gpu's packing (kernel_routes) calls
            row.setdefault(f"layer_{k}_us", []).append(
                T(lambda x: tm.moe_gpu(x, ids, wts, w13, down), x))
        tm.pack_routes = packs["new"]
    print(json.dumps(row), flush=True)
