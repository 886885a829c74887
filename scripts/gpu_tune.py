"""Time the Trellis GEMM's pieces and plan variants on a GPU (tuning aid; results in bench/NOTES.md).

  python scripts/gpu_tune.py --out tune.json [--budget-s 200]
  python scripts/gpu_tune.py --sweep [--shapes 8192x28672,...] [--m 1,16] [--configs 4mcg,4mul1]
      --out sweep.json    decode-plan grid: the full op (both Hadamard kernels included, so the
                          cost of more K-split partials counts) for splits x n_tiles x warps
  python scripts/gpu_tune.py --groups llama8b_qkv,... [--m 1,8] [--configs 4mcg]
      --out groups.json   linear groups (one launch per kernel) vs their members as separate
                          linears
  python scripts/gpu_tune.py --caps 0,5,6,8 [--shapes ...] [--m 1,16] [--configs ...]
      --out caps.json     the full op with the plan's decode kernel compiled for at least that
                          many CTAs per SM (a register cap; 0 = none)

Per shape / codebook / m: the full op (Hadamard kernels + decode kernel), the same with jnp
transforms, the decode kernel alone for variants of its plan (unroll, n_tiles, warps, splits),
the transform kernels alone. All timed in a jitted loop (exl3_jax.ffi.bench.time_in_loop). The
prefill plan's parts: scripts/gpu_prefill_parts.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ops.plans import select_plan


def us(fn, args, m, k, n):
    try:
        return round(1e6 * gb.time_in_loop(fn, args, iters=gb.iters_for(m, k, n)), 2)
    except Exception as e:   # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]


def decode_rows(k, n, cb, K, m, deadline):
    w = gb.random_weight(k, n, K, cb)
    base = tg.plan_for(m, w)        # the production plan on this device (arch, codebook)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
    row = {"k": k, "n": n, "codebook": cb, "K": K, "m": m, "plan": dataclasses.asdict(base)}
    row["full_cute"] = us(lambda x, w: tg.trellis_matmul_gpu(x, w), (x, w), m, k, n)
    row["full_xla"] = us(lambda x, w: tg.trellis_matmul_gpu(x, w, transforms="xla"), (x, w),
                         m, k, n)
    cfg = tg._mma_config(w, base)
    xw, _ = tg.decode_input_words(x, w.suh, cfg)
    row["had_in"] = us(lambda x, s: tg.decode_input_words(x, s, cfg)[0], (x, w.suh), m, k, n)
    part = jnp.zeros((cfg.splits * cfg.m_pad * n,), jnp.float32)
    row["had_out"] = us(lambda p, v: tg.hadamard_out(p, v, None, None, m=m, m_pad=cfg.m_pad,
                                                     splits=cfg.splits, n=n),
                        (part, w.svh), m, k, n)
    variants = {"base": base}
    per = lambda p: k // 16 // p.splits // p.warps   # noqa: E731
    for u in (1, 2, 8):
        variants[f"unroll{u}"] = dataclasses.replace(base, unroll=u)
    for nt in (1, 4):
        variants[f"ntiles{nt}"] = dataclasses.replace(base, n_tiles=nt)
    variants["warps4"] = dataclasses.replace(base, warps=4)
    variants["splits_x2"] = dataclasses.replace(base, splits=base.splits * 2)
    if base.splits > 1:
        variants["splits_half"] = dataclasses.replace(base, splits=base.splits // 2)
    row["kernel"] = {}
    for name, p in variants.items():
        if time.time() > deadline:
            break
        if per(p) < 1 or per(p) % p.unroll or (k // 16) % p.splits:
            continue
        row["kernel"][name] = us(lambda xw, w: tg.mma_partials_words(xw, w, p), (xw, w), m, k, n)
    return row


def sweep_rows(k, n, cb, K, m, deadline):
    """The full decode op for every valid (splits, n_tiles, warps) around the plan's unroll."""
    w = gb.random_weight(k, n, K, cb)
    base = select_plan(m, k, n)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
    row = {"k": k, "n": n, "codebook": cb, "K": K, "m": m, "plan": dataclasses.asdict(base),
           "full_us": {}}
    for warps, n_tiles in ((8, 1), (8, 2), (4, 2)):
        for splits in (1, 2, 4, 8, 16):
            if time.time() > deadline:
                return row
            per_warp = k // 16 // splits // warps
            if (n // 16) % n_tiles or (k // 16) % splits or per_warp < 1:
                continue
            unroll = next(u for u in (base.unroll, 4, 2, 1) if per_warp % u == 0)
            p = dataclasses.replace(base, splits=splits, n_tiles=n_tiles, warps=warps,
                                    unroll=unroll)
            row["full_us"][f"w{warps}_nt{n_tiles}_s{splits}_u{unroll}"] = us(
                lambda x, w: tg.trellis_matmul_gpu(x, w, plan=p), (x, w), m, k, n)
    return row


def cap_rows(k, n, cb, K, m, caps, deadline):
    """The full decode op with the plan's kernel register-capped to fit ``c`` CTAs per SM."""
    w = gb.random_weight(k, n, K, cb)
    base = select_plan(m, k, n)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
    row = {"k": k, "n": n, "codebook": cb, "K": K, "m": m, "plan": dataclasses.asdict(base),
           "full_us": {}}
    for c in caps:
        if time.time() > deadline:
            break
        p = dataclasses.replace(base, min_ctas=c)
        row["full_us"][f"min_ctas{c}"] = us(lambda x, w: tg.trellis_matmul_gpu(x, w, plan=p),
                                            (x, w), m, k, n)
    return row


GROUPS = {"llama8b_qkv": (4096, (4096, 1024, 1024)), "llama8b_gate_up": (4096, (14336, 14336)),
          "qwen3moe_qkv": (2048, (4096, 512, 512))}


def group_rows(name, cb, K, m):
    """A linear group (one input transform, one decode launch, one output transform) vs its
    members as separate linears (three launches each), timed the same way."""
    from exl3_jax.ops import trellis_matmul_group
    k, members = GROUPS[name]
    ws = [gb.random_weight(k, n, K, cb, seed=i) for i, n in enumerate(members)]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
    nt = sum(members)
    row = {"group": name, "k": k, "members": list(members), "codebook": cb, "K": K, "m": m,
           "plan": dataclasses.asdict(select_plan(m, k, nt))}
    # The loop keeps one element of the op's result: one of every member's outputs, so XLA
    # cannot drop the other members' kernels as dead code (it does for a concatenation at m=1).
    def used(ys):
        return jnp.stack([y[..., -1] for y in ys]).sum()

    row["separate_us"] = us(lambda x, ws: used([tg.trellis_matmul_gpu(x, w) for w in ws]),
                            (x, ws), m, k, nt)
    row["group_us"] = us(lambda x, ws: used(trellis_matmul_group(x, ws, backend="gpu")),
                         (x, ws), m, k, nt)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--sweep", action="store_true", help="decode-plan grid (see the docstring)")
    p.add_argument("--shapes", default="8192x28672,4096x14336,14336x4096,4096x4096,4096x1024")
    p.add_argument("--caps", default=None, help="register-cap grid, e.g. 0,5,6,8")
    p.add_argument("--groups", default=None,
                   help=f"linear groups vs separate linears, from {sorted(GROUPS)}")
    p.add_argument("--m", default="1")
    p.add_argument("--configs", default="4mcg,4mul1", help="K and codebook, e.g. 3mcg,4mul1")
    a = p.parse_args(argv)
    t0 = time.time()
    deadline = t0 + a.budget_s
    result = {"versions": gb.versions(), "decode": [], "sweep": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    def grid(items):
        """(item, K, codebook, m) over items x --configs x --m until the deadline."""
        for item in items:
            for conf in a.configs.split(","):
                for m in map(int, a.m.split(",")):
                    if time.time() > deadline:
                        return
                    yield item, int(conf[0]), conf[1:], m

    if a.groups:
        result["groups"] = []
        for name, K, cb, m in grid(a.groups.split(",")):
            r = group_rows(name, cb, K, m)
            result["groups"].append(r)
            print(json.dumps(r), flush=True)
            save()
        result["seconds"] = time.time() - t0
        save()
        return 0

    if a.sweep or a.caps:
        for shape, K, cb, m in grid(a.shapes.split(",")):
            k, n = map(int, shape.split("x"))
            if a.caps:
                r = cap_rows(k, n, cb, K, m, [int(c) for c in a.caps.split(",")],
                             deadline)
            else:
                r = sweep_rows(k, n, cb, K, m, deadline)
            result["sweep"].append(r)
            best = min(((v, kk) for kk, v in r["full_us"].items()
                        if isinstance(v, float)), default=None)
            print(f"{shape} K{K} {cb} m={m}: plan {r['plan']['splits']}/"
                  f"{r['plan']['n_tiles']}/{r['plan']['warps']} best {best}",
                  json.dumps(r["full_us"]), flush=True)
            save()
        result["seconds"] = time.time() - t0
        save()
        return 0

    for (k, n) in ((4096, 14336), (8192, 28672)):
        for cb, K in (("mcg", 3), ("mul1", 4)):
            for m in (1, 16):
                if time.time() > deadline:
                    break
                r = decode_rows(k, n, cb, K, m, deadline)
                result["decode"].append(r)
                print(json.dumps(r), flush=True)
                save()
    result["seconds"] = time.time() - t0
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
