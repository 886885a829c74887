"""Does the prefill plan's fp16 dot run slower than the bf16 dot because of its operands' bits?

  python scripts/gpu_dot_power.py [--shapes 8192x28672,4096x14336] [--m 4096] [--out f.json]
  ncu --profile-from-start off ... python scripts/gpu_dot_power.py --once --only NAME ...
      (the variant compiled, then called twice with the profiler on: ncu sees those launches
      alone, not the GEMM autotuner's)

Call 70 timed the plan's fp16 x fp16 dot (its weight dequantized outside the loop) 4-8% slower
than XLA's bf16 dot at m = 4096 with the same preferred output width. One dot per variant,
timed as `bench linear` times an op (ffi.bench.loop_timer, weights cycled past the L2), then
run for ~2 s more while `nvidia-smi` samples the SM clock, the power and the clock-event reasons:

  bf16 / bf16_f32           bf16 x bf16 (normal x, weight normal * 0.02), bf16 / f32 out
  bf16_zero_w               the same with an all-zero weight (the power ceiling's control)
  f16_bf16bits_f32 / _f16   the bf16 operands converted to fp16 (exact): 8 significant bits
  f16_9bits_f32             fp16 weight rounded to 9 significant bits, f32 out
  f16_full_f32 / _f16       fp16 weight with all 11 significant bits, f32 / f16 out
  plan_f32                  the plan's own operands: prefill_operand(x), the folding dequantize

If the fp16 rows with bf16's bits run at bf16's speed and clock while the full-mantissa rows
run at a lower clock, the gap is the tensor cores' power at the H200's cap, not cuBLAS's choice
of kernel (`--once` under ncu names the kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_prefill_parts import dot_as

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg

SMI_FIELDS = ("clocks.sm", "power.draw", "clocks_event_reasons.active")


def round_significant(w, bits: int):
    """fp16 w with its significand rounded (to nearest, ties away) to ``bits`` bits, as fp16."""
    u = np.asarray(w, np.float16).view(np.uint16).astype(np.uint32)
    drop = 11 - bits
    u = ((u + (1 << (drop - 1))) >> drop) << drop
    return jnp.asarray(u.astype(np.uint16).view(np.float16))


VARIANTS = ("bf16", "bf16_f32", "bf16_zero_w", "f16_bf16bits_f32", "f16_bf16bits_f16",
            "f16_9bits_f32", "f16_full_f32", "f16_full_f16", "plan_f32")


def variants(k: int, n: int, m: int, names=VARIANTS):
    """{name: (x, w, out dtype)} for ``names``: the dot's operands (x first), its preferred
    output type."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w32 = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32) * 0.02
    wb = jnp.asarray(w32, jnp.bfloat16)
    x16, wb16 = x.astype(jnp.float16), wb.astype(jnp.float16)

    def plan_operands():
        xp, s = tg.prefill_operand(x)
        return xp, tg.dequantize_f16(gb.random_weight(k, n, 4, "mcg"), rotate=True, scale=s)

    make = {
        "bf16": lambda: (x, wb, jnp.bfloat16),
        "bf16_f32": lambda: (x, wb, jnp.float32),
        "bf16_zero_w": lambda: (x, jnp.zeros_like(wb), jnp.bfloat16),
        "f16_bf16bits_f32": lambda: (x16, wb16, jnp.float32),
        "f16_bf16bits_f16": lambda: (x16, wb16, jnp.float16),
        "f16_9bits_f32": lambda: (x16, round_significant(w32, 9), jnp.float32),
        "f16_full_f32": lambda: (x16, jnp.asarray(w32, jnp.float16), jnp.float32),
        "f16_full_f16": lambda: (x16, jnp.asarray(w32, jnp.float16), jnp.float16),
        "plan_f32": lambda: (*plan_operands(), jnp.float32),
    }
    return {name: make[name]() for name in names}


class Sampler:
    """nvidia-smi sampling every ``ms`` in the background; samples(t0, t1) -> field lists."""

    def __init__(self, ms: int = 50):
        fields = ",".join(("timestamp",) + SMI_FIELDS)
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
             f"-lms={ms}"], stdout=subprocess.PIPE, text=True, bufsize=1)
        self.rows = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.rows.append((time.time(), [v.strip() for v in line.split(",")[1:]]))

    def window(self, t0: float, t1: float) -> dict:
        got = [r for t, r in self.rows if t0 <= t <= t1]
        out = {"samples": len(got)}
        for i, name in enumerate(SMI_FIELDS[:2]):
            vals = [float(r[i]) for r in got if len(r) > i and _num(r[i])]
            out[name] = round(statistics.median(vals), 1) if vals else None
        out["reasons"] = sorted({r[2] for r in got if len(r) > 2})
        return out

    def stop(self):
        self.proc.terminate()


def cuda_profiler(on: bool) -> int:
    """cuProfilerStart / Stop on device 0's primary context (JAX's) made current in this
    thread; the driver's return code."""
    import ctypes
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return -1
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    return (cu.cuProfilerStart if on else cu.cuProfilerStop)()


def _num(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8192x28672,4096x14336")
    p.add_argument("--m", default="4096")
    p.add_argument("--only", help="comma-separated variant names")
    p.add_argument("--sustain-s", type=float, default=2.0)
    p.add_argument("--once", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    sampler = None if a.once else Sampler()
    rows = []
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in a.m.split(",")):
            names = a.only.split(",") if a.only else VARIANTS
            for name, (x, w, dtype) in variants(k, n, m, names).items():
                op = (lambda d: lambda x, w: dot_as(x, w, d))(dtype)
                if a.once:
                    f = jax.jit(op)
                    jax.block_until_ready(f(x, w))          # compile and autotune
                    rc = cuda_profiler(True)
                    for _ in range(2):
                        jax.block_until_ready(f(x, w))
                    cuda_profiler(False)
                    print(name, k, n, m, "profiler start rc", rc, file=sys.stderr, flush=True)
                    continue
                timer = gb.loop_timer(op, (x, w), iters=gb.iters_for(m, k, n),
                                      copies=gb.cold_copies(2 * k * n), reps=5)
                us = 1e6 * timer()
                t0 = time.time()
                while time.time() - t0 < a.sustain_s:     # the same loop, sustained
                    timer()
                t1 = time.time()
                smi = sampler.window(t0 + 0.5, t1)
                row = dict(k=k, n=n, m=m, variant=name, us=round(us, 1),
                           tflops=round(2 * m * k * n / us / 1e6, 1), **smi)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if sampler:
        sampler.stop()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": gb.versions(), "argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
