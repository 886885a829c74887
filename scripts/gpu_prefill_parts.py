"""Where the prefill plan's time goes, part by part, against the bf16 dot (tuning aid).

  python scripts/gpu_prefill_parts.py [--shapes 8192x28672,4096x14336] [--m 1024,4096]
      [--K 4] [--codebook mcg] [--out parts.json]

For each (shape, m) on the plan auto picks (``prefill``), each part timed alone as `bench
linear` times an op (ffi.bench.time_in_loop, weights cycled past the L2; its arguments are loop
arguments, so no part's work is hoisted out of the loop):

  op            trellis_matmul_gpu, float32 out (what `bench linear` times)
  op_bf16       the same cast to bf16 (what a bf16 model's Exl3Linear returns)
  bf16 / bf16_f32   XLA's bf16 dot, bf16 out / float32 out (the baseline and its f32 twin)
  prefill plan: x_prep (trellis_gemm.prefill_operand: the batch scale, x / s to fp16),
                dequant (the folding dequantize kernel), dot16_f32 / dot16_bf16 / dot16_f16
                (fp16 x fp16 with that preferred type, the weight dequantized outside the loop)

One JSON line per row, all rows and the dots' compiled custom calls
(_gpu_bench_common.hlo_kernels) in --out. (Replaces scripts/gpu_tune.py's prefill rows: forced
plan, one weight copy, the folded form only.)
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np
from jax import lax

from _gpu_bench_common import hlo_kernels

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg


def dot_as(x, w, dtype):
    """x [m, k] @ w [k, n] with preferred_element_type ``dtype`` (XLA's dot, as the plan)."""
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=dtype)


def parts(k: int, n: int, m: int, K, codebook: str):
    """{name: (op, args, copies)} of the plan's parts at this shape."""
    w = gb.random_weight(k, n, K, codebook)
    plan = tg.plan_for(m, w)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)), jnp.bfloat16)
    wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02, jnp.bfloat16)
    cw, cb = gb.cold_copies(w.nbytes), gb.cold_copies(2 * k * n)
    out = {
        "op": (lambda x, w: tg.trellis_matmul_gpu(x, w), (x, w), cw),
        "op_bf16": (lambda x, w: tg.trellis_matmul_gpu(x, w).astype(jnp.bfloat16), (x, w), cw),
        "bf16": (lambda x, wb: jnp.dot(x, wb), (x, wb), cb),
        "bf16_f32": (lambda x, wb: dot_as(x, wb, jnp.float32), (x, wb), cb),
    }
    if plan.kind != "prefill":
        return plan, out
    x16, s = tg.prefill_operand(x)
    w16 = tg.dequantize_f16(w, rotate=True, scale=s)
    out["x_prep"] = (lambda x: tg.prefill_operand(x)[0], (x,), 1)
    out["dequant"] = (lambda x, w: tg.dequantize_f16(w, rotate=True, scale=s), (x, w), cw)
    for name, dtype in (("dot16_f32", jnp.float32), ("dot16_bf16", jnp.bfloat16),
                        ("dot16_f16", jnp.float16)):
        out[name] = ((lambda d: lambda x16, w16: dot_as(x16, w16, d))(dtype), (x16, w16), cb)
    return plan, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8192x28672,4096x14336")
    p.add_argument("--m", default="1024,4096")
    p.add_argument("--K", default="4")
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--out")
    a = p.parse_args(argv)
    K = float(a.K) if "." in a.K else int(a.K)
    rows, hlo = [], {}
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in a.m.split(",")):
            plan, ops = parts(k, n, m, K, a.codebook)
            for name, (op, args, copies) in ops.items():
                try:
                    us = 1e6 * gb.time_in_loop(op, args, iters=gb.iters_for(m, k, n),
                                               copies=copies)
                    err = None
                except Exception as e:     # noqa: BLE001 -- record and go on
                    us, err = float("nan"), f"{type(e).__name__}: {e}"[:300]
                row = dict(k=k, n=n, m=m, K=K, codebook=a.codebook, plan=str(plan), part=name,
                           us=round(us, 2), error=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if name.startswith("dot16") or name in ("op", "bf16"):
                    try:
                        hlo[f"{k}x{n} m={m} {name}"] = [
                            c for c in hlo_kernels(op, *args) if c.startswith("custom-call:")]
                    except Exception as e:   # noqa: BLE001
                        hlo[f"{k}x{n} m={m} {name}"] = f"{type(e).__name__}: {e}"[:200]
    for key, calls in hlo.items():
        print(key, calls)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": gb.versions(), "argv": sys.argv, "rows": rows,
                       "custom_calls": hlo}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
