"""Benchmark the GPU Trellis GEMM vs bf16 (see exl3_jax.ffi.bench for options and columns).

  python scripts/gpu_bench_linear.py [--shapes 4096x14336,...] [--K 2,3,4] [--codebooks mcg,mul1]
      [--m 1,4,16,32,128,1024,4096] [--out bench/results/gpu_bench_<gpu>_<date>.json]
"""

import sys

from exl3_jax.ffi.bench import main

if __name__ == "__main__":
    sys.exit(main())
