"""Where bench's timing-loop barrier costs time (session 40; call 86 measured +0.5-2 us per call
on ~25 us ops with `ffi.bench.timing_loop`'s per-call optimization barrier).

For four ops (the 4096x14336 K4 mcg linear at m = 1, the bf16 dot of that shape, the
Qwen3-30B-A3B MoE layer at m = 1 and 8, as `bench moe` builds them) it builds the timing loop
in four forms:
  call  session 39's timing_loop (each call's rest arguments through a barrier with the chain's
        scalar),
  none  the loop before session 39 (no barrier: weight-only work may be hoisted),
  trip  one barrier per loop trip over every copy of the rest arguments,
  after main's timing_loop from session 40 (each call's rest arguments through a barrier with
        the chained x, x + 0 * c: after the chain's add, not between two ops XLA would fuse),
writes each compiled module's text to OUT/<op>_<form>.hlo, prints per computation the counts of
custom calls, fusions, copies and command buffers, and times the forms in alternation
(``--rounds`` rounds of a median of 3 loop runs each, ffi.bench.median_run_seconds).

    python scripts/gpu_loop_probe.py --out /tmp/res/loop_probe
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_bench_common as common  # noqa: E402


def loop_of(op, form: str, trips: int, unroll: int, copies: int):
    """The timing loop (x, rests) -> f32 [] in ``form`` (module docstring); "after" is
    ffi.bench.timing_loop itself (from session 40)."""
    from exl3_jax.ffi import bench
    if form == "after":
        return bench.timing_loop(op, trips, unroll, copies)
    if form not in ("call", "none", "trip"):
        raise ValueError(f"unknown loop form {form!r}")

    @jax.jit
    def loop(x, rests):
        def trip(_, c):
            rs = rests
            if form == "trip":
                c, rs = lax.optimization_barrier((c, rests))
            for j in range(unroll):
                rest = rs[j % copies]
                if form == "call":
                    c, rest = lax.optimization_barrier((c, rest))
                y = op(x + (c * 0).astype(x.dtype), *rest)
                c = y.reshape(-1)[0].astype(jnp.float32)
            return c
        return lax.fori_loop(0, trips, trip, jnp.float32(0))
    return loop


COUNTED = {"custom-call": r"\bcustom-call\(", "fusion": r"\bfusion\(", "copy": r"\bcopy\(",
           "command_buffer": r"command_buffer", "opt-barrier": r"opt-barrier\(",
           "while": r"\bwhile\("}


def hlo_counts(text: str) -> dict:
    """{computation name: {kind: count}} for the computations holding any counted instruction
    (COUNTED), from a compiled module's text."""
    out, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            continue
        if name is None:
            continue
        for kind, pat in COUNTED.items():
            if re.search(pat, line):
                out.setdefault(name, collections.Counter())[kind] += 1
    return {k: dict(v) for k, v in out.items()}


def build_op(tag: str):
    """(op, x, rests list, iters) of probed op ``tag`` (OPS), built as bench builds it."""
    from exl3_jax.ffi import bench
    from exl3_jax.ffi import trellis_gemm as tg
    from exl3_jax.ffi import trellis_moe as tm
    kind, shape, m = OPS[tag]
    k, n = shape
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)), jnp.bfloat16)
    iters = bench.iters_for(m, k, n)
    if kind == "linear":
        w = bench.random_weight(k, n, 4, "mcg")
        return (lambda x, w: tg.trellis_matmul_gpu(x, w), x,
                bench.cycled_copies((w,), bench.weight_copies(w.nbytes, "cold")), iters)
    if kind == "bf16":
        wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02, jnp.bfloat16)
        return (lambda x, w: jnp.dot(x, w), x,
                bench.cycled_copies((wb,), bench.weight_copies(2 * k * n, "cold")), iters)
    H, I, E, top_k = bench.MOE_GEOMETRIES["qwen3-30b-a3b"]
    experts = bench.random_moe_weights(H, I, E, 4, "mcg")
    ids, wts = bench.random_topk(m, E, top_k, seed=m)
    return (lambda x, i, w, e: tm.moe_gpu(x, i, w, *e, fused=True), x,
            [(i, wts, experts) for i in bench.routed_variants(ids, E)],
            int(max(8, min(128, 2e4 / m))))


OPS = {   # tag: (kind, (k, n) or (H, -), m); the K4 mcg linear, its bf16 dot, the Qwen3 layer
    "linear": ("linear", (4096, 14336), 1), "bf16": ("bf16", (4096, 14336), 1),
    "moe_m1": ("moe", (2048, 0), 1), "moe_m8": ("moe", (2048, 0), 8),
    "prefill_1024": ("linear", (8192, 28672), 1024), "bf16_1024": ("bf16", (8192, 28672), 1024),
    "prefill_4096": ("linear", (4096, 14336), 4096), "bf16_4096": ("bf16", (4096, 14336), 4096),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the HLO texts and JSON")
    ap.add_argument("--forms", default="call,none,trip,after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", default="linear,bf16,moe_m1,moe_m8", help=f"of {list(OPS)}")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    forms = args.forms.split(",")
    from exl3_jax.ffi import bench
    unroll = 8
    result = dict(common.run_metadata(__file__, argv), versions=common.versions(), ops={})
    for tag in args.ops.split(","):
        op, x, rests, iters = build_op(tag)
        copies, trips = len(rests), max(1, iters // unroll)
        timers, counts = {}, {}
        for form in forms:
            loop = loop_of(op, form, trips, unroll, copies)
            compiled = loop.lower(x, rests).compile()
            text = compiled.as_text()
            (args.out / f"{tag}_{form}.hlo").write_text(text)
            counts[form] = hlo_counts(text)
            jax.block_until_ready(compiled(x, rests))

            timers[form] = lambda compiled=compiled: 1e6 * bench.median_run_seconds(
                lambda: compiled(x, rests)) / (trips * unroll)
        us = {f: [] for f in forms}
        for _ in range(args.rounds):
            for f in forms:
                us[f].append(round(timers[f](), 2))
        result["ops"][tag] = dict(us=us, median={f: statistics.median(v) for f, v in us.items()},
                                  hlo=counts)
        print(json.dumps({"op": tag, "median_us": result["ops"][tag]["median"], "us": us}))
        for f in forms:
            print(f"  {f}: {json.dumps(counts[f])[:600]}")
    (args.out / "loop_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
