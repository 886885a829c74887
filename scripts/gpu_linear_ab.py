"""Time one switch of the GPU Trellis linear in one process (tuning aid; bench/NOTES.md).

  python scripts/gpu_linear_ab.py --env EXL3_JAX_ONE_TOKEN --values '0|1|0|1'
      [--env2 EXL3_JAX_ROW_LINEAR=0] [--shapes 8192x28672,4096x14336+14336] [--K 4]
      [--codebooks mcg,mul1] [--m 1] [--l2 cold|warm] [--out ab.json]

A shape KxN1+N2[+N3] is a linear group (gate/up-like, q/k/v-like): one weight per member, run
as the model runs them (trellis_gemm.trellis_matmul_group_gpu: one launch over the members).

For every (shape, K, codebook, m) the values of the environment variable ``--env`` are set in
turn (a repeated value is timed again: drift between neighbours shows as their spread), each
value's op (exl3_jax.ffi.trellis_gemm.trellis_matmul_gpu, traced afresh so the switch takes
effect) timed as `bench linear` times it (median of a jitted loop, exl3_jax.ffi.bench), and its
output compared with the first value's (relative L2: a switch of layout or tiling must not
change the result beyond the K-split order). ``--env2 NAME=VALUE`` pins another variable for
the whole run. One JSON line per row, and all rows in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg


def linear_op(members: int):
    """op(x, weights) -> float32 [m, sum(n_i)]: one linear, or a group of ``members``."""
    if members == 1:
        return lambda x, w: tg.trellis_matmul_gpu(x, w[0])
    return lambda x, w: jnp.concatenate(tg.trellis_matmul_group_gpu(x, w), axis=-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", required=True)
    p.add_argument("--values", required=True, help="'|'-separated values of --env")
    p.add_argument("--env2", action="append", default=[], help="NAME=VALUE held fixed")
    p.add_argument("--shapes", default="8192x28672,4096x14336")
    p.add_argument("--K", default="4")
    p.add_argument("--codebooks", default="mcg,mul1")
    p.add_argument("--m", default="1")
    p.add_argument("--bf16", action="store_true",
                   help="also time a bf16 jnp.dot per (shape, m); rows gain bf16_us, x_bf16")
    p.add_argument("--l2", choices=gb.L2_MODES, default="cold",
                   help="as `bench linear --l2` (cold: weight copies cycled past the L2)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    for kv in a.env2:
        name, _, value = kv.partition("=")
        os.environ[name] = value
    values = a.values.split("|")
    rows = []
    for shape in a.shapes.split(","):
        k, members = shape.split("x")
        k, members = int(k), [int(v) for v in members.split("+")]
        n = sum(members)
        bf16_us = {}
        if a.bf16:
            wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02,
                             jnp.bfloat16)
            for m in (int(v) for v in a.m.split(",")):
                xb = jnp.zeros((m, k), jnp.bfloat16)
                bf16_us[m] = 1e6 * gb.time_in_loop(lambda x, w: jnp.dot(x, w), (xb, wb),
                                                   iters=gb.iters_for(m, k, n),
                                                   copies=gb.weight_copies(2 * k * n, a.l2))
        for K in (float(v) if "." in v else int(v) for v in a.K.split(",")):
            for cb in a.codebooks.split(","):
                w = [gb.random_weight(k, ni, K, cb) for ni in members]
                copies = gb.weight_copies(sum(wi.nbytes for wi in w), a.l2)
                for m in (int(v) for v in a.m.split(",")):
                    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)),
                                    jnp.bfloat16)
                    first = None
                    for v in values:
                        os.environ[a.env] = v
                        key = {"k": k, "n": n, "members": members, "K": K, "codebook": cb,
                               "m": m, a.env: v}
                        # a fresh function per value, so jit traces it under the new value
                        op = linear_op(len(members))
                        try:
                            y = np.asarray(jax.jit(op)(x, w))
                        except Exception as e:     # a value the kernel rejects: say so, go on
                            row = dict(key, error=f"{type(e).__name__}: {str(e)[:300]}")
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                            continue
                        first = y if first is None else first
                        rel = float(np.linalg.norm(y - first) / np.linalg.norm(first))
                        us = 1e6 * gb.time_in_loop(op, (x, w), iters=gb.iters_for(m, k, n),
                                                   copies=copies)
                        row = dict(key, l2=a.l2, us=round(us, 2), rel_l2_vs_first=rel,
                                   finite=bool(np.isfinite(y).all()))
                        if m in bf16_us:
                            row["bf16_us"] = round(bf16_us[m], 2)
                            row["x_bf16"] = round(bf16_us[m] / us, 3)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": gb.versions(), "env": a.env, "env2": a.env2,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
