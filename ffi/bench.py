"""Benchmark the GPU Trellis GEMM against a bf16 jnp.dot, both timed inside a jitted loop.

Usage (on a CUDA machine with cutlass-dsl importable):
  python -m exl3_jax.ffi.bench [--shapes 4096x14336,8192x28672] [--K 3,4]
      [--codebooks mcg,mul1] [--m 1,4,16,32,128,1024,4096] [--out bench/results/gpu_bench.json]
(also scripts/gpu_bench_linear.py; meant to back `exl3-jax bench linear`).

Per (shape, K, codebook, m) it prints microseconds per call, effective GB/s on the compressed
weight bytes (trellis + suh + svh), the speedup over bf16 at the same (shape, m), and the fraction
of the decode floor (weights / decode rate measured in shared/bench/anchors.md: 3.69 T weights/s
for 3inst/mcg, 4.86 T/s for mul1, streaming from HBM).

Why a jitted loop: JAX per-call dispatch costs ~40-50 us on the H200 (anchors.md), more than the
kernels at small m. Each iteration feeds a value of the previous output back into the input
(x + 0 * y[0, 0]: XLA cannot fold 0 * y for floats), so nothing is hoisted out of the loop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DECODE_RATE = {"3inst": 3.69e12, "mcg": 3.69e12, "mul1": 4.86e12}   # weights/s, anchors.md
ISSUE_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (2048, 768))
ISSUE_M = (1, 4, 16, 32, 128, 1024, 4096)


def versions() -> dict:
    info = {"jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import importlib.metadata as md
        info["nvidia-cutlass-dsl"] = md.version("nvidia-cutlass-dsl")
    except Exception:
        try:
            import cutlass
            info["nvidia-cutlass-dsl"] = getattr(cutlass, "__version__", "?")
        except Exception:
            info["nvidia-cutlass-dsl"] = None
    try:
        dev = jax.devices()[0]
        info["device"] = dev.device_kind
        info["sms"] = getattr(dev, "core_count", None)
    except Exception as e:       # noqa: BLE001
        info["device"] = f"? ({e})"
    return info


def random_weight(k: int, n: int, K, codebook: str, seed: int = 0):
    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight
    rng = np.random.default_rng(seed)
    W = width_from_rate(K)
    trellis = rng.integers(-32768, 32768, size=(k // 16, n // 16, W), dtype=np.int64).astype(
        np.int16)
    suh = (rng.choice([-1.0, 1.0], size=k) * rng.uniform(0.5, 1.5, size=k)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], size=n) * rng.uniform(0.005, 0.02, size=n)).astype(np.float16)
    return Exl3Weight.create(jnp.asarray(trellis), jnp.asarray(suh), jnp.asarray(svh), codebook)


def time_in_loop(op, args, *, iters: int, reps: int = 3, unroll: int = 8) -> float:
    """Seconds per op call: median of ``reps`` timings of a jitted fori_loop of ``iters`` calls,
    ``unroll`` calls per loop trip (an XLA while-loop trip costs several microseconds on the
    GPU, so unrolling keeps that out of the per-call time). ``op(x, *rest)`` returns an array;
    args[0] is x; x + 0 * (previous output) chains the calls."""
    iters = max(unroll, iters // unroll * unroll)

    @jax.jit
    def loop(x, *rest):
        def body(_, c):
            y = op(x + (c * 0).astype(x.dtype), *rest)
            return y.reshape(-1)[0].astype(jnp.float32)
        return lax.fori_loop(0, iters, body, jnp.float32(0), unroll=unroll)

    jax.block_until_ready(loop(*args))                  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / iters


def loop_overhead_us(m: int, k: int) -> float:
    """Per-call cost of the loop scaffolding alone (x + 0 * c and one element read)."""
    x = jnp.zeros((m, k), jnp.bfloat16)
    return 1e6 * time_in_loop(lambda x: x[:1, :1], (x,), iters=iters_for(m, k, k))


def iters_for(m: int, k: int, n: int) -> int:
    work = m * k * n
    return int(max(16, min(256, 4e11 / max(work, 1))))


def bench(shapes, Ks, codebooks, ms, *, deadline: float | None = None, log=print) -> list[dict]:
    from exl3_jax.ffi import trellis_gemm as tg

    rows = []
    for (k, n) in shapes:
        wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02, jnp.bfloat16)
        bf16_us, overhead_us = {}, {}
        for m in ms:
            if deadline and time.time() > deadline:
                log("bench: deadline reached, stopping")
                return rows
            x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)), jnp.bfloat16)
            bf16_us[m] = 1e6 * time_in_loop(lambda x, w: jnp.dot(x, w), (x, wb),
                                            iters=iters_for(m, k, n))
            overhead_us[m] = loop_overhead_us(m, k)
            log(f"{k:>6}x{n:<6} m={m:<5} bf16 {bf16_us[m]:9.1f} us  loop overhead "
                f"{overhead_us[m]:6.1f} us")
        for K in Ks:
            for cb in codebooks:
                w = random_weight(k, n, K, cb)
                tbytes = int(np.prod(w.trellis.shape)) * 2
                for m in ms:
                    if deadline and time.time() > deadline:
                        log("bench: deadline reached, stopping")
                        return rows
                    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)),
                                    jnp.bfloat16)
                    plan = tg.plan_for(m, w)
                    try:
                        us = 1e6 * time_in_loop(lambda x, w: tg.trellis_matmul_gpu(x, w),
                                                (x, w), iters=iters_for(m, k, n))
                        err = None
                    except Exception as e:   # noqa: BLE001 -- record and continue
                        us, err = float("nan"), f"{type(e).__name__}: {e}"[:500]
                    floor_us = 1e6 * k * n / DECODE_RATE[cb]
                    row = dict(k=k, n=n, K=K, codebook=cb, m=m, plan=plan.kind, us=us,
                               bf16_us=bf16_us[m], loop_overhead_us=overhead_us[m],
                               speedup_vs_bf16=bf16_us[m] / us,
                               gbps=w.nbytes / us / 1e3, trellis_bytes=tbytes,
                               floor_us=floor_us, floor_fraction=floor_us / us, error=err)
                    rows.append(row)
                    log(f"{k:>6}x{n:<6} K={K:<4} {cb:<5} m={m:<5} {plan.kind:<8} "
                        f"{us:9.1f} us  bf16 {bf16_us[m]:9.1f} us  x{bf16_us[m] / us:5.2f}  "
                        f"{row['gbps']:7.0f} GB/s  floor {floor_us:7.1f} us "
                        f"({row['floor_fraction']:.2f})" + (f"  ERR {err}" if err else ""))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in ISSUE_SHAPES))
    p.add_argument("--K", default="2,3,4")
    p.add_argument("--codebooks", default="mcg,mul1")
    p.add_argument("--m", default=",".join(map(str, ISSUE_M)))
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    a = p.parse_args(argv)
    deadline = time.time() + a.budget_s if a.budget_s else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    Ks = [float(v) if "." in v else int(v) for v in a.K.split(",")]
    rows = bench(shapes, Ks, a.codebooks.split(","), [int(v) for v in a.m.split(",")],
                 deadline=deadline)
    result = {"versions": versions(), "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
