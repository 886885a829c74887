"""Decode attention on the GPU: time and error of the ways a decode step can attend.

  python scripts/gpu_attention_probe.py [--out $OUT/gpu_attention_probe.json]

One query token (T = 1) per row against a static cache of S slots, left-padded rows (the cache
exl3_jax.nn.attention keeps), for the Llama-3-8B (32 q / 8 kv heads) and Qwen3-30B-A3B (32 / 4)
geometries, head dim 128, batch 1 and 8, S = 576 and 2048. Variants:
  fp32_highest: nn.gqa_attention on the cache converted to fp32 (the model's path before
                2026-12-04: fp32 operands at Precision.HIGHEST);
  bf16:         nn.gqa_attention on the bf16 cache (bf16 operands, fp32 accumulation);
  pallas_gqa:   jax.experimental.pallas.ops.gpu.decode_attention.gqa (Triton; start_idx /
                kv_seq_len per row from the left padding).
With ``--mask-variants`` the mask is a runtime argument, built from the cache bookkeeping as
nn.attention.advance builds it each step (a constant mask lets XLA fold it away), and the
softmax is written several ways, to see which XLA fuses (the kernels of each are listed):
  bf16_where:    nn.gqa_attention (jnp.where(mask, s, -1e30), jax.nn.softmax);
  bf16_bias:     an additive fp32 bias (0 / -1e30) made once per step outside the layer;
  bf16_nomask:   no mask (a bound: what the softmax costs unmasked);
  dpa_xla / dpa_cudnn: jax.nn.dot_product_attention(mask=..., implementation=...).
Each is timed as the median of 3 runs of a jitted loop of 64 calls (exl3_jax.ffi.bench.time_in_loop,
which chains the calls through q) and compared with a float64 NumPy softmax attention on the
same bf16 cache (max |error| / max |reference|).
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
from _gpu_bench_common import hlo_kernels, run_metadata, versions, write_json

from exl3_jax.ffi.bench import time_in_loop
from exl3_jax.nn import gqa_attention


def reference(q, k, v, start, end):
    """float64 softmax attention of q [B, Hq, D] over slots [start_b, end_b) of k/v."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    k64 = np.repeat(np.asarray(k.astype(jnp.float32), np.float64), Hq // Hkv, axis=2)
    v64 = np.repeat(np.asarray(v.astype(jnp.float32), np.float64), Hq // Hkv, axis=2)
    out = np.zeros((B, Hq, D))
    for b in range(B):
        s = np.einsum("hd,shd->hs", np.asarray(q[b], np.float64),
                      k64[b, start[b]:end[b]]) * D ** -0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b] = np.einsum("hs,shd->hd", p, v64[b, start[b]:end[b]])
    return out


def _bf16_bias_attention(q, k, v, bias, scale):
    """gqa_attention's bf16 math with an additive fp32 bias [B, T, S] instead of a select."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.astype(k.dtype).reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(s + bias[:, None, None], axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hq, D)


def mask_variants(a, argv) -> int:
    rng = np.random.default_rng(1)
    rows = []
    t_start = time.time()
    for name, Hq, Hkv in (("llama3-8b", 32, 8), ("qwen3-30b-a3b", 32, 4)):
        for B, S in ((1, 576), (8, 128)):
            D = 128
            end = np.full(B, S - 64)
            start = rng.integers(0, 48, B)
            slots = np.arange(S)
            valid = jnp.asarray((slots >= start[:, None]) & (slots < end[:, None]))   # [B, S]
            q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.bfloat16)
            ref = reference(np.asarray(q[:, 0].astype(jnp.float32)), k, v, start, end)
            causal = jnp.ones((1, S), bool)

            def mask_of(valid):               # as nn.attention.advance: per step, [B, T, S]
                return causal[None] & valid[:, None, :]

            sc = D ** -0.5
            variants = {
                "bf16_where": lambda q, k, v, valid: gqa_attention(q, k, v, mask_of(valid), sc),
                "bf16_bias": lambda q, k, v, valid: _bf16_bias_attention(
                    q, k, v, jnp.where(mask_of(valid), 0.0, -1e30), sc),
                "bf16_nomask": lambda q, k, v, valid: _bf16_bias_attention(
                    q, k, v, jnp.zeros((B, 1, S), jnp.float32), sc),
                "dpa_xla": lambda q, k, v, valid: jax.nn.dot_product_attention(
                    q, k, v, mask=mask_of(valid)[:, None], scale=sc, implementation="xla"),
                "dpa_cudnn": lambda q, k, v, valid: jax.nn.dot_product_attention(
                    q, k, v, mask=mask_of(valid)[:, None], scale=sc, implementation="cudnn"),
            }
            for vname, fn in variants.items():
                row = dict(model=name, B=B, S=S, Hq=Hq, Hkv=Hkv, variant=vname)
                try:
                    got = np.asarray(jax.jit(fn)(q, k, v, valid)[:, 0].astype(jnp.float32))
                    if vname != "bf16_nomask":
                        row["rel_max_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                    row["us"] = round(1e6 * time_in_loop(fn, (q, k, v, valid), iters=a.iters), 2)
                    row["kernels"] = hlo_kernels(fn, q, k, v, valid)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(json.dumps(row), flush=True)
                rows.append(row)
    write_json(a.out, dict(meta=run_metadata(__file__, argv), versions=versions(), rows=rows,
                           seconds=round(time.time() - t_start, 1)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "gpu_attention_probe.json"))
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--mask-variants", action="store_true",
                   help="the runtime-mask softmax variants (see the module docstring)")
    a = p.parse_args(argv)
    if a.mask_variants:
        return mask_variants(a, argv)
    from jax.experimental.pallas.ops.gpu import decode_attention
    rng = np.random.default_rng(0)
    rows = []
    t_start = time.time()
    for name, Hq, Hkv in (("llama3-8b", 32, 8), ("qwen3-30b-a3b", 32, 4)):
        for B in (1, 8):
            for S in (576, 2048):
                D = 128
                end = np.full(B, S - 64)                       # slot of this step + 1
                start = rng.integers(0, 48, B)                 # left padding per row
                slots = np.arange(S)
                mask = jnp.asarray((slots >= start[:, None]) & (slots < end[:, None]))[:, None]
                q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.bfloat16)
                k = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.bfloat16)
                v = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.bfloat16)
                ref = reference(np.asarray(q[:, 0].astype(jnp.float32)), k, v, start, end)
                st, ln = jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32)
                # Its splits must divide S into whole key blocks: 16 x 128 where they fit.
                bk, ks = (128, 16) if S % 2048 == 0 else (64, S // 64)
                variants = {
                    "fp32_highest": lambda q, k, v: gqa_attention(
                        q, k.astype(jnp.float32), v.astype(jnp.float32), mask, D ** -0.5),
                    "bf16": lambda q, k, v: gqa_attention(q, k, v, mask, D ** -0.5),
                    "pallas_gqa": lambda q, k, v: decode_attention.gqa(
                        q[:, 0], k, v, st, ln, sm_scale=D ** -0.5, block_k=bk,
                        k_splits=ks)[:, None],
                }
                for vname, fn in variants.items():
                    row = dict(model=name, B=B, S=S, Hq=Hq, Hkv=Hkv, variant=vname)
                    try:
                        got = np.asarray(jax.jit(fn)(q, k, v)[:, 0].astype(jnp.float32))
                        row["rel_max_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                        row["us"] = round(1e6 * time_in_loop(fn, (q, k, v), iters=a.iters), 2)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:400]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    write_json(a.out, dict(meta=run_metadata(__file__, argv),
                           versions=versions(), rows=rows,
                           seconds=round(time.time() - t_start, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
