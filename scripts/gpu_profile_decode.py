"""Where a decode step's GPU time goes: kernel time per category from a JAX profiler trace.

  python scripts/gpu_profile_decode.py [--models dense,dense_bf16] [--batch 1] [--prompt 64]
      [--new 33] [--hlo] [--out $OUT/gpu_profile_decode.json]

For each model (the synthetic models of gpu_e2e_decode.py) the compiled generate program is
traced twice, generating 1 and ``--new`` tokens; the difference of the two traces' kernel times,
divided by new - 1, is the per-step kernel time, split by category (kernel-name patterns below)
with the top kernels listed. The wall time per step is measured the same way, so wall minus
kernel time is what the GPU spent idle between kernels (launch gaps, host work).

With ``--hlo`` XLA dumps the optimized HLO of the generate program, and each of the top kernels
that is an XLA fusion is listed with its output shape and the model scopes of its ops
(``top_kernels_scopes``: the jax.named_scope labels of models/decoder.py, nn.attention, nn.moe,
e.g. "attention/qk_norm_rope/mul"), so a profile says what each fusion computes.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np
from _gpu_bench_common import run_metadata, timed_generate, versions, write_json
from gpu_e2e_decode import BF16_MODELS, FULL, random_model

# First matching pattern names the category (kernel names: CuTe DSL kernels are
# "kernel_cutlass__<python function>_..."; XLA fusions carry their HLO names, e.g. gemm_fusion_dot
# for XLA's own (Triton) GEMMs; cuBLAS / cuDNN kernels their library names).
CATEGORIES = (
    ("trellis_gemm", r"trellis_mma|grouped_mma|trellis_dequant"),
    ("hadamard", r"hadamard"),
    ("moe_other", r"combine|activation|rotate_in|route|moe"),
    ("cute_other", r"^kernel_cutlass_"),
    ("xla_gemm", r"gemm|gemv|xmma|sm90_|ampere_|cublas|cutlass"),
    ("attention", r"attention|softmax|flash"),
    ("xla_fusion", r"fusion|loop_|input_|reduce|transpose|concatenate|slice|dynamic|copy|convert"),
    ("memcpy", r"memcpy|memset"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def kernel_times(trace_dir: str) -> tuple[dict, dict, list]:
    """(ns per category, ns per kernel name, GPU line names) of every xplane.pb under trace_dir,
    GPU stream lines only."""
    from jax.profiler import ProfileData
    by_cat: dict = collections.Counter()
    by_name: dict = collections.Counter()
    lines_seen = set()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        with open(path, "rb") as f:
            data = ProfileData.from_serialized_xspace(f.read())
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                lines_seen.add(line.name)
                if not line.name.startswith("Stream"):
                    continue
                for ev in line.events:
                    by_cat[category(ev.name)] += ev.duration_ns
                    by_name[ev.name] += ev.duration_ns
    return by_cat, by_name, sorted(lines_seen)


_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\S+) fusion\(.*?"
                     r"calls=%(?P<comp>[\w.\-]+)")
_COMPUTATION = re.compile(r"^%(?P<comp>[\w.\-]+) \(.*\{$")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_PLUMBING = re.compile(r"^(jit\(.*\)|pjit\(.*\)|while|body|cond|closed_call|checkpoint|remat.*)$")


def op_scope(op_name: str) -> str:
    """An HLO op_name without its tracing plumbing: "jit(_generate)/while/body/attention/
    qk_norm_rope/mul" -> "attention/qk_norm_rope/mul"."""
    return "/".join(p for p in op_name.split("/") if p and not _PLUMBING.match(p))


def fusion_scopes(hlo_text: str) -> dict:
    """{kernel name: {"shape", "scopes"}} for every fusion instruction of optimized HLO text. The
    kernel name is the instruction's with "." and "-" as "_" (how XLA names a fusion's GPU
    kernel); scopes: the most common op_scope values of the fused computation's ops (at most
    4, most common first)."""
    ops: dict = collections.defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m["comp"]
        elif line.startswith("}"):
            current = None
        elif current is not None:
            ops[current].extend(_OP_NAME.findall(line))
    out = {}
    for line in hlo_text.splitlines():
        m = _FUSION.match(line)
        if not m:
            continue
        names = ops.get(m["comp"], []) + _OP_NAME.findall(line)
        common = collections.Counter(op_scope(n) for n in names).most_common(4)
        out[re.sub(r"[.\-]", "_", m["name"])] = {"shape": m["shape"],
                                                 "scopes": [sc for sc, _ in common]}
    return out


def dumped_fusions(dump_dir: str) -> dict:
    """fusion_scopes of every optimized-HLO dump under dump_dir (the generate program's first
    where two modules share a kernel name)."""
    found: dict = {}
    paths = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")),
                   key=lambda p: "generate" not in os.path.basename(p))
    for path in paths:
        with open(path) as f:
            for name, info in fusion_scopes(f.read()).items():
                found.setdefault(name, info)
    return found


def traced(gen, prompts, new: int) -> tuple[float, dict, dict, list]:
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t, _ = timed_generate(gen, prompts, new)
        jax.profiler.stop_trace()
        cats, names, lines = kernel_times(d)
    return t, cats, names, lines


def profile_model(name: str, batch: int, prompt: int, new: int, seed: int,
                  hlo_dir: str | None = None) -> dict:
    from exl3_jax.generate import Generator, bucket
    cfg = FULL[name]
    model = random_model(cfg, K=4, head_K=6, codebook="mcg", seed=seed, bf16=name in BF16_MODELS)
    gen = Generator(model, min_bucket=bucket(new))
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, cfg["vocab_size"], size=prompt)]
               for _ in range(batch)]
    timed_generate(gen, prompts, new)                 # compile + warm up
    timed_generate(gen, prompts, 1)
    t1, c1, n1, lines = traced(gen, prompts, 1)
    tn, cn, nn, _ = traced(gen, prompts, new)
    steps = new - 1
    per_cat = {k: round((cn[k] - c1.get(k, 0)) / steps / 1e3, 2) for k in cn}
    per_name = {k: round((nn[k] - n1.get(k, 0)) / steps / 1e3, 2) for k in nn}
    top = dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:30])
    kernel_us = round(sum(per_cat.values()), 1)
    wall_us = round((tn - t1) / steps * 1e6, 1)
    row = {"model": name, "batch": batch, "prompt": prompt, "new": new,
           "wall_us_per_step_traced": wall_us, "kernel_us_per_step": kernel_us,
           "idle_us_per_step": round(wall_us - kernel_us, 1),
           "kernel_us_per_step_by_category": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
           "top_kernels_us_per_step": top, "gpu_lines": lines}
    if hlo_dir is not None:
        fusions = dumped_fusions(hlo_dir)
        row["top_kernels_scopes"] = {k: fusions[k] for k in top if k in fusions}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dense,dense_bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "gpu_profile_decode.json"))
    p.add_argument("--hlo", action="store_true",
                   help="dump the optimized HLO and name each top fusion's model scopes")
    a = p.parse_args(argv)
    hlo_dir = None
    if a.hlo:       # before the backend starts: XLA reads its flags once
        hlo_dir = tempfile.mkdtemp(prefix="exl3_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={hlo_dir}"
                                   " --xla_dump_hlo_as_text"
                                   " --xla_dump_hlo_module_re=.*generate.*").strip()
    result = {"benchmark": "per-step GPU kernel time by category (JAX profiler trace)",
              **run_metadata(__file__, argv), "device": jax.devices()[0].device_kind,
              "versions": versions(), "models": []}
    for name in a.models.split(","):
        t0 = time.time()
        try:
            row = profile_model(name, a.batch, a.prompt, a.new, a.seed, hlo_dir)
        except Exception as e:        # record and go on to the next model
            row = {"model": name, "error": f"{type(e).__name__}: {e}"}
        row["seconds"] = round(time.time() - t0, 1)
        result["models"].append(row)
        write_json(a.out, result)
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("top_kernels_us_per_step", "top_kernels_scopes")}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
