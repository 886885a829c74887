"""Probe the GPU Trellis GEMM for profilers and the launch path (tuning aid; bench/NOTES.md).

  python scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 3 --codebook mcg --m 1 [--calls 6]
      runs the decode kernel alone ``--calls`` times (for ``ncu --kernel-name regex:trellis``);
      with another plan ($EXL3_JAX_PLAN=wgmma, prefill, ...) the whole linear op
  python scripts/gpu_probe_linear.py hlo [--out probe.json]
      compiles a jitted chain of three Trellis linears and the bench's fori_loop, and records
      whether XLA put the CuTe custom calls into command buffers (CUDA graphs), with the
      XLA_FLAGS in effect and the per-call time of the chain under them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg


def run_kernel(a) -> int:
    w = gb.random_weight(a.k, a.n, a.K, a.codebook)
    plan = tg.plan_for(a.m, w)      # the production plan on this device (arch, codebook)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((a.m, a.k)), jnp.bfloat16)
    if plan.kind != "decode":
        op = jax.jit(lambda x, w: tg.trellis_matmul_gpu(x, w, plan=plan))
        for _ in range(a.calls):
            out = op(x, w)
        jax.block_until_ready(out)
        print(json.dumps({"plan": str(plan)}))
        return 0
    cfg = tg._mma_config(w, plan)
    xw, _ = tg.decode_input_words(x, w.suh, cfg)
    kernel = jax.jit(lambda xw, w: tg.mma_partials_words(xw, w, plan))
    for _ in range(a.calls):
        out = kernel(xw, w)
    jax.block_until_ready(out)
    print(json.dumps({"plan": str(plan), "grid": cfg.grid, "threads": cfg.threads}))
    return 0


def command_buffer_report(a) -> int:
    k, n, m = 4096, 4096, 1
    ws = [gb.random_weight(k, n, 4, "mcg", seed=s) for s in range(3)]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)

    def chain(x, *ws):
        for w in ws:
            x = tg.trellis_matmul_gpu(x, w).astype(jnp.bfloat16)
        return x
    chain_jit = jax.jit(chain)
    text = chain_jit.lower(x, *ws).compile().as_text()
    jax.block_until_ready(chain_jit(x, *ws))
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(chain_jit(x, *ws))
        times.append(time.perf_counter() - t0)
    per_call = 1e6 * gb.time_in_loop(lambda x, w: tg.trellis_matmul_gpu(x, w), (x, ws[0]),
                                     iters=256)
    report = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "chain_hlo_command_buffer_mentions": text.count("command_buffer"),
        "chain_hlo_custom_calls": text.count("custom_call_target=\"CuteDSLRT"),
        "chain_3_linears_us_host_timed_median": round(1e6 * float(np.median(times)), 1),
        "linear_4096x4096_K4_mcg_m1_us_in_loop": round(per_call, 2),
        "versions": gb.versions(),
    }
    print(json.dumps(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["run", "hlo"])
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--K", type=float, default=3)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.K == int(a.K):
        a.K = int(a.K)
    return run_kernel(a) if a.what == "run" else command_buffer_report(a)


if __name__ == "__main__":
    sys.exit(main())
