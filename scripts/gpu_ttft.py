"""Time to first token of the jit-compiled generate with JIT-compiled vs ahead-of-time kernels.

  python scripts/gpu_ttft.py --aot-dir .aot/ttft --out $OUT/gpu_ttft.json
      [--layers 8] [--prompt 100] [--new 32] [--cases jit,aot,jit,aot] [--budget-s 200]

The artifacts (sm_90a, 0.5 MB; .aot/ is git-ignored) come from the CPU machine:
  python scripts/build_aot.py --out .aot/ttft --arch sm_90a --m 1,128 \
      --linears 2048x2048:4:mcg,2048x512:4:mcg,2048x8192:4:mcg,8192x2048:4:mcg
  python scripts/build_aot.py --out .aot/ttft --arch sm_90a --m 1 --linears 2048x32000:6:mcg

Writes a random-trellis EXL3 checkpoint (Llama geometry: hidden 2048, FFN 8192, 32 q / 8 kv heads
of 64, vocab 32000, K=4 mcg body, K=6 mcg lm_head; scripts/bench_generate.py's writer) once, then
runs every case in a fresh child process (no compile cache shared; JAX's persistent compilation
cache disabled):

  jit: CuTe DSL importable; cutlass_call compiles every kernel while generate is lowered.
  aot: EXL3_JAX_AOT_DIR=<--aot-dir> (artifacts exported on a CPU machine by scripts/build_aot.py),
       CuTe DSL removed from PYTHONPATH; only libcute_dsl_runtime.so is loaded
       (CUTE_DSL_RUNTIME_LIBRARY), so the process cannot compile a kernel.

Per child (times in seconds):
  ttft_s          model loaded (weights on the device) -> first generated token on the host:
                  the first call of Generator.generate(prompt, max_new_tokens=1), i.e. tracing,
                  kernel compile (jit) or artifact load (aot), XLA compile, prefill and the one
                  decode step the loop runs. The headline number.
  ttft_from_process_start_s   the same end point measured from the parent's spawn of the child
                  (adds Python + jax import and the checkpoint load).
  warm_first_token_s          a second identical call (run only).
  second_program_s             first call of generate(max_new_tokens=--new): a new output bucket,
                  so XLA compiles again while every kernel is already compiled (jit) or loaded
                  (aot): a control, expected equal in both modes.
  cute_compile_s / cute_kernels  (jit) time inside cutlass.jax's get_or_compile_kernel (CuTe
                  tracing + compile, cache hits included) and kernels compiled.
  aot_hits / aot_misses / aot_load_s  (aot) artifact lookups and deserialization time.
Greedy tokens of the --new call are compared across cases (same kernels, so expected equal).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _gpu_bench_common import (CallTimer, cute_compile_timer, cute_kernels_compiled,
                               run_metadata, timed_generate, write_json)

LLAMA_2048 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
                  hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _cutlass_paths(pythonpath: str) -> tuple[list[str], str | None]:
    """(PYTHONPATH entries without the CuTe DSL bundle, path of libcute_dsl_runtime.so)."""
    keep, runtime = [], None
    for entry in filter(None, pythonpath.split(os.pathsep)):
        libs = glob.glob(os.path.join(entry, "nvidia_cutlass_dsl", "cu*", "lib",
                                      "libcute_dsl_runtime.so"))
        if libs:
            runtime = runtime or libs[0]
        if libs or "nvidia_cutlass_dsl" in entry:
            continue
        keep.append(entry)
    if runtime is None:      # an installed wheel instead of the bundle
        for entry in sys.path:
            libs = glob.glob(os.path.join(entry, "nvidia_cutlass_dsl", "cu*", "lib",
                                          "libcute_dsl_runtime.so"))
            if libs:
                runtime = libs[0]
                break
    return keep, runtime


def child_env(case: str, aot_dir: str) -> dict:
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("EXL3_JAX_AOT_DIR", None)
    env.pop("EXL3_JAX_BACKEND", None)
    if case == "aot":
        keep, runtime = _cutlass_paths(os.environ.get("PYTHONPATH", ""))
        if runtime is None:
            raise SystemExit("libcute_dsl_runtime.so not found on PYTHONPATH / sys.path")
        if keep:
            env["PYTHONPATH"] = os.pathsep.join(keep)
        else:
            env.pop("PYTHONPATH", None)
        env["CUTE_DSL_RUNTIME_LIBRARY"] = runtime
        env["EXL3_JAX_AOT_DIR"] = os.path.abspath(aot_dir)
    return env


# ---------------------------------------------------------------------------------------------
# child


def run_child(a) -> dict:
    t_start = time.time()
    import jax
    import numpy as np

    from exl3_jax import ops
    from exl3_jax.ffi import aot
    from exl3_jax.generate import Generator
    from exl3_jax.models import load_model
    from flax import nnx

    row = {"case": a.child, "spawn_to_child_start_s": round(t_start - a.spawned_at, 3)}
    t_import = time.time()
    row["import_s"] = round(t_import - t_start, 3)
    row["device"] = jax.devices()[0].device_kind
    row["jax"] = jax.__version__
    row["persistent_cache"] = (jax.config.jax_enable_compilation_cache,
                               jax.config.jax_compilation_cache_dir)   # (False, None) wanted

    model = load_model(a.checkpoint, dtype="bfloat16")
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    gen = Generator(model)
    t_loaded = time.time()
    row["load_s"] = round(t_loaded - t_import, 3)
    # Inside the TTFT window, as in any process: the jit case imports the CuTe compiler, the
    # aot case loads libcute_dsl_runtime.so and the manifest (both via resolve_backend).
    # Measurement only: time cutlass.jax's kernel compile entry point (jit) or artifact loads.
    if a.child == "jit":
        kernel_timer = cute_compile_timer()
        if kernel_timer is None:
            raise SystemExit("jit case: CuTe DSL (cutlass.jax) is not importable")
    else:
        kernel_timer = CallTimer(aot, "load")
    row["backend"] = ops.resolve_backend()
    if row["backend"] != "gpu" and not a.allow_reference:
        raise SystemExit(f"the GPU kernels are not in use (backend {row['backend']})")

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, LLAMA_2048["vocab_size"], size=a.prompt)]
    first = gen.generate([prompt], max_new_tokens=1, stop_tokens=[])
    t_first = time.time()
    row["ttft_s"] = round(t_first - t_loaded, 3)
    row["ttft_from_process_start_s"] = round(t_first - a.spawned_at, 3)
    row["first_token"] = first.tokens[0]
    row["warm_first_token_s"] = round(timed_generate(gen, [prompt], 1)[0], 4)
    seconds, tokens = timed_generate(gen, [prompt], a.new)
    row["second_program_s"] = round(seconds, 3)
    row["warm_generate_s"] = round(timed_generate(gen, [prompt], a.new)[0], 4)
    row["tokens"] = tokens[0]
    if a.child == "jit":
        row["cute_compile_s"] = round(kernel_timer.seconds, 3)
        row["cute_kernels"] = cute_kernels_compiled()
    else:
        arts = aot.artifacts()
        row["aot_load_s"] = round(kernel_timer.seconds, 3)
        row["aot_hits"] = sum(arts.hits.values())
        row["aot_misses"] = sum(arts.misses.values())
        row["aot_artifacts_used"] = len(arts.loaded)
    row["cutlass_imported"] = "cutlass" in sys.modules
    return row


# ---------------------------------------------------------------------------------------------
# parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aot-dir", default=".aot/ttft")
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens (bucket 128)")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--cases", default="jit,aot,jit,aot")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="start no new case after this many seconds")
    p.add_argument("--allow-reference", action="store_true",
                   help="dry run of the script on a CPU machine (reference backend)")
    p.add_argument("--child", choices=("jit", "aot"), help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(run_child(a)), flush=True)
        return 0

    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_generate import write_checkpoint

    t_begin = time.time()
    cfg = dict(LLAMA_2048, num_hidden_layers=a.layers)
    result = {"benchmark": "time to first token of exl3_jax.generate, JIT vs AOT kernels",
              "model": {k: cfg[k] for k in ("num_hidden_layers", "hidden_size",
                                            "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "vocab_size")},
              "quant": "K=4 mcg body, K=6 mcg lm_head (random trellis)",
              "prompt_tokens": a.prompt, "prompt_bucket": 128, "batch": 1,
              "new_tokens": a.new, "activation_dtype": "bfloat16",
              **run_metadata(__file__, argv),
              "ttft_definition": "model-load-done -> first token of the first "
                                 "Generator.generate(max_new_tokens=1) call, fresh process",
              "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        ckpt = write_checkpoint(Path(tmp) / "llama2048", cfg, np.random.default_rng(0))
        result["write_checkpoint_s"] = round(time.time() - t0, 2)
        print(f"checkpoint written in {result['write_checkpoint_s']} s", flush=True)
        last = 0.0
        for case in a.cases.split(","):
            if time.time() - t_begin + last > a.budget_s:
                print(f"budget: skipping {case}", flush=True)
                result["cases"].append({"case": case, "skipped": "budget"})
                continue
            t0 = time.time()
            cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--checkpoint",
                   str(ckpt), "--prompt", str(a.prompt), "--new", str(a.new), "--spawned-at",
                   repr(t0)] + (["--allow-reference"] if a.allow_reference else [])
            proc = subprocess.run(cmd, env=child_env(case, a.aot_dir), capture_output=True,
                                  text=True)
            last = time.time() - t0
            rows = [json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")]
            row = rows[0] if rows else {"case": case, "error": proc.stderr[-4000:],
                                        "rc": proc.returncode}
            row["wall_s"] = round(last, 2)
            result["cases"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    done = [r for r in result["cases"] if "ttft_s" in r]
    for case in ("jit", "aot"):
        ts = sorted(r["ttft_s"] for r in done if r["case"] == case)
        if ts:
            result[f"{case}_ttft_s"] = ts
    toks = {json.dumps(r["tokens"]) for r in done}
    result["tokens_agree"] = len(toks) == 1 if done else None
    if result.get("jit_ttft_s") and result.get("aot_ttft_s"):
        result["ttft_jit_minus_aot_s"] = round(min(result["jit_ttft_s"]) -
                                               min(result["aot_ttft_s"]), 3)
    result["seconds"] = round(time.time() - t_begin, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}), flush=True)
    print(f"{'case':<5} {'ttft_s':>7} {'from_start_s':>12} {'kernels_s':>9} {'2nd_prog_s':>10} "
          f"{'warm_s':>7}  note")
    for r in result["cases"]:
        if "ttft_s" not in r:
            print(f"{r['case']:<5} {'-':>7}  {r.get('skipped') or r.get('error', '')[-200:]}")
            continue
        ks = r.get("cute_compile_s", r.get("aot_load_s"))
        note = (f"{r['cute_kernels']} CuTe kernels compiled" if r["case"] == "jit" else
                f"{r['aot_artifacts_used']} artifacts, {r['aot_hits']} hits, "
                f"{r['aot_misses']} misses, cutlass imported: {r['cutlass_imported']}")
        print(f"{r['case']:<5} {r['ttft_s']:7.2f} {r['ttft_from_process_start_s']:12.2f} "
              f"{ks:9.2f} {r['second_program_s']:10.2f} {r['warm_first_token_s']:7.3f}  {note}")
    print(f"tokens agree across cases: {result['tokens_agree']}", flush=True)
    if a.out:
        write_json(a.out, result)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
