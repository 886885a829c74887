"""Benchmark the GPU Trellis GEMM against a bf16 jnp.dot, both timed inside a jitted loop.

Usage (on a CUDA machine with cutlass-dsl importable):
  python -m exl3_jax.ffi.bench [--shapes 4096x14336,8192x28672] [--K 3,4]
      [--codebooks mcg,mul1] [--m 1,4,16,32,128,1024,4096] [--out bench/results/gpu_bench.json]
(also scripts/gpu_bench_linear.py; meant to back `exl3-jax bench linear`).

Per (shape, K, codebook, m) it prints microseconds per call, effective GB/s on the compressed
weight bytes (trellis + suh + svh), the speedup over bf16 at the same (shape, m), and the fraction
of the decode floor (weights / decode rate measured in shared/bench/anchors.md: 3.69 T weights/s
for 3inst/mcg, 4.86 T/s for mul1, streaming from HBM).

`bench moe` (main_moe; `python -m exl3_jax.ffi.bench moe [--quick] [--out F]`): the grouped
Trellis MoE layer (exl3_jax.ffi.trellis_moe.moe_gpu, route packing included) for the issue's
geometries (Qwen3-30B-A3B H2048 I768 E128 top-8, GLM-4.5-Air-like H4096 I1408 E128 top-8, GLM-5.2
TP4 shard H6144 I512 E256 top-8) and m in {1, 2, 4, 8, 16, 32, 128, 1024, 4096}, against
  * the floor of the touched experts: max(HBM time of their trellis + rotation bytes at
    4.25 TB/s, decode ALU time of their 3*H*I weights each at the anchors.md decode rate,
    tensor-core time of the useful 2*m*top_k*3*H*I FLOPs at the 989 TFLOP/s fp16 peak);
  * an unfused XLA baseline in the same run: routes sorted by expert, lax.ragged_dot over
    dequantized bf16 experts for gate, up and down (only groups with routes do work), SwiGLU,
    fp32 top-k sum (ragged_moe_baseline; the weights are dequantized outside the timed loop).

Why a jitted loop: JAX per-call dispatch costs ~40-50 us on the H200 (anchors.md), more than the
kernels at small m. Each iteration feeds a value of the previous output back into the input
(x + 0 * y[0, 0]: XLA cannot fold 0 * y for floats), so nothing is hoisted out of the loop.
L2 (session 24): by default the loop's calls read weights that are not in the L2 from the
previous call (`--l2 cold`: cycled weight copies, for the MoE routes to different experts), as a
model's distinct layers do; before, a weight that fit the 50 MB L2 (4096x14336 K4: 29 MB; the
MoE's touched experts at small m) was served from it call after call, while the bf16 baseline,
4x larger, mostly was not.
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
    from . import emulate
    if emulate.enabled():      # the kernels' PTX on the CPU: correctness only, no timings
        info["emulated"] = os.environ.get(emulate.ARCH_ENV, emulate.DEFAULT_ARCH)
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


L2_BYTES = 50 << 20         # the H100's and H200's L2
COLD_COPIES = (1, 2, 4, 8)   # weight copies time_in_loop may cycle through (divide ``unroll``)


L2_MODES = ("cold", "warm")   # the benchmarks' --l2 choices


def cold_copies(nbytes: int) -> int:
    """Copies of an op's nbytes of weights that together exceed 3x the L2, so a loop cycling
    through them reads each from HBM as a model's distinct layers do (at most 8)."""
    return next((c for c in COLD_COPIES if c * nbytes >= 3 * L2_BYTES), COLD_COPIES[-1])


def weight_copies(nbytes: int, l2: str) -> int:
    """time_in_loop's ``copies`` for nbytes of weights in L2 mode ``l2``: cold_copies for
    "cold", one for "warm" (the weights stay L2-resident where they fit)."""
    check_l2(l2)
    return cold_copies(nbytes) if l2 == "cold" else 1


def check_l2(l2: str) -> None:
    if l2 not in L2_MODES:
        raise ValueError(f"l2 must be one of {L2_MODES}, got {l2!r}")


def timing_loop(op, trips: int, unroll: int, copies: int):
    """time_in_loop's jitted loop (x, rests) -> float32 []: ``trips`` trips of ``unroll``
    chained calls op(x + 0 * previous output, *rests[j % copies]).

    Each call's rest arguments pass through an optimization barrier together with its chained
    x, so XLA sees them as loop-variant: work on the weights alone (a dequantize launch that
    reads no x) is not hoisted out of the loop, as a model's forward pays it on every call.
    Without the barrier the prefill plan's W_hat dequantize (its transforms form, until
    session 39) left the loop and its rows never paid the ~200 us it took at 8192x28672. The
    barrier comes after the chain's add: placed on the chain's scalar, between y[0] and
    x + 0 * y[0], it kept XLA from fusing the two into one kernel (call 88)."""
    @jax.jit
    def loop(x, rests):
        def trip(_, c):
            for j in range(unroll):
                xj, rest = lax.optimization_barrier((x + (c * 0).astype(x.dtype),
                                                     rests[j % copies]))
                y = op(xj, *rest)
                c = y.reshape(-1)[0].astype(jnp.float32)
            return c
        return lax.fori_loop(0, trips, trip, jnp.float32(0))
    return loop


def cycled_copies(rest: tuple, copies: int) -> list:
    """[rest] and copies - 1 copies of it in distinct device buffers (any pytrees): the rest
    arguments a timing loop's calls cycle through (time_in_loop's ``copies``)."""
    return [rest] + [jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), rest)
                     for _ in range(copies - 1)]


def loop_timer(op, args, *, iters: int, reps: int = 3, unroll: int = 8, copies: int = 1,
               variants=None):
    """time_in_loop's loop, compiled and warmed up once: a callable that times it again on
    each call (seconds per op call, median of ``reps``), so that two sides can be timed in
    alternation without recompiling (bench's ``rounds``)."""
    rests = variants or cycled_copies(tuple(args[1:]), copies)
    copies = len(rests)
    if unroll % copies:
        raise ValueError(f"copies={copies} must divide unroll={unroll}")
    iters = max(unroll, iters // unroll * unroll)
    loop = timing_loop(op, iters // unroll, unroll, copies)
    jax.block_until_ready(loop(args[0], rests))          # compile + warm up
    return lambda: median_run_seconds(lambda: loop(args[0], rests), reps) / iters


def median_run_seconds(run, reps: int = 3) -> float:
    """Median wall seconds of ``reps`` runs of ``run()`` (a jitted loop's call), each to
    completion (block_until_ready)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_in_loop(op, args, *, iters: int, reps: int = 3, unroll: int = 8,
                 copies: int = 1, variants=None) -> float:
    """Seconds per op call: median of ``reps`` timings of a jitted loop of ``iters`` calls,
    ``unroll`` calls per loop trip (an XLA while-loop trip costs several microseconds on the
    GPU, so unrolling keeps that out of the per-call time). ``op(x, *rest)`` returns an array;
    args[0] is x; x + 0 * (previous output) chains the calls. ``copies`` (dividing unroll):
    the call j of a trip reads copy j % copies of ``rest`` (distinct device buffers), so a
    weight that fits the L2 is not served from it call after call (cold_copies); or
    ``variants``: the rest-argument tuples themselves (e.g. the MoE's routes to different
    experts), call j taking variant j % len(variants)."""
    return loop_timer(op, args, iters=iters, reps=reps, unroll=unroll, copies=copies,
                      variants=variants)()


def loop_overhead_us(m: int, k: int) -> float:
    """Per-call cost of the loop scaffolding alone (x + 0 * c and one element read)."""
    x = jnp.zeros((m, k), jnp.bfloat16)
    return 1e6 * time_in_loop(lambda x: x[:1, :1], (x,), iters=iters_for(m, k, k))


def iters_for(m: int, k: int, n: int) -> int:
    work = m * k * n
    return int(max(16, min(256, 4e11 / max(work, 1))))


def bench(shapes, Ks, codebooks, ms, *, deadline: float | None = None, log=print,
          groups=None, done=(), on_row=None, l2: str = "cold",
          rounds: int = 3) -> list[dict]:
    """Rows of the Trellis GEMM vs bf16 for every (shape, K, codebook, m).

    groups: optional set of (k, n, K, codebook) to run (default all); done: (k, n, K, codebook,
    m) keys to skip; on_row(row) is called after each row (exl3_jax.ffi.bench_linear uses these
    for parts and resuming). A shape with nothing to run gets no bf16 baseline. l2: "cold"
    (both sides cycle through cold_copies of their weights, so neither is served from the L2
    call after call: a model's layers are distinct) or "warm" (one copy: a weight that fits
    the L2, e.g. 4096x14336 K4's 29 MB, stays there across the loop; the method before
    session 24). rounds: each row times its op and the bf16 dot in alternation, ``rounds``
    times each (medians; every round in us_rounds / bf16_us_rounds), so both sides see the
    same clock: the large dots run at the card's power cap, and one row timed apart from its
    baseline moved 10% between two runs (session 38)."""
    check_l2(l2)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    from exl3_jax.ffi import trellis_gemm as tg

    rows = []
    for (k, n) in shapes:
        todo = {(K, cb, m) for K in Ks for cb in codebooks for m in ms
                if (groups is None or (k, n, K, cb) in groups) and (k, n, K, cb, m) not in done}
        if not todo:
            continue
        wb = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)) * 0.02, jnp.bfloat16)
        bf16_timer, overhead_us = {}, {}
        for m in sorted({m for _, _, m in todo}):
            if deadline and time.time() > deadline:
                log("bench: deadline reached, stopping")
                return rows
            x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)), jnp.bfloat16)
            bf16_timer[m] = loop_timer(lambda x, w: jnp.dot(x, w), (x, wb),
                                       iters=iters_for(m, k, n),
                                       copies=weight_copies(2 * k * n, l2))
            overhead_us[m] = loop_overhead_us(m, k)
            log(f"{k:>6}x{n:<6} m={m:<5} loop overhead {overhead_us[m]:6.1f} us")
        for K in Ks:
            for cb in codebooks:
                if not any((K, cb, m) in todo for m in ms):
                    continue
                w = random_weight(k, n, K, cb)
                tbytes = int(np.prod(w.trellis.shape)) * 2
                for m in ms:
                    if (K, cb, m) not in todo:
                        continue
                    if deadline and time.time() > deadline:
                        log("bench: deadline reached, stopping")
                        return rows
                    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k)),
                                    jnp.bfloat16)
                    plan = tg.plan_for(m, w)
                    copies = weight_copies(w.nbytes, l2)
                    t_row = time.time()
                    op_us, bf16_us = [], []
                    try:
                        op_timer = loop_timer(lambda x, w: tg.trellis_matmul_gpu(x, w),
                                              (x, w), iters=iters_for(m, k, n), copies=copies)
                        for _ in range(rounds):
                            op_us.append(1e6 * op_timer())
                            bf16_us.append(1e6 * bf16_timer[m]())
                        err = None
                    except Exception as e:   # noqa: BLE001 -- record and continue
                        err = f"{type(e).__name__}: {e}"[:500]
                    us = statistics.median(op_us) if op_us and not err else float("nan")
                    bf16 = statistics.median(bf16_us or [1e6 * bf16_timer[m]()])
                    floor_us = 1e6 * k * n / DECODE_RATE[cb]
                    row = dict(k=k, n=n, K=K, codebook=cb, m=m, plan=plan.kind, us=us,
                               bf16_us=bf16, loop_overhead_us=overhead_us[m],
                               speedup_vs_bf16=bf16 / us,
                               us_rounds=[round(v, 2) for v in op_us],
                               bf16_us_rounds=[round(v, 2) for v in bf16_us],
                               gbps=w.nbytes / us / 1e3, trellis_bytes=tbytes,
                               floor_us=floor_us, floor_fraction=floor_us / us, error=err,
                               l2=l2, weight_copies=copies,
                               wall_s=round(time.time() - t_row, 2))
                    rows.append(row)
                    if on_row:
                        on_row(row)
                    log(f"{k:>6}x{n:<6} K={K:<4} {cb:<5} m={m:<5} {plan.kind:<8} "
                        f"{us:9.1f} us  bf16 {bf16:9.1f} us  x{bf16 / us:5.2f}  "
                        f"{row['gbps']:7.0f} GB/s  floor {floor_us:7.1f} us "
                        f"({row['floor_fraction']:.2f})  [{row['wall_s']:.1f} s]"
                        + (f"  ERR {err}" if err else ""))
    return rows


# ---------------------------------------------------------------------------------------------
# bench moe: the grouped Trellis MoE vs the touched-experts roofline and an unfused XLA baseline

MOE_GEOMETRIES = {          # name: (hidden H, intermediate I, experts E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "glm-4.5-air": (4096, 1408, 128, 8),
    "glm-5.2-tp4": (6144, 512, 256, 8),
}
MOE_M = (1, 2, 4, 8, 16, 32, 128, 1024, 4096)
MOE_QUICK_M = (1, 8, 128, 4096)
HBM_BYTES_PER_S = 4.25e12   # device-to-device copy on the H200 (anchors.md), read + write
MMA_FLOPS = 989e12          # H200 dense fp16 tensor-core peak (the large-m bound)


def random_moe_weights(H: int, I: int, E: int, K, codebook: str, seed: int = 0):
    """Random stacked EXL3 experts: w13 [2, E] (H -> I), down [E] (I -> H)."""
    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight
    W = width_from_rate(K)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 6))

    def stack(lead, k, n):
        # random bits drawn on the device (GLM-5.2-sized stacks are ~400 M int16 words)
        bits = jax.random.bits(next(keys), (*lead, k // 16, n // 16, W), jnp.uint16)
        t = lax.bitcast_convert_type(bits, jnp.int16)
        suh = jnp.where(jax.random.bernoulli(next(keys), 0.5, (*lead, k)), 1.0,
                        -1.0).astype(jnp.float16)
        svh = jax.random.uniform(next(keys), (*lead, n), jnp.float32, 0.005,
                                 0.02).astype(jnp.float16)
        return Exl3Weight(t, suh, svh, None, codebook, K, k, n)
    return stack((2, E), H, I), stack((E,), I, H)


def random_topk(T: int, E: int, top_k: int, seed: int = 0):
    """Uniform random distinct experts per token and softmax-like weights."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, top_k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w / w.sum(1, keepdims=True))


def ragged_moe_baseline(x, ids, weights, wg, wu, wd):
    """Unfused XLA MoE over dequantized bf16 experts [E, H, I] / [E, I, H]: sort routes by
    expert, lax.ragged_dot for gate, up and down (only groups with routes do work), SwiGLU,
    unsort, fp32 top-k sum. x bf16 [T, H] -> float32 [T, H]."""
    T, top_k = ids.shape
    E = wg.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    xs = x[order // top_k]                                                  # [R, H]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    g = lax.ragged_dot(xs, wg, sizes, preferred_element_type=jnp.float32)
    u = lax.ragged_dot(xs, wu, sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(jnp.bfloat16)
    y = lax.ragged_dot(h, wd, sizes, preferred_element_type=jnp.float32)    # [R, H]
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    return jnp.einsum("tkh,tk->th", y, weights.astype(jnp.float32))


def routes_of_call(x, ids, plan=None):
    """ids as a value of the loop's chained x (unchanged: x is never NaN there). In a model the
    router computes each layer's ids, so its route packing is part of the layer; ids an op
    closes over are constants of time_in_loop's loop, and XLA hoists the packing out of it as
    invariant work (bench moe's layer times up to session 32 left it out that way). Ids passed
    as loop arguments need no tie: timing_loop keeps them loop-variant.
    ``plan``: the layer's MoePlan; a per-route plan (no packing ops to hoist) gets ids as they
    are, so the select adds no kernel the model would not run."""
    if plan is not None and plan.packing == "per_route":
        return ids
    return jnp.where(jnp.isnan(x[0, 0]), -1, ids)


def routed_variants(ids, E: int, n: int = 8):
    """n routings of the same shape: expert ids shifted by multiples of E / n (mod E), so the
    calls of a timing loop that cycle through them touch different experts (bench_moe's L2-cold
    timing: a model's layers do not share experts)."""
    return [(ids + j * (E // n)) % E for j in range(n)]


def packing_us(ids, num_experts: int, plan, iters: int = 64) -> float:
    """Microseconds of the layer's route packing alone (trellis_moe.pack_for, every table:
    XLA would drop the ones a single output does not need); per-route plans have none (their
    kernels read the ids), 0.0."""
    from exl3_jax.ffi import trellis_moe as tm
    if plan.packing == "per_route":
        return 0.0
    return 1e6 * time_in_loop(lambda i: jnp.concatenate(
        [a.ravel() for a in jax.tree.leaves(tm.pack_for(i, num_experts, plan))]), (ids,),
        iters=iters, reps=3)


def bench_moe(geometries=None, ms=MOE_M, K=4, codebook: str = "mcg", *, budget_s=None,
              baseline: bool = True, unfused: bool = False, log=print,
              l2: str = "cold") -> list[dict]:
    """Microseconds per MoE layer (jitted loop; its route packing included: the ids are loop
    arguments, which timing_loop keeps loop-variant)
    for each geometry and token count m, with the touched experts' roofline (max of HBM time
    of their bytes and decode ALU time of their weights, anchors.md rates) and an unfused
    ragged_dot baseline in the same run. K: a rate, or a tuple of rates for a mixed-bitrate
    layer (experts dealt round-robin to one tier slab per rate, run through
    ops.moe.moe_tiered: one custom call). l2: "cold" (the loop's calls cycle through
    routed_variants, so the touched experts are not the same call after call and come from HBM
    as in a model) or "warm" (one routing: its experts stay in the L2 across the loop, the
    method before session 24)."""
    import importlib

    from exl3_jax.ffi import trellis_moe as tm
    moe_ops = importlib.import_module("exl3_jax.ops.moe")   # (exl3_jax.ops.moe is the function)
    check_l2(l2)
    tiers = tuple(K) if isinstance(K, (tuple, list)) else None

    deadline = time.time() + budget_s if budget_s else None
    rows = []
    for name in geometries or list(MOE_GEOMETRIES):
        H, I, E, top_k = MOE_GEOMETRIES[name]
        if tiers:
            tier_of, slot_of, counts = tm.round_robin_tiers(E, len(tiers))
            expert_tier, expert_slot = jnp.asarray(tier_of), jnp.asarray(slot_of)
            slabs = [random_moe_weights(H, I, n, Kt, codebook, seed=t)
                     for t, (Kt, n) in enumerate(zip(tiers, counts))]
            experts = (slabs, moe_ops.tier_glue(slabs, expert_tier, expert_slot))

            def layer(x, ids, w, experts):
                slabs, glue = experts
                return moe_ops.moe_tiered(x, ids, w, slabs, expert_tier, expert_slot,
                                          backend="gpu", glue=glue)
        else:
            experts = random_moe_weights(H, I, E, K, codebook)
            slabs = [experts]

            def layer(x, ids, w, experts, fused=True):
                return tm.moe_gpu(x, ids, w, *experts, fused=fused)
        w13, down = slabs[0]
        per_expert_bytes = sum(a.nbytes + b.nbytes for a, b in slabs) // E
        per_expert_weights = 3 * H * I
        dense = None
        if baseline:            # stands in for the dequantized experts (same shapes, bf16)
            dense = [(jax.random.normal(key, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
                     for key, s in zip(jax.random.split(jax.random.PRNGKey(3), 3),
                                       ((E, H, I), (E, H, I), (E, I, H)))]
        for m in ms:
            if deadline and time.time() > deadline:
                log("bench moe: deadline reached, stopping")
                return rows
            ids, wts = random_topk(m, E, top_k, seed=m)
            x = jnp.asarray(np.random.default_rng(2).standard_normal((m, H)), jnp.bfloat16)
            touched = int(np.unique(np.asarray(ids)).size)
            hbm_us = 1e6 * touched * per_expert_bytes / HBM_BYTES_PER_S
            alu_us = 1e6 * touched * per_expert_weights / DECODE_RATE[codebook]
            mma_us = 1e6 * 2 * m * top_k * per_expert_weights / MMA_FLOPS   # useful FLOPs only
            floor_us = max(hbm_us, alu_us, mma_us)
            iters = int(max(8, min(128, 2e4 / max(1, m))))
            plan = tm.plan_for(m, top_k, E, w13.k, w13.n)
            idv = routed_variants(ids, E) if l2 == "cold" else [ids]
            row = dict(geometry=name, H=H, I=I, E=E, top_k=top_k, K=K, codebook=codebook, m=m,
                       l2=l2,
                       plan=plan.kind, packing=plan.packing, block_m=plan.block_m,
                       blocks=plan.blocks, touched=touched,
                       touched_bytes=touched * per_expert_bytes, hbm_floor_us=hbm_us,
                       decode_floor_us=alu_us, mma_floor_us=mma_us, floor_us=floor_us)
            try:
                row["us"] = 1e6 * time_in_loop(
                    layer, (x, ids, wts, experts), iters=iters, reps=3,
                    variants=[(i, wts, experts) for i in idv])
                row["floor_ratio"] = row["us"] / floor_us
            except Exception as e:   # noqa: BLE001 -- record and continue
                row["us"], row["error"] = float("nan"), f"{type(e).__name__}: {e}"[:500]
            if unfused and not tiers:   # the jnp-glue variant (8 launches + XLA)
                try:
                    row["unfused_us"] = 1e6 * time_in_loop(
                        lambda x, i, w, e: layer(x, i, w, e, fused=False),
                        (x, ids, wts, experts), iters=iters, reps=3,
                        variants=[(i, wts, experts) for i in idv])
                except Exception as e:   # noqa: BLE001
                    row["unfused_error"] = f"{type(e).__name__}: {e}"[:300]
            try:          # the loop's own per-call cost (x + 0 * y chaining, one read), in "us"
                row["loop_us"] = loop_overhead_us(m, H)
            except Exception as e:   # noqa: BLE001
                row["loop_error"] = f"{type(e).__name__}: {e}"[:300]
            try:          # the route packing alone
                row["pack_us"] = packing_us(ids, E, plan, iters)
            except Exception as e:   # noqa: BLE001
                row["pack_error"] = f"{type(e).__name__}: {e}"[:300]
            if dense is not None:
                try:
                    row["ragged_us"] = 1e6 * time_in_loop(
                        ragged_moe_baseline,
                        (x, ids, wts, *dense), iters=iters, reps=3,
                        variants=[(i, wts, *dense) for i in idv])
                    row["speedup_vs_ragged"] = row["ragged_us"] / row["us"]
                except Exception as e:   # noqa: BLE001
                    row["ragged_error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            log(f"{name:<14} m={m:<5} {plan.kind:<7} bm={plan.block_m:<2} touched={touched:<4} "
                f"{row['us']:9.1f} us  floor {floor_us:8.1f} us (x{row.get('floor_ratio', 0):5.2f})"
                f"  ragged {row.get('ragged_us', float('nan')):9.1f} us "
                f"(x{row.get('speedup_vs_ragged', float('nan')):5.2f})"
                f"  pack {row.get('pack_us', float('nan')):7.1f} us"
                f"  loop {row.get('loop_us', float('nan')):5.1f} us"
                + (f"  unfused {row.get('unfused_us', float('nan')):8.1f} us" if unfused else "")
                + (f"  ERR {row['error']}" if "error" in row else ""))
    return rows


def _moe_rates(text: str) -> tuple:
    """`bench moe --K`: "4" -> (4,), "3+4" -> (3, 4), "2.5" -> (2.5,)."""
    try:
        return tuple(float(v) if "." in v else int(v) for v in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rate or rates joined by + (e.g. 4, 2.5, 3+4)") from None


def main_moe(argv=None) -> int:
    """`exl3-jax bench moe` / `python -m exl3_jax.ffi.bench moe`."""
    p = argparse.ArgumentParser(description="grouped Trellis MoE vs roofline and ragged_dot")
    p.add_argument("--geometries", default=",".join(MOE_GEOMETRIES))
    p.add_argument("--m", default=None, help="token counts (default: the issue's list)")
    p.add_argument("--K", default="4", type=_moe_rates,
                   help="rate, or rates joined by + (e.g. 3+4) for a mixed-bitrate layer: "
                        "experts dealt round-robin to one tier per rate")
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--quick", action="store_true",
                   help=f"m in {MOE_QUICK_M}, 120 s budget (about 2 minutes)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--l2", choices=L2_MODES, default="cold",
                   help="cold: the timed calls route to different experts (routed_variants); "
                        "warm: one routing, its experts L2-resident (before session 24)")
    p.add_argument("--out", default=None, help="JSON file for the results")
    a = p.parse_args(argv)
    ms = [int(v) for v in a.m.split(",")] if a.m else list(MOE_QUICK_M if a.quick else MOE_M)
    budget = a.budget_s or (120.0 if a.quick else None)
    K = a.K[0] if len(a.K) == 1 else a.K
    rows = bench_moe(a.geometries.split(","), ms, K, a.codebook, budget_s=budget,
                     baseline=not a.no_baseline, l2=a.l2)
    result = {"versions": versions(), "l2": a.l2, "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv=None) -> int:
    """`bench linear` (default) or `bench moe`: a leading "linear" / "moe" word picks one.
    Without a CUDA device (and without EXL3_JAX_EMULATE, whose timings mean nothing) it stops
    at once with an error that says so, instead of one failed row per shape."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from . import emulate
    if not {"-h", "--help"} & set(argv) and jax.default_backend() != "gpu" \
            and not emulate.enabled():
        print(f"exl3-jax bench: no CUDA device (JAX's backend is {jax.default_backend()}); "
              f"the benchmarks time the GPU kernels. {emulate.EMULATE_ENV}=1 runs them through "
              "the PTX interpreter on the CPU instead (a smoke test: its timings mean nothing)",
              file=sys.stderr)
        return 2
    if argv and argv[0] == "moe":
        return main_moe(argv[1:])
    if argv and argv[0] == "linear":
        argv = argv[1:]
    return main_linear(argv)


from .bench_linear import main as main_linear  # noqa: E402  (parts, resume, merge)

if __name__ == "__main__":
    sys.exit(main())
