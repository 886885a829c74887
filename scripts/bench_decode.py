"""Speed of the jnp reference decoder on this machine's default JAX backend.

Usage: python scripts/bench_decode.py [--k 4096] [--n 4096] [--K 4] [--codebook mcg] [--repeats 5]
Prints one JSON line: backend, device, versions, shape, warm-up (compile) time and the median and
minimum of the timed runs of jit(decode_trellis) and jit(dequantize).
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

from exl3_jax.format.spec import width_from_rate
from exl3_jax.trellis import decode_trellis, dequantize


def time_fn(fn, args, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return warm, statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--K", type=float, default=4)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    K = int(a.K) if a.K == int(a.K) else a.K
    rng = np.random.default_rng(0)
    trellis = jnp.asarray(rng.integers(-32768, 32768, (a.k // 16, a.n // 16, width_from_rate(K)),
                                       dtype=np.int16))
    suh = jnp.asarray(rng.standard_normal(a.k).astype(np.float16))
    svh = jnp.asarray(rng.standard_normal(a.n).astype(np.float16))
    dec = jax.jit(decode_trellis, static_argnums=1)
    deq = jax.jit(dequantize, static_argnums=3)
    w_dec, med_dec, min_dec = time_fn(dec, (trellis, a.codebook), a.repeats)
    w_deq, med_deq, min_deq = time_fn(deq, (trellis, suh, svh, a.codebook), a.repeats)
    print(json.dumps({
        "command": "python scripts/bench_decode.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
        "python": platform.python_version(), "jax": jax.__version__,
        "shape": [a.k, a.n], "K": K, "codebook": a.codebook,
        "decode_trellis_s": {"warmup": round(w_dec, 3), "median": round(med_dec, 4),
                             "min": round(min_dec, 4)},
        "dequantize_s": {"warmup": round(w_deq, 3), "median": round(med_deq, 4),
                         "min": round(min_deq, 4)},
        "decode_weights_per_s": round(a.k * a.n / med_dec / 1e6, 1) * 1e6,
    }))


if __name__ == "__main__":
    main()
