"""Sweep the grouped MoE GEMMs' decode-plan CTA shapes on a CUDA machine; one JSON report.

  python scripts/gpu_moe_plan_sweep.py --out $OUT/sweep.json [--geometries qwen3-30b-a3b]
        [--m 1] [--budget-s 240] [--overrides 'fc2=2,8,1,2|fc1=2,8,2,4']
  python scripts/gpu_moe_plan_sweep.py --env EXL3_JAX_MOE_TAILS --overrides '0|1|0|1'
        # any other switch of the layer, its settings timed in turn in one process
  python scripts/gpu_moe_plan_sweep.py --once qwen3-30b-a3b --m 1   # a few plain layer calls
                                                                    # (for ncu)

For each geometry and token count: the layer (exl3_jax.ffi.trellis_moe.moe_gpu, K4 mcg, the
bench's random experts and routes) with the plan's own CTA shapes, then with each one-step
neighbour of FC1's shape (n_tiles, warps, splits, unroll; FC2 at the plan's) and of FC2's (FC1
at the plan's), or with --overrides the given shapes, set through EXL3_JAX_MOE_GEMM (or the
given values of the variable named by --env, e.g. EXL3_JAX_MOE_TAILS or EXL3_JAX_MOE_PDL). Every
variant's output is compared with the default plan's (relative L2; a different K-split order
changes the last bits only) and timed like `exl3-jax bench moe` (median of a jitted loop, the
loop's x + 0 * y chaining included).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_bench_common import env_var

from exl3_jax.ffi import bench as fb
from exl3_jax.ffi import trellis_moe as tm
from exl3_jax.ops.moe_plans import MoeGemmPlan

WARPS_UNROLL = [(w, u) for w in (4, 6, 8, 12, 16) for u in (1, 2, 3, 4, 6, 8)]


def neighbours(gp: MoeGemmPlan, k: int, n: int) -> list[MoeGemmPlan]:
    """Valid plans near ``gp``: another n_tiles (1, 2, 4, 8), another K-split count (1, 2, 4,
    8), or another (warps, unroll) pair; valid = the kernel's own tiling check
    (MmaTiling.check_tiling) passes. Ordered by how many chunks a warp runs, nearest to gp's
    first."""
    k16 = k // 16
    cands = [MoeGemmPlan(t, gp.warps, gp.splits, gp.unroll) for t in (1, 2, 4, 8)]
    cands += [MoeGemmPlan(gp.n_tiles, gp.warps, s, gp.unroll) for s in (1, 2, 4, 8)]
    cands += [MoeGemmPlan(gp.n_tiles, w, gp.splits, u) for w, u in WARPS_UNROLL]
    ok = []
    for c in cands:
        if c == gp or c in ok:
            continue
        try:
            tm.GroupedMmaConfig(codebook="mcg", K=4, experts=1, planes=1, k=k, n=n, block_m=8,
                                blocks=1, **vars(c)).check_tiling()
        except ValueError:
            continue
        ok.append(c)

    def chunks(c):
        return k16 // c.splits // (c.warps * c.unroll)
    return sorted(ok, key=lambda c: abs(chunks(c) - chunks(gp)))


def spec(fc1: MoeGemmPlan | None = None, fc2: MoeGemmPlan | None = None) -> str:
    parts = [f"{name}={p.n_tiles},{p.warps},{p.splits},{p.unroll}"
             for name, p in (("fc1", fc1), ("fc2", fc2)) if p is not None]
    return ";".join(parts)


def layer_inputs(name: str, m: int):
    H, I, E, top_k = fb.MOE_GEOMETRIES[name]
    w13, down = fb.random_moe_weights(H, I, E, 4, "mcg")
    ids, wts = fb.random_topk(m, E, top_k, seed=m)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, H)), jnp.bfloat16)
    return x, ids, wts, w13, down


def run_variant(inputs, override: str, ref=None, env: str = tm.GEMM_ENV):
    """(row, output or None): the layer with $env = ``override`` ("": unset; the caller's
    setting restored after), its relative L2 distance from ``ref`` and its time."""
    try:
        with env_var(env, override or None):
            x, ids, wts, w13, down = inputs
            y = np.asarray(jax.jit(lambda *a: tm.moe_gpu(*a))(x, ids, wts, w13, down))
            row = {"override": override, "env": env}
            if ref is not None:
                row["rel_l2_vs_default"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            m = x.shape[0]
            row["us"] = 1e6 * fb.time_in_loop(lambda *a: tm.moe_gpu(*a), inputs,
                                              iters=int(max(8, min(128, 2e4 / m))), reps=5)
            return row, y
    except Exception as e:   # noqa: BLE001 -- record and continue
        return {"override": override, "env": env,
                "error": f"{type(e).__name__}: {e}"[:400]}, None


def sweep(geometries, ms, budget_s: float, overrides=None,
          env: str = tm.GEMM_ENV) -> list[dict]:
    """Rows of the default plan and its variants: the given values of $env, or (None) every
    neighbour of FC1's and of FC2's shape."""
    deadline = time.time() + budget_s
    rows = []
    for name in geometries:
        H, I, E, top_k = fb.MOE_GEOMETRIES[name]
        for m in ms:
            inputs = layer_inputs(name, m)
            plan = tm.plan_for(m, top_k, E, H, I)
            base, ref = run_variant(inputs, "", env=env)
            base.update(geometry=name, m=m, which="default", fc1=plan.fc1.__dict__,
                        fc2=plan.fc2.__dict__)
            rows.append(base)
            print(f"{name} m={m} default fc1={plan.fc1} fc2={plan.fc2}: "
                  f"{base.get('us', float('nan')):.2f} us", flush=True)
            variants = ([("given", o) for o in overrides] if overrides is not None else
                        [(which, spec(**{which: cand}))
                         for which, gp, k, n in (("fc1", plan.fc1, H, I), ("fc2", plan.fc2, I, H))
                         for cand in neighbours(gp, k, n)])
            for which, o in variants:
                if time.time() > deadline:
                    rows.append({"stopped": "deadline"})
                    return rows
                row, _ = run_variant(inputs, o, ref, env)
                row.update(geometry=name, m=m, which=which)
                rows.append(row)
                print(f"  {o:<34} {row.get('us', float('nan')):8.2f} us  "
                      f"rel {row.get('rel_l2_vs_default', float('nan')):.1e}  "
                      f"{row.get('error', '')}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometries", default="qwen3-30b-a3b,glm-5.2-tp4")
    p.add_argument("--m", default="1")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--overrides", default=None,
                   help="values of --env separated by '|' (default: the neighbours)")
    p.add_argument("--env", default=tm.GEMM_ENV,
                   help="the variable --overrides sets (default EXL3_JAX_MOE_GEMM)")
    p.add_argument("--once", default=None, help="geometry: run its layer 6 times and exit")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ms = [int(v) for v in a.m.split(",")]
    if a.once:
        inputs = layer_inputs(a.once, ms[0])
        f = jax.jit(lambda *args: tm.moe_gpu(*args))
        for _ in range(6):
            jax.block_until_ready(f(*inputs))
        return 0
    rows = sweep(a.geometries.split(","), ms, a.budget_s,
                 None if a.overrides is None else a.overrides.split("|"), a.env)
    report = {"benchmark": f"MoE layer variants ({a.env}), K4 mcg",
              "versions": fb.versions(), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
