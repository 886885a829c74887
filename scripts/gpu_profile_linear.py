"""Where one GPU Trellis linear's time goes: kernel time per call, by kernel, from a JAX profiler
trace (the input transform, the GEMM or dequantize kernel, XLA's dot, the output transform),
next to a bf16 jnp.dot of the same shape traced the same way.

  python scripts/gpu_profile_linear.py [--shapes 8192x28672,4096x14336] [--m 1024,4096]
      [--plans prefill,wgmma] [--K 4] [--codebook mcg] [--calls 20] [--out prof.json]

Each (shape, m, plan) runs ``--calls`` calls of trellis_matmul_gpu with that plan forced (bf16
activations, as in a model) in bench's timing loop (ffi.bench.timing_loop: calls chained
through x, the weight a loop argument that XLA cannot hoist work on), after a warm-up, under
the profiler; the kernel times of the trace divided by the calls give microseconds per call
for every kernel name (kernel_times of gpu_profile_decode.py: GPU stream lines only). The sum
is the linear's GPU time without launch gaps; comparing it with `bench linear`'s time shows
the gaps.
Why: the prefill plan's overhead over the bf16 dot (0.69-0.73x at m >= 1024, bench/NOTES.md)
is a sum of kernels whose shares decide between folding the rotations into the dequantized
weight and decoding inside a wgmma GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_bench_common import run_metadata, versions, write_json
from gpu_profile_decode import kernel_times

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg


UNROLL = 4      # calls per timing-loop trip (--calls is a multiple of it)


def profile(op, args, calls: int) -> dict:
    """Microseconds per call by kernel name of op(*args) in ``calls`` chained calls (bench's
    timing loop, one weight copy)."""
    loop = gb.timing_loop(op, calls // UNROLL, UNROLL, 1)
    rests = [tuple(args[1:])]
    jax.block_until_ready(loop(args[0], rests))        # compile + warm up
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(loop(args[0], rests))
        jax.profiler.stop_trace()
        _, by_name, _ = kernel_times(d)
    per = {k: round(v / calls / 1e3, 2) for k, v in by_name.items()}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x28672,4096x14336")
    p.add_argument("--m", default="1024,4096")
    p.add_argument("--plans", default="prefill,wgmma")
    p.add_argument("--K", default="4")
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "gpu_profile_linear.json"))
    a = p.parse_args(argv)
    if a.calls % UNROLL:
        p.error(f"--calls must be a multiple of {UNROLL}, got {a.calls}")
    K = float(a.K) if "." in a.K else int(a.K)
    result = {"benchmark": "GPU kernel time per call of one linear (JAX profiler trace)",
              **run_metadata(__file__, argv), "device": jax.devices()[0].device_kind,
              "versions": versions(), "rows": []}
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = gb.random_weight(k, n, K, a.codebook)
        wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02, jnp.bfloat16)
        for m in (int(v) for v in a.m.split(",")):
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
            runs = [("bf16", lambda x, wb: jnp.dot(x, wb), (x, wb))] + [
                (plan, lambda x, w, plan=plan: tg.trellis_matmul_gpu(x, w, plan=plan), (x, w))
                for plan in a.plans.split(",")]
            for plan, op, args in runs:
                t0 = time.time()
                row = {"k": k, "n": n, "m": m, "K": K, "codebook": a.codebook, "plan": plan}
                try:
                    kernels = profile(op, args, a.calls)
                    row.update(kernel_us=round(sum(kernels.values()), 2), kernels=kernels)
                except Exception as e:      # record and go on
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                row["seconds"] = round(time.time() - t0, 1)
                result["rows"].append(row)
                write_json(a.out, result)
                top = list(row.get("kernels", {}).items())[:5]
                print(json.dumps({**{k: v for k, v in row.items() if k != "kernels"},
                                  "top": top}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
