"""Validate the grouped Trellis MoE kernels on a CUDA machine; writes one JSON report.

  python scripts/gpu_validate_moe.py --out $OUT/moe_validate.json [--budget-s 270] [--no-bench]
  compute-sanitizer --tool memcheck python scripts/gpu_validate_moe.py --memcheck

Sections (each recorded even if another fails; cases past the time budget are skipped and
listed):
  accuracy:   exl3_jax.ffi.trellis_moe.moe_gpu (NaN-poisoned kernel outputs; fused glue kernels,
              and a few cases with the unfused jnp glue and with x_scale) vs the jnp
              reference MoE (exl3_jax.ops.moe.moe_packed_reference, fp32 HIGHEST, run on the same
              GPU) for several codebooks x rates and token counts covering the plans (decode,
              prefill, and on Hopper wgmma: auto at 300 tokens (128-row blocks), forced at
              40 (32-row blocks); the mma.sync prefill plan forced at 300 tokens); pass:
              relative L2 error <= 2e-3 and cosine >= 0.9999. One case also against the
              all-experts reference (moe_experts).
  decode_bitwise: in the decode plan each token of an m-token batch equals its own m=1 result
              bitwise (m = 2, 4, 8, 16, 32).
  overflow:   bf16 tokens of magnitude 3e4 and 3e6 (their rotated FC1 operands and SwiGLU
              outputs overflow fp16 without the kernels' row scales), fused and unfused glue,
              both plans; each token against the reference on its own scale.
  edge:       no experts hit (all ids -1: output exactly 0), all experts hit, invalid ids mixed in.
  tiers:      mixed K3/K4 experts (exl3_jax.ops.moe.moe_tiered, gpu backend) vs the reference.
  geometry:   Qwen3-30B-A3B geometry (E128 H2048 I768 top-8) at m = 1, 8, 128, 1024 vs the
              reference (1024: the wgmma plan on Hopper), and GLM-4.5-Air's / GLM-5.2 TP4's
              H and I with 16 experts at 512 / 128 tokens (128- / 64-row wgmma blocks).
  dispatch:   exl3_jax.ops.moe with backend "auto" picks the GPU kernels and matches.
  bench:      (unless --no-bench) a few timings of the Qwen3 geometry (exl3_jax.ffi.bench).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.ffi import aot
from exl3_jax.ffi import trellis_moe as tm
from exl3_jax.ops.moe_plans import moe_plan

moe_ops = importlib.import_module("exl3_jax.ops.moe")

REL_TOL, COS_TOL = 2e-3, 0.9999


def log(*a):
    print(*a, flush=True)


def random_stack(rng, lead, k, n, K, codebook, scale=1 / 64):
    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight
    t = rng.integers(-32768, 32768, size=(*lead, k // 16, n // 16, width_from_rate(K)),
                     dtype=np.int64).astype(np.int16)
    suh = rng.choice([-1.0, 1.0], size=(*lead, k)).astype(np.float16)
    svh = (rng.uniform(0.5, 1.5, size=(*lead, n)) * scale).astype(np.float16)
    return Exl3Weight(jnp.asarray(t), jnp.asarray(suh), jnp.asarray(svh), None, codebook, K, k, n)


def random_moe(rng, E, H, I, K, codebook, inter_valid=None):
    """w13 [2, E] and down [E]; inter_valid < I: logical intermediate size below the padded
    one (the padded columns of gate/up must not reach down)."""
    import dataclasses
    w13 = random_stack(rng, (2, E), H, I, K, codebook)
    down = random_stack(rng, (E,), I, H, K, codebook)
    if inter_valid:
        w13 = dataclasses.replace(w13, out_features=inter_valid)
        down = dataclasses.replace(down, in_features=inter_valid)
    return w13, down


def routing(rng, T, top_k, E, invalid=0.0):
    ids = np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[rng.random(ids.shape) < invalid] = -1
    w = rng.uniform(0.1, 1.0, size=(T, top_k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w)


def draw_tokens(rng, T, H, top_k, E, invalid=0.0, dtype=jnp.bfloat16):
    """Fresh MoE inputs, drawn in this order: x [T, H] ~ N(0, 1) in ``dtype``, then
    ``routing(rng, T, top_k, E, invalid)`` (ids int32 [T, top_k], weights fp32 [T, top_k])."""
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    return (x, *routing(rng, T, top_k, E, invalid))


def metrics(got, ref) -> dict:
    g = np.asarray(got, np.float64).ravel()
    r = np.asarray(ref, np.float64).ravel()
    nr = np.linalg.norm(r)
    rel = float(np.linalg.norm(g - r) / nr) if nr > 0 else float(np.linalg.norm(g))
    cos = float(g @ r / (np.linalg.norm(g) * nr)) if nr > 0 and np.linalg.norm(g) > 0 else None
    return dict(rel=rel, cos=cos, nan=int(np.isnan(g).sum()), max_abs_ref=float(np.abs(r).max()))


def passes(m: dict) -> bool:
    return m["nan"] == 0 and m["rel"] <= REL_TOL and (m["cos"] is None or m["cos"] >= COS_TOL)


# The wgmma plan (Hopper only) forced: 32-row blocks at 40 tokens (10 routes per expert), 128-row
# blocks at 300 (75).
WGMMA_FORCED = ((40, "wgmma"), (300, "wgmma")) if aot.device_arch() == "sm_90a" else ()
_gpu = jax.jit(lambda x, ids, w, w13, down, plan=None, fused=True, x_scale=None: tm.moe_gpu(
    x, ids, w, w13, down, plan=plan, poison=True, fused=fused, x_scale=x_scale),
    static_argnames=("plan", "fused"))


def _gpu_tiered(x, ids, w, slabs, expert_tier, expert_slot, plan):
    """A mixed-bitrate layer through moe_gpu with a named plan (moe_tiered takes auto's) and
    NaN-poisoned kernel outputs."""
    maps = (expert_tier, expert_slot, moe_ops.tier_glue(slabs, expert_tier, expert_slot))
    return tm.moe_gpu(x, ids, w, [s[0] for s in slabs], [s[1] for s in slabs], plan=plan,
                      tiers=maps, poison=True)


_ref = jax.jit(lambda x, ids, w, w13, down, x_scale=None: moe_ops.moe_packed_reference(
    x, ids, w, w13, down, x_scale=x_scale))


class Budget:
    def __init__(self, seconds):
        self.t0 = time.perf_counter()
        self.seconds = seconds
        self.skipped = []

    def left(self):
        return self.seconds - (time.perf_counter() - self.t0)

    def ok(self, what) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(what)
        return False


def case(rng, E, H, I, K, cb, T, top_k, invalid=0.0, plan=None, x_dtype=jnp.bfloat16,
         fused=True, scaled=False, inter_valid=None):
    w13, down = random_moe(rng, E, H, I, K, cb, inter_valid)
    x, ids, w = draw_tokens(rng, T, H, top_k, E, invalid, x_dtype)
    xsc = jnp.asarray(rng.uniform(0.5, 2.0, (T, 1)), jnp.float32) if scaled else None
    t0 = time.perf_counter()
    got = _gpu(x, ids, w, w13, down, plan=plan, fused=fused, x_scale=xsc)
    got.block_until_ready()
    dt = time.perf_counter() - t0
    ref = _ref(x, ids, w, w13, down, x_scale=xsc)
    m = metrics(got, ref)
    p = tm.plan_for(T, top_k, E, H, I, plan)       # the plan the layer ran (auto included)
    m.update(codebook=cb, K=K, E=E, H=H, I=I, T=T, top_k=top_k, plan=p.kind, block_m=p.block_m,
             blocks=p.blocks, fc1=vars(p.fc1), fc2=vars(p.fc2), first_call_s=round(dt, 2),
             fused=fused, scaled=scaled, inter_valid=inter_valid, ok=passes(m))
    return m, (x, ids, w, w13, down)


def profile_layer(log=print, budget_s: float = 45.0, ms=(1, 8)) -> dict:
    """Qwen3-30B-A3B geometry, auto plans at each m of ``ms``: time of route packing, FC1 and
    FC2 alone, of the whole layer (its packing and one custom call) with and without
    programmatic dependent launch and unfused; for decode plans also of the layer under a few
    alternative plans (n_tiles / warps / splits / unroll of FC1 and FC2), to pick the decode
    plan."""
    import dataclasses

    from exl3_jax.ffi import bench as gb
    from exl3_jax.ffi import trellis_gemm as tg
    from exl3_jax.ops.moe_plans import MoeGemmPlan

    deadline = time.time() + budget_s
    H, I, E, top_k = gb.MOE_GEOMETRIES["qwen3-30b-a3b"]
    w13, down = gb.random_moe_weights(H, I, E, 4, "mcg")
    out = {"stages": [], "plans": []}
    for m in ms:
        ids, wts = gb.random_topk(m, E, top_k, seed=m)
        x = jnp.asarray(np.random.default_rng(2).standard_normal((m, H)), jnp.bfloat16)
        plan = tm.plan_for(m, top_k, w13.stack_shape[1], w13.k, w13.n)
        pr = tm.kernel_routes(ids, E, plan)
        cfg1, cfg2 = tm.grouped_config(w13, plan.fc1, plan), tm.grouped_config(down, plan.fc2,
                                                                               plan)
        glue = (w13.suh, w13.svh, down.suh, down.svh)
        rng = np.random.default_rng(3)
        xh = jnp.asarray(rng.standard_normal(2 * pr.rows * H), jnp.float16)   # GEMM operands
        xh2 = jnp.asarray(rng.standard_normal(pr.rows * I), jnp.float16)
        T = lambda f, *a: round(1e6 * gb.time_in_loop(f, a, iters=64, reps=3), 2)  # noqa: E731
        row = dict(m=m, packing=plan.packing, block_m=plan.block_m, blocks=plan.blocks,
                   fc1=vars(plan.fc1), fc2=vars(plan.fc2))
        try:
            row.update(
                pack_us=round(gb.packing_us(ids, E, plan), 2),
                fc1_us=T(lambda a: tm.grouped_partials(tg.f16_words(a), w13, pr.block_expert,
                                                       cfg1), xh),
                fc2_us=T(lambda a: tm.grouped_partials(tg.f16_words(a), down, pr.block_expert,
                                                       cfg2), xh2),
                # the layers with their packing (routes_of_call: not hoisted out of the loop)
                layer_us=T(lambda x: tm.moe_gpu(x, gb.routes_of_call(x, ids, plan), wts, w13,
                                                down), x),
                layer_no_pdl_us=T(lambda x: tm.moe_layer(
                    x, tm.kernel_routes(gb.routes_of_call(x, ids, plan), E, plan), w13, down,
                    wts, glue=glue, cfg1=cfg1, cfg2=cfg2, valid_cols=I, pdl=False), x),
                layer_unfused_us=T(lambda x: tm.moe_gpu(
                    x, gb.routes_of_call(x, ids, plan), wts, w13, down, fused=False), x))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        log(json.dumps(row))
        out["stages"].append(row)
        if plan.kind != "decode":
            continue
        variants = [(2, 8, 1, 4), (1, 8, 1, 4), (2, 4, 1, 4), (2, 8, 2, 4), (1, 4, 1, 4),
                    (2, 8, 1, 2), (1, 8, 2, 2), (2, 4, 2, 2), (4, 8, 1, 2)]
        for v1 in variants:
            for v2 in ((2, 8, 1, 2), (1, 8, 1, 2), (2, 4, 1, 4), (1, 4, 1, 4), (2, 8, 2, 1)):
                if time.time() > deadline:
                    out["stopped"] = "deadline"
                    return out
                if v1 != variants[0] and v2 != (2, 8, 1, 2):
                    continue          # FC1 variants with the base FC2, then FC2 variants
                alt = dataclasses.replace(plan, fc1=MoeGemmPlan(*v1), fc2=MoeGemmPlan(*v2))
                try:
                    tm.grouped_config(w13, alt.fc1, alt)
                    tm.grouped_config(down, alt.fc2, alt)
                except ValueError:
                    continue
                r = dict(m=m, fc1=v1, fc2=v2)
                try:
                    r["layer_us"] = T(lambda x: tm.moe_gpu(
                        x, gb.routes_of_call(x, ids, plan), wts, w13, down, plan=alt), x)
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {e}"[:300]
                log(json.dumps(r))
                out["plans"].append(r)
    return out


def save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def run_validation(args) -> dict:
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "sections": {},
              "tolerances": dict(rel=REL_TOL, cos=COS_TOL)}
    budget = Budget(args.budget_s)
    rng = np.random.default_rng(args.seed)

    wanted = set(args.sections.split(",")) if args.sections else None

    def section(name, fn):
        if wanted is not None and name not in wanted:
            return
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            report["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001
            report["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()[-4000:]}
            log(traceback.format_exc()[-2000:])
        report["sections"][name + "_seconds"] = round(time.perf_counter() - t0, 1)
        save(report, args.out)          # partial results survive a timeout

    def accuracy():
        rows = []
        configs = [("mcg", 4), ("mcg", 3), ("mul1", 4), ("3inst", 2), ("mcg", 5), ("mul1", 3),
                   ("3inst", 6), ("mul1", 8), ("mul1", 2.5), ("mcg", 7)]
        Ts = [1, 5, 32, 33, 300]
        if args.quick:      # one token count per config, both plans across the list
            configs, Ts = configs[:6], [1, 300, 5, 33, 32, 300]
        for i, (cb, K) in enumerate(configs):
            for T in ((Ts[i],) if args.quick else Ts if i < 2 else Ts[i % 2::2]):
                if not budget.ok(f"accuracy {cb} K{K} T{T}"):
                    continue
                m, _ = case(rng, 8, 512, 256, K, cb, T, 2, invalid=0.1)
                log(json.dumps(m))
                rows.append(m)
        # the unfused glue (jnp + Hadamard kernels), x_scale, padded intermediate columns
        for T, plan, fused, scaled, iv in ((5, None, False, True, None),
                                           (40, None, False, False, 200),
                                           (5, None, True, True, 200),
                                           (40, None, True, True, None)):
            if budget.ok(f"accuracy fused={fused} scaled={scaled} T{T}"):
                m, _ = case(rng, 8, 512, 256, 4, "mcg", T, 2, invalid=0.1, plan=plan,
                            fused=fused, scaled=scaled, inter_valid=iv)
                log(json.dumps(m))
                rows.append(m)
        # decode plan forced on a prefill-sized batch and prefill plan on a decode-sized one
        # and on the 16- and 64-row blocks that Hopper's auto gives the wgmma plan; on Hopper
        # the wgmma plan forced on a batch whose blocks auto would give the mma.sync kernel
        # elsewhere (40 tokens: 10 routes per expert, 32-row blocks)
        for T, plan in ((24, "prefill"), (3, "prefill"), (40, "prefill"),
                        (300, "prefill")) + WGMMA_FORCED[:1]:
            if budget.ok(f"accuracy forced {plan} T{T}"):
                m, _ = case(rng, 8, 512, 256, 4, "mcg", T, 2, plan=plan)
                log(json.dumps(m))
                rows.append(m)
        # against the all-experts reference too
        m, (x, ids, w, w13, down) = case(rng, 6, 256, 384, 4, "mcg", 7, 3, invalid=0.2)
        allref = moe_ops.moe_experts(x, ids, w, moe_ops.plane(w13, 0), moe_ops.plane(w13, 1),
                                     down, backend="reference")
        got = _gpu(x, ids, w, w13, down)
        m2 = metrics(got, allref)
        m2.update(vs="moe_experts", ok=passes(m2))
        rows.append(m2)
        return dict(rows=rows, ok=all(r["ok"] for r in rows))

    def decode_bitwise():
        out = []
        E, H, I, top_k = 16, 512, 256, 4
        w13, down = random_moe(rng, E, H, I, 4, "mcg")
        Ts = ((2, True), (4, True), (8, True), (16, True), (32, True), (8, False))
        for T, fused in (Ts[::2] + Ts[-1:] if args.quick else Ts):
            if not budget.ok(f"decode_bitwise T{T}"):
                continue
            x, ids, w = draw_tokens(rng, T, H, top_k, E, 0.05)
            batch = np.asarray(_gpu(x, ids, w, w13, down, fused=fused))
            single = np.concatenate([np.asarray(_gpu(x[t:t + 1], ids[t:t + 1], w[t:t + 1], w13,
                                                     down, fused=fused)) for t in range(T)])
            diff = np.flatnonzero(np.any(batch.view(np.uint32) != single.view(np.uint32), axis=1))
            r = dict(T=T, fused=fused, packing=moe_plan(T, top_k, E, H, I).packing,
                     bitwise_equal=bool(diff.size == 0), tokens_differing=diff.tolist()[:8],
                     max_abs_diff=float(np.max(np.abs(batch - single))))
            log(json.dumps(r))
            out.append(r)
        return dict(rows=out, ok=bool(out) and all(r["bitwise_equal"] for r in out))

    def edge():
        res = {}
        E, H, I = 8, 256, 256
        w13, down = random_moe(rng, E, H, I, 3, "mcg")
        x = jnp.asarray(rng.standard_normal((5, H)), jnp.bfloat16)
        for fused in (True, False):
            none = np.asarray(_gpu(x, -jnp.ones((5, 2), jnp.int32), jnp.ones((5, 2)), w13, down,
                                   fused=fused))
            res[f"no_experts_hit{'' if fused else '_unfused'}"] = dict(
                exactly_zero=bool(np.all(none == 0.0)), nan=int(np.isnan(none).sum()))
        # all experts hit, several blocks per expert
        T, top_k = 40, 8
        ids = jnp.asarray(np.stack([rng.permutation(E) for _ in range(T)]).astype(np.int32))
        w = jnp.asarray(rng.uniform(0.1, 1, (T, top_k)).astype(np.float32))
        xa = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
        for plan in ("decode", "prefill") + tuple(p for _, p in WGMMA_FORCED[:1]):
            m = metrics(_gpu(xa, ids, w, w13, down, plan=plan), _ref(xa, ids, w, w13, down))
            m["ok"] = passes(m)
            res[f"all_experts_hit_{plan}"] = m
        # ids out of range and -1 mixed in, one token with no expert at all
        ids2 = np.asarray(ids).copy()
        ids2[0, :] = -1
        ids2[1, 3] = E + 5
        ids2[2, 0] = -7
        got = np.asarray(_gpu(xa, jnp.asarray(ids2), w, w13, down))
        m = metrics(got, _ref(xa, jnp.asarray(ids2), w, w13, down))
        m["ok"] = passes(m) and bool(np.all(got[0] == 0.0))
        res["invalid_ids"] = m
        res["ok"] = (all(v["exactly_zero"] and v["nan"] == 0 for k, v in res.items()
                         if k.startswith("no_experts_hit"))
                     and all(v["ok"] for k, v in res.items() if isinstance(v, dict) and "ok" in v))
        log(json.dumps(res))
        return res

    def versus_reference(name, Ts, H, top_k, E, gpu, ref, invalid=0.0, inter=None):
        """Rows of metrics(gpu(x, ids, w), ref(x, ids, w)) on fresh tokens, one per T; with a
        ``name``, a T past the time budget is skipped (listed as "<name> T<T>"); with the
        intermediate size ``inter``, each row names its auto plan."""
        out = []
        for T in Ts:
            if name is not None and not budget.ok(f"{name} T{T}"):
                continue
            x, ids, w = draw_tokens(rng, T, H, top_k, E, invalid)
            m = metrics(gpu(x, ids, w), ref(x, ids, w))
            m.update(T=T, ok=passes(m))
            if inter is not None:       # the plan auto picked for this call
                p = tm.plan_for(T, top_k, E, H, inter)
                m.update(plan=p.kind, block_m=p.block_m)
            log(json.dumps(m))
            out.append(m)
        return dict(rows=out, ok=all(r["ok"] for r in out))

    def tiers():
        """Mixed-bitrate layers, every tier in one custom call (ops.moe.tiers_share_launches),
        against the packed reference run tier by tier: K3 / K4 mcg, and three codebooks with a
        half rate (mcg K3, mul1 K3.5, 3inst K2), experts dealt to the tiers in a random order
        and one expert in no tier (a rank's missing expert: its routes add zero); auto at 1 / 8
        / 100 tokens (on Hopper 100 takes the wgmma plan: one launch per tier), and there the
        mma.sync prefill plan forced at 100 as well."""
        H, I = 512, 256
        out = {}
        for name, spec in (("k3_k4_mcg", [("mcg", 3, 4), ("mcg", 4, 4)]),
                           ("three_codebooks", [("mcg", 3, 3), ("mul1", 3.5, 3),
                                                ("3inst", 2, 2)])):
            slabs = [random_moe(rng, n, H, I, K, cb) for cb, K, n in spec]
            owner = rng.permutation(np.concatenate([np.full(n, t)
                                                    for t, (_, _, n) in enumerate(spec)]
                                                   + [[-1]]))
            slot = np.zeros_like(owner)
            for t in range(len(spec)):
                slot[owner == t] = np.arange((owner == t).sum())
            expert_tier, expert_slot = jnp.asarray(owner, jnp.int32), jnp.asarray(slot, jnp.int32)
            f = jax.jit(lambda x, ids, w, be, slabs=slabs, et=expert_tier, es=expert_slot:
                        moe_ops.moe_tiered(x, ids, w, slabs, et, es, backend=be),
                        static_argnums=3)
            res = versus_reference(None, (1, 8, 100), H, 4, len(owner),   # (tiers always runs)
                                   lambda *t, f=f: f(*t, "gpu"), lambda *t, f=f: f(*t, "packed"),
                                   0.05, inter=I)
            if WGMMA_FORCED:      # Hopper: auto took wgmma at 100 tokens; the mma.sync kernel
                g = jax.jit(lambda x, ids, w, slabs=slabs, et=expert_tier, es=expert_slot:
                            _gpu_tiered(x, ids, w, slabs, et, es, "prefill"))
                forced = versus_reference(None, (100,), H, 4, len(owner), g,
                                          lambda *t, f=f: f(*t, "packed"), 0.05)
                for row in forced["rows"]:
                    row.update(plan="prefill", block_m=tm.plan_for(row["T"], 4, len(owner), H,
                                                                   I, "prefill").block_m)
                res["rows"] += forced["rows"]
                res["ok"] = res["ok"] and forced["ok"]
            res["one_set_of_launches"] = bool(moe_ops.tiers_share_launches(slabs))
            res["ok"] = res["ok"] and res["one_set_of_launches"]
            out[name] = res
        out["ok"] = all(v["ok"] for v in out.values())
        return out

    def geometry():
        E, H, I, top_k = 128, 2048, 768, 8
        w13, down = random_moe(rng, E, H, I, 4, "mcg")
        out = versus_reference("geometry", (1, 8, 128, 1024), H, top_k, E,
                               lambda *t: _gpu(*t, w13, down), lambda *t: _ref(*t, w13, down),
                               inter=I)
        # GLM-4.5-Air's and GLM-5.2 TP4's H and I (I 1408: an odd count of 128-column tiles;
        # FC2's k 512 and 1408) with 16 experts, so that prefill-sized batches fill 64- and
        # 128-row blocks (the wgmma plan on Hopper) without 2 G reference weights.
        for name, H2, I2, T, cb in (("glm-4.5-air", 4096, 1408, 512, "mul1"),
                                    ("glm-5.2-tp4", 6144, 512, 128, "mcg")):
            if not budget.ok(f"geometry {name}"):
                continue
            w13b, downb = random_moe(rng, 16, H2, I2, 3, cb)
            res = versus_reference(f"geometry {name}", (T,), H2, top_k, 16,
                                   lambda *t: _gpu(*t, w13b, downb),
                                   lambda *t: _ref(*t, w13b, downb), inter=I2)
            out[name] = res
            out["ok"] = out["ok"] and res["ok"]
        return out

    def dispatch():
        from exl3_jax.ops.moe import resolve_moe_backend
        E, H, I = 8, 256, 256
        w13, down = random_moe(rng, E, H, I, 4, "mul1")
        x, ids, w = draw_tokens(rng, 3, H, 2, E)
        kind = resolve_moe_backend(None, w13, down)
        got = jax.jit(lambda *a: moe_ops.moe(*a))(x, ids, w, w13, down)
        m = metrics(got, _ref(x, ids, w, w13, down))
        m.update(auto_backend=kind, ok=passes(m) and kind == "gpu")
        return m

    def overflow():
        # The fp16 boundary (ffi/trellis_moe.py): bf16 tokens whose rotated FC1 operand and
        # SwiGLU output overflow fp16 unless the kernels scale each row; every token against
        # the fp32 reference on its own scale, fused and unfused glue, both plans.
        out = []
        E, H, I, top_k = 8, 512, 256, 2
        w13, down = random_moe(rng, E, H, I, 4, "mcg")
        for T, plan, fused in ((3, "decode", True), (3, "decode", False),
                               (40, "prefill", True), (40, "prefill", False)) + tuple(
                                   (T, p, True) for T, p in WGMMA_FORCED[:1]):
            x, ids, w = draw_tokens(rng, T, H, top_k, E, dtype=jnp.float32)
            x = np.array(x)                                         # a writable copy
            x[1] *= 3e4 / np.abs(x[1]).max()
            x[2] *= 3e6 / np.abs(x[2]).max()
            x = jnp.asarray(x, jnp.bfloat16)
            got = np.asarray(_gpu(x, ids, w, w13, down, plan=plan, fused=fused))
            ref = np.asarray(_ref(x, ids, w, w13, down))
            per_token = [metrics(got[t], ref[t]) for t in range(3)]
            r = dict(T=T, plan=plan, fused=fused, rel=[m["rel"] for m in per_token],
                     max_abs_ref=[m["max_abs_ref"] for m in per_token],
                     rest=metrics(got[3:], ref[3:]) if T > 3 else None,
                     ok=all(passes(m) for m in per_token) and bool(np.isfinite(got).all()))
            log(json.dumps(r))
            out.append(r)
        return dict(rows=out, ok=all(r["ok"] for r in out))

    # The named checks first; the accuracy sweep fills the remaining budget.
    section("overflow", overflow)
    section("decode_bitwise", decode_bitwise)
    section("edge", edge)
    section("tiers", tiers)
    section("dispatch", dispatch)
    section("geometry", geometry)
    section("accuracy", accuracy)
    if not args.no_bench:
        def bench():
            from exl3_jax.ffi import bench as gb
            if args.quick:      # the three geometries, a few m, ragged_dot baseline
                return gb.bench_moe(ms=[1, 8, 128, 4096], budget_s=args.bench_s, log=log)
            return gb.bench_moe(geometries=["qwen3-30b-a3b"], ms=[1, 8, 32, 128],
                                budget_s=max(40.0, min(75.0, budget.left())), unfused=True,
                                log=log)
        section("bench", bench)

        def profile():
            ms = tuple(int(v) for v in args.profile_m.split(",")) if args.profile_m else \
                (1,) if args.quick else (1, 8)
            return profile_layer(log=log, budget_s=args.profile_s, ms=ms)
        section("profile", profile)
    report["skipped"] = budget.skipped
    report["ok"] = all(v.get("ok", False) for k, v in report["sections"].items()
                       if isinstance(v, dict) and k not in ("bench", "profile"))
    return report


def run_memcheck() -> int:
    """A decode, a prefill and (Hopper) a wgmma layer (fused glue, poisoned outputs), for
    compute-sanitizer memcheck; the Qwen3 intermediate size (768: 6 of a CTA's 8 warps own a
    block). The reference runs on the CPU: XLA's GEMM autotuning crashed under the sanitizer
    (session 11)."""
    rng = np.random.default_rng(3)
    E, H, I, top_k = 8, 512, 768, 2
    w13, down = random_moe(rng, E, H, I, 4, "mcg", inter_valid=700)
    bad = 0
    for T, plan in ((3, "decode"), (40, "prefill")) + WGMMA_FORCED:
        x, ids, w = draw_tokens(rng, T, H, top_k, E, invalid=0.1)
        got = _gpu(x, ids, w, w13, down, plan=plan)
        with jax.default_device(jax.devices("cpu")[0]):
            ref = _ref(*jax.device_put((x, ids, w, w13, down), jax.devices("cpu")[0]))
        m = metrics(got, ref)
        log(f"memcheck run moe {plan}: T={T} rel_l2={m['rel']:.3g} nan={m['nan']}")
        bad += not passes(m)
    # A per-route decode plan (kernels derive rows from the ids): 2 tokens x top-2 over 64.
    w13p, downp = random_moe(rng, 64, H, 256, 3, "mul1")
    x, ids, w = draw_tokens(rng, 2, H, top_k, 64, invalid=0.25)
    got = _gpu(x, ids, w, w13p, downp, plan="decode")
    with jax.default_device(jax.devices("cpu")[0]):
        ref = _ref(*jax.device_put((x, ids, w, w13p, downp), jax.devices("cpu")[0]))
    m = metrics(got, ref)
    log(f"memcheck run moe per-route: T=2 rel_l2={m['rel']:.3g} nan={m['nan']}")
    bad += not passes(m)
    # Three tiers in one set of launches (the tiered grouped kernel), decode and auto at 40
    # tokens (on Hopper the wgmma plan: one launch per tier), where the mma.sync prefill plan
    # is also forced.
    slabs = [random_moe(rng, n, H, I, K, cb) for cb, K, n in
             (("mcg", 3, 3), ("mul1", 4, 3), ("3inst", 2, 2))]
    expert_tier = jnp.asarray([0, 1, 2, 0, 1, 2, 0, 1], jnp.int32)
    expert_slot = jnp.asarray([0, 0, 0, 1, 1, 1, 2, 2], jnp.int32)
    for T, plan in ((3, None), (40, None)) + (((40, "prefill"),) if WGMMA_FORCED else ()):
        x, ids, w = draw_tokens(rng, T, H, top_k, E, invalid=0.1)
        got = (moe_ops.moe_tiered(x, ids, w, slabs, expert_tier, expert_slot, backend="gpu")
               if plan is None else _gpu_tiered(x, ids, w, slabs, expert_tier, expert_slot, plan))
        with jax.default_device(jax.devices("cpu")[0]):
            cpu = jax.device_put((x, ids, w, slabs, expert_tier, expert_slot),
                                 jax.devices("cpu")[0])
            ref = moe_ops.moe_tiered(*cpu, backend="packed")
        m = metrics(got, ref)
        log(f"memcheck run moe tiers{' ' + plan if plan else ''}: T={T} rel_l2={m['rel']:.3g} "
            f"nan={m['nan']}")
        bad += not passes(m)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "moe_validate.json"))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="fewer accuracy cases; bench of all three geometries at m 1/8/128/4096")
    ap.add_argument("--bench-s", type=float, default=90.0, help="bench budget with --quick")
    ap.add_argument("--profile-s", type=float, default=60.0)
    ap.add_argument("--profile-m", default=None,
                    help="token counts of the profile section (default 1,8; 1 with --quick)")
    ap.add_argument("--sections", default=None,
                    help="comma list of sections to run (default: all; bench and profile "
                         "follow --no-bench)")
    ap.add_argument("--memcheck", action="store_true",
                    help="only the small layers for compute-sanitizer (no report)")
    args = ap.parse_args(argv)
    if args.memcheck:
        return run_memcheck()
    log("devices:", jax.devices())
    t0 = time.perf_counter()
    report = run_validation(args)
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    save(report, args.out)
    summary = {k: (v.get("ok") if isinstance(v, dict) else v)
               for k, v in report["sections"].items()}
    log("SUMMARY", json.dumps(summary), "ok =", report["ok"], "skipped =", report["skipped"])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
