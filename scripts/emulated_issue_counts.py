"""PTX warp-instructions issued by each kernel of one MoE layer or one linear, counted by the
PTX interpreter on the CPU (no GPU): a kernel change's issue work, before any device time.

    python scripts/emulated_issue_counts.py moe 1,8,128,2048,768 --env EXL3_JAX_MOE_CLUSTER=1,auto
    python scripts/emulated_issue_counts.py linear 4096,14336,1 --K 3 --codebook mul1

``moe T,top_k,E,H,I`` (the decode plan; per-route packing where the plan picks it, or
``--packing``) or
``linear k,n,m`` (the auto plan); ``--env NAME=V1,V2,...`` runs once per value and prints the
differences. One JSON line per (variant, kernel): grid, warps, warp-instructions issued
(``issued``), per warp, and the most issued instructions. These are PTX counts: ptxas folds,
schedules and expands them (SASS has fewer address and move instructions, and an mma.sync
becomes one HMMA), so they compare variants of one kernel, they are not times. A layer of
Qwen3-30B-A3B geometry takes a few minutes; GLM-5.2 shapes longer."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("EXL3_JAX_EMULATE", "1")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["EXL3_JAX_EMULATE_COUNT"] = "1"


def _layer(args):
    """A function of no arguments that runs the requested op once (fresh random weights and
    inputs, seed 0)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from exl3_jax.ffi.bench import random_moe_weights, random_weight
    rng = np.random.default_rng(0)
    dims = [int(v) for v in args.shape.split(",")]
    if args.op == "moe":
        from exl3_jax.ffi import trellis_moe as tm
        from exl3_jax.ops.moe_plans import moe_plan
        T, top_k, E, H, I = dims
        w13, down = random_moe_weights(H, I, E, args.K, args.codebook)
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
        ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32))
        w = jnp.asarray(rng.uniform(0.1, 1, (T, top_k)), jnp.float32)
        plan = moe_plan(T, top_k, E, H, I, kind="decode", packing=args.packing)
        return lambda: jax.block_until_ready(jax.jit(
            lambda x: tm.moe_gpu(x, ids, w, w13, down, plan=plan))(x))
    from exl3_jax.ffi import trellis_gemm as tg
    k, n, m = dims
    wt = random_weight(k, n, args.K, args.codebook)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return lambda: jax.block_until_ready(jax.jit(lambda x: tg.trellis_matmul_gpu(x, wt))(x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=["moe", "linear"])
    p.add_argument("shape", help="moe: T,top_k,E,H,I; linear: k,n,m")
    p.add_argument("--K", type=float, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--env", default="", help="NAME=V1,V2,...: one run per value")
    p.add_argument("--packing", choices=["per_route", "sorted"], default=None,
                   help="moe: force the route packing (default: the plan's; per_route keeps "
                        "a large layer's per-CTA work with fewer experts, e.g. GLM-5.2 TP4's "
                        "1,8,16,6144,512, whose 256 experts do not fit this machine)")
    args = p.parse_args(argv)
    if args.K == int(args.K):
        args.K = int(args.K)
    name, _, values = args.env.partition("=")
    variants = values.split(",") if name else [None]
    from exl3_jax.ffi import emulate
    totals = {}
    for value in variants:
        if value is not None:
            os.environ[name] = value
        emulate.LAUNCH_LOG.clear()
        _layer(args)()           # traced per variant (the environment is read at trace time)
        for i, r in enumerate(emulate.LAUNCH_LOG):
            warps = (r["grid"][0] * r["grid"][1] * r["grid"][2]
                     * -(-(r["block"][0] * r["block"][1] * r["block"][2]) // 32))
            issued = sum(r["issued"].values())
            totals.setdefault(value, []).append(issued)
            top = sorted(r["issued"].items(), key=lambda kv: -kv[1])[:8]
            print(json.dumps(dict(variant=value, launch=i, kernel=r["kernel"][:48],
                                  grid=r["grid"], cluster=r.get("cluster"), warps=warps,
                                  issued=issued, per_warp=round(issued / warps, 1),
                                  top=dict(top))), flush=True)
    if len(variants) > 1:
        base = totals[variants[0]]
        for value in variants[1:]:
            print(json.dumps(dict(compare=f"{name}={value} vs {variants[0]}", issued_change=[
                f"{(b - a) / a:+.2%}" if a and len(base) == len(totals[value]) else None
                for a, b in zip(base, totals[value])])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
