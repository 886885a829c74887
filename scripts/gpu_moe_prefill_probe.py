"""Probe for a MoE prefill plan built from a dequantize kernel and a grouped tensor-core GEMM
(tuning aid, bench/NOTES.md session 31; not a product path).

  python scripts/gpu_moe_prefill_probe.py [--m 512,1024,4096] [--out probe.json]

For the Qwen3-30B-A3B geometry (H 2048, I 768, E 128, top-8, K4 mcg), per m: (1) every expert's
W_hat dequantized by ffi/trellis_dequant.py in one launch per stack (the [2, E] gate/up stack
viewed as one [2 E H, I] weight, the down stack as [E I, H]: the kernel's tiles are independent
without rotations); (2) the grouped GEMMs on those weights over the sorted, block-padded rows of
ops.moe_routing.pack_routes, through Pallas' Mosaic GPU ragged dot
(jax.experimental.pallas.ops.gpu.ragged_dot_mgpu) at a few tilings, checked against
lax.ragged_dot on the same fp16 inputs; (3) for scale, a cuBLAS batched dot over experts padded
to the mean route count (a lower bound on what any grouped GEMM of these sizes costs) and XLA's
lax.ragged_dot. Times: median of a jitted loop (ffi/bench.time_in_loop), microseconds.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from exl3_jax.ffi import bench as gb
from exl3_jax.ffi import trellis_gemm as tg
from exl3_jax.ops.moe_routing import pack_routes, select_block_m
from exl3_jax.trellis import Exl3Weight

H, I, E, TOP_K, K, CODEBOOK = 2048, 768, 128, 8, 4, "mcg"


def stack_view(w: Exl3Weight) -> Exl3Weight:
    """A stack of weights [..., k/16, n/16, W] as one [prod(lead) * k, n] weight (W_hat only:
    the dequantize kernel without rotations decodes each 16x16 tile on its own)."""
    lead = int(np.prod(w.stack_shape))
    t = w.trellis.reshape(lead * w.k // 16, w.n // 16, w.trellis.shape[-1])
    return Exl3Weight(t, jnp.ones((lead * w.k,), jnp.float16), jnp.ones((w.n,), jnp.float16),
                      None, w.codebook, w.K, lead * w.k, w.n)


def dequant_all(w13, down, scale=None):
    """fp16 W_hat stacks: gate/up [2, E, H, I], down [E, I, H]. ``scale`` (float32 [1]) is not
    read without rotations; passing one computed in a timing loop keeps XLA from hoisting the
    launches out of it (they would be loop-invariant)."""
    a = tg.dequantize_f16(stack_view(w13), rotate=False, scale=scale).reshape(2, E, H, I)
    b = tg.dequantize_f16(stack_view(down), rotate=False, scale=scale).reshape(E, I, H)
    return a, b


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", default="512,1024,4096")
    p.add_argument("--tilings", default="64,128,64,4,1|128,128,64,4,1|128,256,64,3,1|64,256,64,4,2",
                   help="'|'-separated block_m,block_n,block_k,max_concurrent_steps,grid_block_n")
    p.add_argument("--xla-ragged", action="store_true",
                   help="also time lax.ragged_dot (XLA's: ~5 ms a plane at m = 512)")
    p.add_argument("--tiny", action="store_true", help="H 256, I 128, E 8 (a CPU smoke test, "
                   "EXL3_JAX_EMULATE=1; the Mosaic GPU rows then record their error)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    global H, I, E
    if a.tiny:
        H, I, E = 256, 128, 8
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    except Exception as e:      # noqa: BLE001 -- no Mosaic GPU here: the other rows still run
        rd, rd_error = None, f"{type(e).__name__}: {e}"[:300]

    out = {"versions": gb.versions(), "rows": []}
    w13, down = gb.random_moe_weights(H, I, E, K, CODEBOOK)

    # (1) dequantize every expert, and check it against the reference decode on one expert
    wa, wb = jax.jit(dequant_all)(w13, down)
    from exl3_jax.trellis import decode_trellis
    ref = decode_trellis(w13.trellis[1, 5], CODEBOOK)
    out["dequant_exact_expert5_up"] = bool(np.array_equal(
        np.asarray(wa[1, 5], np.float16).view(np.uint16),
        np.asarray(ref, np.float16).view(np.uint16)))

    def both(x, a, b):       # both stacks' outputs used, so neither launch is dead code
        wa, wb = dequant_all(a, b, scale=1 + 0 * x.reshape(1).astype(jnp.float32))
        return x + wa[0, 0, :1, :1].astype(jnp.float32) + wb[0, :1, :1].astype(jnp.float32)
    us = 1e6 * gb.time_in_loop(both, (jnp.zeros((1, 1), jnp.float32), w13, down), iters=16)
    out["dequant_all_us"] = us
    print(f"dequant all experts (w13 + down, {3 * E * H * I / 1e6:.0f} M weights): {us:.1f} us, "
          f"exact vs decode_trellis: {out['dequant_exact_expert5_up']}", flush=True)

    for m in [int(v) for v in a.m.split(",")]:
        ids, _ = gb.random_topk(m, E, TOP_K, seed=m)
        bm = select_block_m(m * TOP_K, E)
        pr = pack_routes(ids, E, bm)
        blocks_e = jnp.sum(pr.block_expert[None, :] == jnp.arange(E)[:, None], axis=1)
        sizes = (blocks_e * bm).astype(jnp.int32)                  # [E] rows per expert
        rows = pr.row_token.shape[0]
        used = int(jnp.sum(sizes))
        rng = np.random.default_rng(m)
        x1 = jnp.asarray(rng.standard_normal((rows, H)) * 0.5, jnp.float16)
        x2 = jnp.asarray(rng.standard_normal((rows, I)) * 0.5, jnp.float16)
        row = dict(m=m, block_m=bm, rows=rows, used_rows=used)
        mean = -(-m * TOP_K // E)

        def ref_dot(x, w):
            return lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
        r1 = jax.jit(ref_dot)(x1, wa[0])
        r2 = jax.jit(ref_dot)(x2, wb)
        if a.xla_ragged:
            row["xla_ragged_fc1_plane_us"] = 1e6 * gb.time_in_loop(ref_dot, (x1, wa[0]),
                                                                   iters=8)
        xe = jnp.zeros((E, mean, H), jnp.float16)
        row["batched_fc1_plane_us"] = 1e6 * gb.time_in_loop(
            lambda x, w: jnp.einsum("ech,ehi->eci", x, w, preferred_element_type=jnp.float32),
            (xe, wa[0]), iters=16)
        xe2 = jnp.zeros((E, mean, I), jnp.float16)
        row["batched_fc2_us"] = 1e6 * gb.time_in_loop(
            lambda x, w: jnp.einsum("eci,eih->ech", x, w, preferred_element_type=jnp.float32),
            (xe2, wb), iters=16)
        row["mgpu"] = []
        for tiling in a.tilings.split("|"):
            bmk, bn, bk, steps, gbn = (int(v) for v in tiling.split(","))
            res = dict(tiling=tiling)
            for name, x, w, r in (("fc1_plane", x1, wa[0], r1), ("fc2", x2, wb, r2)):
                if w.shape[2] % (bn * gbn):
                    res[name] = "n does not tile"
                    continue
                if rd is None:
                    res[name] = rd_error
                    continue
                try:
                    def f(x, w, bmk=bmk, bn=bn, bk=bk, steps=steps, gbn=gbn):
                        return rd.ragged_dot(x, w, group_sizes=sizes, block_m=bmk, block_n=bn,
                                             block_k=bk, max_concurrent_steps=steps,
                                             grid_block_n=gbn)
                    y = jax.jit(f)(x, w)
                    res[name + "_rel_l2"] = rel_l2(np.asarray(y[:used], np.float32),
                                                   np.asarray(r[:used]))
                    res[name + "_us"] = 1e6 * gb.time_in_loop(f, (x, w), iters=16)
                except Exception as e:     # noqa: BLE001 -- record and go on
                    res[name] = f"{type(e).__name__}: {e}"[:300]
            row["mgpu"].append(res)
            print(m, json.dumps(res), flush=True)
        print(json.dumps({k: v for k, v in row.items() if k != "mgpu"}), flush=True)
        out["rows"].append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
