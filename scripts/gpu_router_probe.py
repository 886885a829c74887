"""MoE router logits on the GPU: time, kernels and error of the ways to compute x @ W_router.

  python scripts/gpu_router_probe.py [--out $OUT/gpu_router_probe.json]

The decode-step profile of the Qwen3-30B-A3B geometry (session 12) showed the router's one-token
fp32 einsum as a convert-multiply fusion over the whole [H, E] weight and a column reduce, 6 us per
layer, when the weight is 0.5 MB. Variants, for T in {1, 8} tokens of bf16 x:
  fp32_in_out:  W [H, E] fp32, x cast to fp32, Precision.HIGHEST (the path before session 12);
  bf16_in_out:  W [H, E] bf16, bf16 operands, fp32 accumulation (preferred_element_type);
  bf16_out_in:  W [E, H] bf16 (the HF orientation), same numerics, "ti,oi->to";
  fp32_out_in:  W [E, H] fp32, HIGHEST.
Each is timed as the median of 3 runs of a jitted loop (exl3_jax.ffi.bench.time_in_loop, minus
the loop's own per-call cost), its optimized HLO's fusions and custom calls are listed, and its
logits are compared with float64 NumPy on the same rounded values (max |error| / max |logit|).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_bench_common import hlo_kernels, run_metadata, versions, write_json

from exl3_jax.ffi.bench import loop_overhead_us, time_in_loop

GEOMETRIES = {"qwen3_30b_a3b": (2048, 128), "glm52_tp4": (6144, 256)}


def variants(w64: np.ndarray) -> dict:
    """name -> (weight array, logits function of (x bf16 [T, H], weight))."""
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    return {
        "fp32_in_out": (jnp.asarray(w64, f32), lambda x, w: jnp.einsum(
            "ti,io->to", x.astype(f32), w, precision=hi)),
        "bf16_in_out": (jnp.asarray(w64, jnp.bfloat16), lambda x, w: jnp.einsum(
            "ti,io->to", x, w, preferred_element_type=f32)),
        "bf16_out_in": (jnp.asarray(w64.T, jnp.bfloat16), lambda x, w: jnp.einsum(
            "ti,oi->to", x, w, preferred_element_type=f32)),
        "fp32_out_in": (jnp.asarray(w64.T, f32), lambda x, w: jnp.einsum(
            "ti,oi->to", x.astype(f32), w, precision=hi)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "gpu_router_probe.json"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rows = []
    for geo, (H, E) in GEOMETRIES.items():
        w64 = 2.0 * rng.standard_normal((H, E)) / np.sqrt(H)
        for T in (1, 8):
            x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
            loop_us = loop_overhead_us(T, H)
            for name, (w, fn) in variants(w64).items():
                t0 = time.perf_counter()
                row = dict(geometry=geo, H=H, E=E, T=T, variant=name)
                try:
                    y = np.asarray(jax.jit(fn)(x, w), np.float64)
                    wv = np.asarray(w.astype(jnp.float32), np.float64)
                    want = np.asarray(x.astype(jnp.float32), np.float64) @ (
                        wv if name.endswith("in_out") else wv.T)
                    row["rel_max_err"] = float(np.abs(y - want).max() / np.abs(want).max())
                    us = 1e6 * time_in_loop(fn, (x, w), iters=512)
                    row.update(us=round(us - loop_us, 2), us_with_loop=round(us, 2),
                               kernels=hlo_kernels(fn, x, w))
                except Exception as e:                      # noqa: BLE001 (recorded, not fatal)
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                row["seconds"] = round(time.perf_counter() - t0, 1)
                print(row, flush=True)
                rows.append(row)
    write_json(a.out, dict(benchmark="MoE router logits variants",
                           meta=run_metadata(__file__, argv), versions=versions(),
                           loop_note="us = loop time minus the loop's own per-call cost "
                           "(x + 0 * c, one element read)", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
