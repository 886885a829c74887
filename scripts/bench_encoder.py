"""Speed and quality of the trellis encoder (exact mode vs the fast mode, whose pass 1
covers only a window around the wrap).

Usage: python scripts/bench_encoder.py [--K 2 3 4] [--tiles 32] [--codebook mcg] [--batch N]
                                       [--backend jax numba] [--out bench/results/encoder_cpu.json]

For every K and backend: encodes the same N(0, sigma^2) tiles (sigma = the codebook's std) in both
modes, after one warm-up call (compilation) on the same shapes; reports tiles/s, the relative MSE
of each mode and their ratio. Writes one JSON document (date, versions, machine, load average,
results).
Timings on a shared machine are noisy: the load average at start and end is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from exl3_jax.quant.viterbi import BACKENDS, default_backend, default_batch, encode_tiles
from exl3_jax.trellis import codebook_table


def parse_rate(text: str) -> float:
    value = float(text)
    return int(value) if value == int(value) else value


def bench_mode(tiles, K, codebook, mode, repeats, batch, backend):
    """Warm up on the same shapes, then time ``repeats`` encodes. Returns (tiles/s, rel MSE)."""
    encode_tiles(tiles, K, codebook, mode=mode, batch=batch, backend=backend)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, values = encode_tiles(tiles, K, codebook, mode=mode, batch=batch, backend=backend)
        times.append(time.perf_counter() - t0)
    mse = float(np.mean((values.astype(np.float32) - tiles) ** 2) / np.mean(tiles ** 2))
    return len(tiles) / min(times), mse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=parse_rate, nargs="+", default=[2, 3, 4])
    ap.add_argument("--tiles", type=int, default=32)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=None,
                    help="tiles per call (default: the library's default for the backend)")
    ap.add_argument("--backend", nargs="+", choices=BACKENDS, default=None,
                    help="encoder backends to time (default: the library's default)")
    ap.add_argument("--out", default="bench/results/encoder_cpu.json")
    a = ap.parse_args()

    sigma = float(np.std(np.asarray(codebook_table(a.codebook), np.float64)))
    rng = np.random.default_rng(a.seed)
    load_start = os.getloadavg()
    results = []
    for K in a.K:
        tiles = (rng.standard_normal((a.tiles, 256)) * sigma).astype(np.float32)
        for backend in a.backend or [default_backend()]:
            row = {"K": K, "codebook": a.codebook, "tiles": a.tiles, "backend": backend}
            for mode in ("exact", "fast"):
                rate, mse = bench_mode(tiles, K, a.codebook, mode, a.repeats, a.batch, backend)
                row[mode] = {"tiles_per_s": round(rate, 2), "rel_mse": round(mse, 6),
                             "batch": a.batch or default_batch(K, backend)}
            row["fast_speedup"] = round(row["fast"]["tiles_per_s"] / row["exact"]["tiles_per_s"],
                                        2)
            row["fast_mse_ratio"] = round(row["fast"]["rel_mse"] / row["exact"]["rel_mse"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)

    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
           "cpus": os.cpu_count(), "machine": platform.machine(),
           "processor": platform.processor(), "python": platform.python_version(),
           "jax": jax.__version__, "numpy": np.__version__,
           "loadavg_start": [round(x, 2) for x in load_start],
           "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "note": "shared machine: other processes were running; tiles/s is the best of the "
                   "timed repeats after a warm-up call",
           "results": results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
