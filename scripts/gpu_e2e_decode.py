"""End-to-end generate throughput with the GPU kernels on synthetic 4 bpw models built in memory.

  python scripts/gpu_e2e_decode.py [--out $OUT/gpu_e2e_decode.json] [--budget-s 220]
      [--cases moe:1:512,moe:8:64,dense:1:512,dense:8:64,moe:1:512:tp2:experts] [--new 64]
      [--repeats 5] [--codebook mcg] [--tiny]

Models (random int16 trellis drawn on the device with jax.random, suh ~ N(0,1)/sqrt(in),
svh ~ N(0, 0.5^2) (0 on padded outputs), norms 1, N(0,1) fp16 embeddings; body K=4, lm_head K=6;
built by exl3_jax.models.decoder.build_model from an in-memory weight source, no checkpoint):
  moe    Qwen3-30B-A3B geometry: 48 layers, hidden 2048, 32 q / 4 kv heads x 128, 128 experts of
         intermediate 768, top-8 (renormalised softmax router), q/k norm, vocab 151936.
  dense  Llama-3-8B geometry: 32 layers, hidden 4096, FFN 14336, 32 / 8 heads x 128, vocab 128256.
  dense_bf16  the same geometry with plain bf16 weights ~ N(0,1)/sqrt(in) (the issue's baseline):
         every linear is a bf16 x bf16 -> fp32-accumulated dot (XLA / cuBLAS), no EXL3.
--tiny: the same code path with 2 layers and small dims (CPU check of the script's logic).

A case "model:batch:prompt" is one compiled generate program (Generator with min_bucket =
bucket(--new), so max_new_tokens=1 and =--new share the program; max_new_tokens is traced):
  first call generate(N)               -> first_call_s (trace + CuTe + XLA compile + run)
  --repeats x (generate(1), generate(N)), stop tokens disabled, results fetched to the host
  decode step   = (median t(N) - median t(1)) / (N - 1)   (the loop runs N vs 1 decode steps)
  decode tok/s  = batch / decode step
  prefill       = median t(1) - decode step  (prompt through the model + first token), tok/s =
                  batch * prompt / prefill (real prompt tokens; the default prompts fill their
                  bucket, bucket(max(prompt, min_bucket)), exactly)
  compile_s     = first_call_s - median t(N)
Which backend each op used is recorded from trace-time counters on the dispatch targets
(exl3_jax.ffi.trellis_gemm.trellis_matmul_gpu, the jnp linear_reference, the fused MoE
exl3_jax.ffi.trellis_moe.moe_gpu, the all-experts / packed MoE references). On a GPU the script
fails a case whose dense linears did not all run the GPU kernel.

Budget: no case starts when the elapsed time plus its estimated cost exceeds --budget-s; the
JSON is rewritten after every case; a watchdog writes it and exits at --hard-limit-s.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_bench_common import (cute_compile_timer, cute_kernels_compiled, run_metadata,
                               timed_generate, versions, write_json)

T_START = time.time()

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
TINY = {
    "moe": dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
    # head_dim 128: a KV head is one Hadamard block, so --tiny cases can also run at tp2
    "dense": dict(LLAMA3_8B, vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128),
}
TINY["dense_bf16"] = TINY["dense"]
FULL = {"moe": QWEN3_30B_A3B, "dense": LLAMA3_8B, "dense_bf16": LLAMA3_8B}
BF16_MODELS = ("dense_bf16",)
DEFAULT_CASES = ("moe:1:512,moe:8:64,dense:1:512,dense:8:64,dense_bf16:1:512,"
                 "dense_bf16:8:64")
TINY_CASES = "moe:1:64,dense:8:32"      # two programs: keeps the CPU check under a minute
GEOMETRY_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_experts", "num_experts_per_tok", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size")


# -- the in-memory model ------------------------------------------------------------------------

def _pad128(d: int) -> int:
    return -(-d // 128) * 128


@functools.partial(jax.jit, static_argnames=("lead", "in_f", "out_f", "K"))
def _random_exl3_leaves(key, *, lead: tuple, in_f: int, out_f: int, K: int):
    """Random EXL3 leaves on the device (any int16 trellis is a valid encoding).

    Returns trellis int16 [*lead, k/16, n/16, 16K], suh fp16 [*lead, k] ~ N(0,1)/sqrt(in_f),
    svh fp16 [*lead, n] ~ N(0, 0.5^2) with 0 on the padded outputs (k, n padded to 128)."""
    k, n = _pad128(in_f), _pad128(out_f)
    kt, ks, kv = jax.random.split(key, 3)
    bits = jax.random.bits(kt, (*lead, k // 16, n // 16, 16 * K), jnp.uint16)
    trellis = jax.lax.bitcast_convert_type(bits, jnp.int16)
    suh = (jax.random.normal(ks, (*lead, k)) / math.sqrt(in_f)).astype(jnp.float16)
    svh = 0.5 * jax.random.normal(kv, (*lead, n))
    svh = jnp.where(jnp.arange(n) < out_f, svh, 0.0).astype(jnp.float16)
    return trellis, suh, svh


class RandomWeightSource:
    """Stands in for ``models.WeightSource`` (same methods the layer builders call) with random
    weights drawn on the default device: EXL3 linears (``K`` body, ``head_K`` lm_head), expert
    stacks drawn stacked, plain router weights; plain tensors: norms 1, embeddings N(0,1) fp16.
    With ``bf16=True`` every linear (lm_head included) is a plain bf16 weight instead."""

    def __init__(self, config: dict, *, K: int, head_K: int, codebook: str, seed: int = 0,
                 bf16: bool = False):
        self.config = config
        self.bf16 = bf16
        self.quantized = not bf16
        self.directory = Path(f"<in-memory random {config['model_type']}>")
        self.config_path = None
        self.K, self.head_K, self.codebook = K, head_K, codebook
        self._key = jax.random.key(seed)
        self._count = 0

    def _next_key(self):
        self._count += 1
        return jax.random.fold_in(self._key, self._count)

    @staticmethod
    def _is_router(key: str) -> bool:
        return key.endswith(".gate")

    def has(self, name: str) -> bool:
        return name.endswith("layernorm.weight") or name.endswith("norm.weight") or \
            name == "model.embed_tokens.weight" or (self.bf16 and name == "lm_head.weight")

    def is_exl3(self, key: str) -> bool:
        return not self.bf16 and not self._is_router(key)

    def tensor(self, name: str, shape: tuple[int, ...]):
        if name == "model.embed_tokens.weight":
            return jax.random.normal(self._next_key(), shape, jnp.float16)
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        if self._is_router(name.removesuffix(".weight")):    # [E, H] bf16 as Qwen3 stores it,
            return (2.0 * jax.random.normal(self._next_key(), shape)    # logits of O(1)
                    / math.sqrt(shape[1])).astype(jnp.bfloat16)
        raise KeyError(f"the random source has no plain tensor {name!r}")

    def exl3_weight(self, key: str, in_features: int, out_features: int, lead: tuple = ()):
        from exl3_jax.trellis import Exl3Weight
        K = self.head_K if key == "lm_head" else self.K
        trellis, suh, svh = _random_exl3_leaves(self._next_key(), lead=lead, in_f=in_features,
                                                out_f=out_features, K=K)
        return Exl3Weight.create(trellis, suh, svh, self.codebook, in_features=in_features,
                                 out_features=out_features)

    def linear(self, key: str, in_features: int, out_features: int, *, bias: bool = False,
               dtype=jnp.float32):
        from exl3_jax.nn import Exl3Linear, Linear
        if bias:
            raise NotImplementedError("the random source builds bias-free linears only")
        if self.bf16:
            w = jax.random.normal(self._next_key(), (in_features, out_features), jnp.bfloat16)
            return Linear(w * jnp.bfloat16(1 / math.sqrt(in_features)))   # bf16 x bf16, fp32 acc.
        return Exl3Linear(self.exl3_weight(key, in_features, out_features))

    def expert_stack(self, keys: list[str], in_features: int, out_features: int):
        return self.exl3_weight(keys[0], in_features, out_features, lead=(len(keys),))


def random_model(config: dict, *, K: int, head_K: int, codebook: str, seed: int,
                 dtype: str = "bfloat16", bf16: bool = False):
    """A CausalLM of ``config`` with random EXL3 (or, with ``bf16``, plain bf16) weights:
    models.decoder.build_model (the body of load_model) on the random source in place of a
    directory."""
    from exl3_jax.models import build_model
    src = RandomWeightSource(config, K=K, head_K=head_K, codebook=codebook, seed=seed, bf16=bf16)
    return build_model(src, dtype=dtype)


def exl3_bytes(model) -> int:
    """Bytes of every quantized leaf (trellis + scales) in the model."""
    from flax import nnx

    from exl3_jax.nn import Exl3Experts, Exl3Linear
    total = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, Exl3Linear):
            total += m.weight.nbytes
        elif isinstance(m, Exl3Experts):     # w13 [2, E] + down, or separate gate/up/down
            stacks = (m.w13, m.down) if getattr(m, "w13", None) is not None else \
                (m.gate, m.up, m.down)
            total += sum(w.nbytes for w in stacks)
    return total


def moe_backend_of(model) -> str | None:
    """exl3_jax.ops.moe's auto choice for the model's first expert stack (None: no MoE)."""
    from flax import nnx

    from exl3_jax.nn import Exl3Experts
    for _, m in nnx.iter_modules(model):
        if isinstance(m, Exl3Experts):
            try:
                from exl3_jax.ops.moe import resolve_moe_backend
                return resolve_moe_backend(None, m.w13, m.down)
            except Exception as e:        # the MoE dispatch is being rewired: record, go on
                return f"unknown ({type(e).__name__}: {e})"
    return None


# -- which backend ran: trace-time counters on the dispatch targets --------------------------------

class BackendCounters:
    """Counts, per trace, calls of each op implementation (keys 'm{m} {k}x{n} K{K}')."""

    def __init__(self):
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def reset(self) -> None:
        self.counts.clear()

    def snapshot(self) -> dict:
        return {kind: dict(c) for kind, c in sorted(self.counts.items())}

    def _wrap(self, module, name: str, kind: str, describe) -> None:
        inner = getattr(module, name)
        if getattr(inner, "_e2e_counted", False):
            return

        @functools.wraps(inner)
        def counted(*args, **kwargs):
            try:
                self.counts[kind][describe(*args, **kwargs)] += 1
            except Exception:
                self.counts[kind]["?"] += 1
            return inner(*args, **kwargs)
        counted._e2e_counted = True
        setattr(module, name, counted)

    def install(self, gpu: bool) -> None:
        import importlib      # (exl3_jax.ops re-exports functions named like these modules)
        ops_moe = importlib.import_module("exl3_jax.ops.moe")
        ops_tm = importlib.import_module("exl3_jax.ops.trellis_matmul")

        def lin(x, w, *a, **k):
            m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
            return f"m{m} {w.k}x{w.n} K{w.K}"

        def ref_lin(x, trellis, *a, **k):
            m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
            return f"m{m} {x.shape[-1]}x{trellis.shape[-2] * 16} K{trellis.shape[-1] // 16}"

        def moe_desc(x, ids, *a, **k):
            return f"T{x.shape[0]} top{ids.shape[1]}"

        self._wrap(ops_tm, "linear_reference", "linear_reference", ref_lin)
        for mod in (ops_moe,):
            self._wrap(mod, "moe_experts", "moe_all_experts_reference", moe_desc)
            if hasattr(mod, "moe_packed_reference"):
                self._wrap(mod, "moe_packed_reference", "moe_packed_reference", moe_desc)
        try:
            nn_moe = importlib.import_module("exl3_jax.nn.moe")
            if hasattr(nn_moe, "moe_experts"):
                self._wrap(nn_moe, "moe_experts", "moe_all_experts_reference", moe_desc)
        except ImportError:
            pass
        if gpu:
            from exl3_jax.ffi import trellis_gemm
            self._wrap(trellis_gemm, "trellis_matmul_gpu", "linear_gpu", lin)

            def group(x, ws, *a, **k):
                m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
                return f"m{m} {ws[0].k}x" + "+".join(str(w.n) for w in ws) + f" K{ws[0].K}"
            self._wrap(trellis_gemm, "trellis_matmul_group_gpu", "linear_group_gpu", group)
            try:
                from exl3_jax.ffi import trellis_moe
                self._wrap(trellis_moe, "moe_gpu", "moe_fused_gpu", moe_desc)
            except Exception as e:     # no fused MoE module: its absence shows in moe_path
                print(f"fused MoE kernels not importable: {type(e).__name__}: {e}", flush=True)


# -- measurement ----------------------------------------------------------------------------------

def measure_case(gen, cfg: dict, batch: int, prompt: int, new: int, repeats: int,
                 rng) -> dict:
    """Decode / prefill timings of one (batch, prompt) program; see the module docstring."""
    from exl3_jax.generate import bucket
    prompts = [[int(t) for t in rng.integers(3, cfg["vocab_size"], size=prompt)]
               for _ in range(batch)]
    row = {"batch": batch, "prompt_tokens": prompt,
           "prompt_bucket": bucket(prompt, gen.min_bucket), "new_tokens": new,
           "output_bucket": bucket(new, gen.min_bucket)}
    row["cache_slots"] = row["prompt_bucket"] + row["output_bucket"]
    first_s, toks = timed_generate(gen, prompts, new)
    row["first_call_s"] = round(first_s, 3)
    if [len(t) for t in toks] != [new] * batch:
        raise RuntimeError(f"generate returned {[len(t) for t in toks]} tokens, expected {new} "
                           f"per row (stop tokens should be disabled)")
    bad = [t for r in toks for t in r if not 0 <= t < cfg["vocab_size"]]
    if bad:
        raise RuntimeError(f"generated token ids outside the vocabulary: {bad[:5]}")
    row["tokens_row0_head"] = toks[0][:8]
    t1s, tns = [], []
    for _ in range(repeats):
        t1s.append(timed_generate(gen, prompts, 1)[0])
        tn, toks_again = timed_generate(gen, prompts, new)
        tns.append(tn)
    row["greedy_tokens_repeat"] = toks_again == toks
    t1, tn = statistics.median(t1s), statistics.median(tns)
    step = (tn - t1) / (new - 1)
    row.update({
        "t_generate_1_s": [round(t, 5) for t in t1s],
        f"t_generate_{new}_s": [round(t, 5) for t in tns],
        "decode_ms_per_step": round(1e3 * step, 4),
        "decode_ms_per_token_per_sequence": round(1e3 * step, 4),
        "decode_tokens_per_s": round(batch / step, 1) if step > 0 else None,
        "decode_step_spread_ms": [round(1e3 * (b - a) / (new - 1), 4) for a, b in zip(t1s, tns)],
        "compile_s": round(first_s - tn, 3),
    })
    prefill = t1 - step
    row["prefill_s"] = round(prefill, 5)
    row["prefill_tokens"] = batch * prompt
    row["prefill_tokens_per_s"] = round(batch * prompt / prefill, 1) if prefill > 0 else None
    return row


def speedups_over_bf16(cases: list[dict]) -> dict:
    """{'b<batch>': EXL3 dense decode tok/s / bf16 dense decode tok/s} for batches measured in
    both models (the issue's end-to-end target is >= 1.8 at batch 1)."""
    rate = {(c["model"], c["batch"]): c["decode_tokens_per_s"] for c in cases
            if c.get("decode_tokens_per_s") and c.get("tp", 1) == 1}
    return {f"b{b}": round(r / rate[("dense_bf16", b)], 3)
            for (name, b), r in sorted(rate.items())
            if name == "dense" and ("dense_bf16", b) in rate}


MOE_MODES = ("experts", "tensor")


def parse_cases(text: str) -> list[tuple[str, int, int, int, str]]:
    """(model, batch, prompt, tp, moe_mode) per "model:batch:prompt[:tpN[:experts|tensor]]"."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        tp, mode = 1, "experts"
        if len(parts) >= 4:
            tp = int(parts[3][2:]) if parts[3].startswith("tp") and parts[3][2:].isdigit() else 0
            mode = parts[4] if len(parts) == 5 else mode
        if (not 3 <= len(parts) <= 5 or parts[0] not in FULL or tp < 1
                or mode not in MOE_MODES):
            raise SystemExit(f"bad case {item!r}: expected model:batch:prompt[:tpN[:mode]] with "
                             f"model in {sorted(FULL)}, N >= 1 and mode in {MOE_MODES}")
        cases.append((parts[0], int(parts[1]), int(parts[2]), tp, mode))
    return cases


def case_label(name: str, batch: int, prompt: int, tp: int, mode: str) -> str:
    return f"{name}:b{batch}:p{prompt}" + (f":tp{tp}:{mode}" if tp > 1 else "")


def tp_scaling(cases: list[dict]) -> list[dict]:
    """Per sharded case, its decode and prefill tokens/s over the same model and batch at tp=1:
    the speedup and the scaling efficiency (speedup / tp)."""
    base = {(c["model"], c["batch"]): c for c in cases
            if c.get("tp", 1) == 1 and c.get("decode_tokens_per_s")}
    rows = []
    for c in cases:
        one = base.get((c["model"], c.get("batch")))
        if c.get("tp", 1) == 1 or not c.get("decode_tokens_per_s") or one is None:
            continue
        row = {"case": c["case"], "tp": c["tp"], "moe_mode": c["moe_mode"]}
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            if c.get(key) and one.get(key):
                speedup = c[key] / one[key]
                row[key.replace("tokens_per_s", "speedup")] = round(speedup, 3)
                row[key.replace("tokens_per_s", "efficiency")] = round(speedup / c["tp"], 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "gpu_e2e_decode.json"))
    p.add_argument("--cases", default=None,
                   help=f"model:batch:prompt[:tpN[:experts|tensor]], in order (default "
                        f"{DEFAULT_CASES}; with --tiny {TINY_CASES}); the batch-1 512-token case "
                        f"gives the prefill number; tpN shards the model over N devices "
                        f"(Generator(mesh=parallel.make_mesh(N)), MoE layers expert-parallel or "
                        f"tensor-split)")
    p.add_argument("--new", type=int, default=None,
                   help="decode steps N of the long call (default 64; 8 with --tiny)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--K", type=int, default=4)
    p.add_argument("--head-K", type=int, default=6)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=220.0,
                   help="start no case that would end after this many seconds (estimate)")
    p.add_argument("--hard-limit-s", type=float, default=270.0,
                   help="watchdog: write the JSON and exit at this many seconds")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, small dims; reference backend allowed (CPU check)")
    p.add_argument("--allow-reference", action="store_true",
                   help="do not fail when the dense linears run the jnp reference")
    a = p.parse_args(argv)
    if a.new is None:
        a.new = 8 if a.tiny else 64
    if a.new < 2:
        raise SystemExit("--new must be >= 2")
    allow_reference = a.allow_reference or a.tiny
    configs = TINY if a.tiny else FULL
    cases = parse_cases(a.cases or (TINY_CASES if a.tiny else DEFAULT_CASES))

    from exl3_jax import ops
    from exl3_jax.generate import Generator, bucket
    from flax import nnx

    backend = ops.resolve_backend()
    gpu = backend == "gpu"
    counters = BackendCounters()
    counters.install(gpu)
    cute = cute_compile_timer() if gpu else None
    dev = jax.devices()[0]
    result = {
        "benchmark": "exl3_jax.generate end-to-end decode/prefill throughput, synthetic "
                     "random-trellis EXL3 models built in memory",
        **run_metadata(__file__, argv),
        "device": getattr(dev, "device_kind", str(dev)), "jax_backend": jax.default_backend(),
        "versions": versions(), "linear_backend_auto": backend,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("EXL3_JAX_")},
        "quant": f"K={a.K} {a.codebook} body and experts, K={a.head_K} {a.codebook} lm_head "
                 f"(random trellis)",
        "activation_dtype": "bfloat16", "tiny": a.tiny, "new_tokens": a.new,
        "repeats": a.repeats, "budget_s": a.budget_s,
        "method": "decode step = (median t(generate N) - median t(generate 1)) / (N-1), same "
                  "compiled program (Generator min_bucket = bucket(N)), stop tokens disabled, "
                  "results fetched to the host; prefill = median t(generate 1) - decode step; "
                  "compile_s = first call - median t(N)",
        "targets": {"moe_decode_b1_tokens_per_s": 250, "moe_decode_b8_tokens_per_s": 1000,
                    "dense_decode_b1_speedup_over_bf16": 1.8},
        "models": {}, "cases": []}
    lock = threading.Lock()

    def write_result():
        with lock:
            result["seconds"] = round(time.time() - T_START, 1)
            write_json(a.out, result)

    def watchdog():
        result["watchdog"] = f"hard limit {a.hard_limit_s} s reached; process exited"
        print(f"watchdog: {a.hard_limit_s} s reached, writing {a.out} and exiting", flush=True)
        try:
            write_result()
        finally:
            os._exit(3)
    timer = threading.Timer(max(1.0, a.hard_limit_s - (time.time() - T_START)), watchdog)
    timer.daemon = True
    timer.start()
    write_result()

    models: dict[str, tuple] = {}
    rng = np.random.default_rng(a.seed)
    last = None          # (model name, wall seconds) of the last case that ran
    ok = True
    for name, batch, prompt, tp, mode in cases:
        cfg = configs[name]
        case = {"case": case_label(name, batch, prompt, tp, mode), "model": name, "tp": tp,
                "moe_mode": mode}
        # cost estimate: the last case, scaled by layers; a model build adds its last build
        est = 0.0
        if last is not None:
            est = last[1] * cfg["num_hidden_layers"] / configs[last[0]]["num_hidden_layers"]
        elapsed = time.time() - T_START
        if elapsed + est > a.budget_s:
            case["skipped"] = f"budget: {elapsed:.0f} s elapsed + ~{est:.0f} s estimated > " \
                              f"{a.budget_s:.0f} s"
            print(f"{case['case']}: {case['skipped']}", flush=True)
            result["cases"].append(case)
            write_result()
            continue
        t_case = time.time()
        result["in_progress"] = case["case"]      # named in the JSON if the watchdog fires
        try:
            if name not in models:
                t0 = time.time()
                model = random_model(cfg, K=a.K, head_K=a.head_K, codebook=a.codebook,
                                     seed=a.seed + len(models), bf16=name in BF16_MODELS)
                jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
                info = {"geometry": {k: cfg[k] for k in GEOMETRY_KEYS if k in cfg},
                        "architecture": cfg["architectures"][0],
                        "build_s": round(time.time() - t0, 2),
                        "exl3_gbytes": round(exl3_bytes(model) / 1e9, 3),
                        "moe_backend_auto": moe_backend_of(model)}
                result["models"][name] = info
                print(f"{name}: built in {info['build_s']} s, {info['exl3_gbytes']} GB of EXL3 "
                      f"tensors, MoE backend {info['moe_backend_auto']}", flush=True)
                models[name] = (model, {})
                write_result()
            model, gens = models[name]
            min_bucket = bucket(a.new)
            if tp > jax.device_count():
                raise RuntimeError(f"tp={tp} needs {tp} devices, {jax.device_count()} seen")
            if (min_bucket, tp, mode) not in gens:
                from exl3_jax.parallel import make_mesh
                gens[(min_bucket, tp, mode)] = Generator(
                    model, min_bucket=min_bucket, mesh=make_mesh(tp) if tp > 1 else None,
                    moe_mode=mode)
            gen = gens[(min_bucket, tp, mode)]
            counters.reset()
            cute_s0 = cute.seconds if cute else 0.0
            row = measure_case(gen, cfg, batch, prompt, a.new, a.repeats, rng)
            case.update(row)
            case["op_calls_traced"] = counters.snapshot()
            if cute is not None:
                case["cute_compile_s"] = round(cute.seconds - cute_s0, 3)
                case["cute_kernels_total"] = cute_kernels_compiled()
            traced = case["op_calls_traced"]
            case["dense_linears_backend"] = (
                "gpu" if traced.get("linear_gpu") and not traced.get("linear_reference")
                else "reference" if traced.get("linear_reference") and not traced.get("linear_gpu")
                else "mixed" if traced.get("linear_reference") else "none")
            if name == "moe":
                case["moe_fused_kernel"] = bool(traced.get("moe_fused_gpu"))
                case["moe_path"] = ("fused_gpu" if traced.get("moe_fused_gpu") else
                                    "packed_reference" if traced.get("moe_packed_reference") else
                                    "all_experts_reference" if
                                    traced.get("moe_all_experts_reference") else "unknown")
            if name in BF16_MODELS:
                case["dense_linears_backend"] = "bf16"
            elif not allow_reference and case["dense_linears_backend"] != "gpu":
                raise RuntimeError(f"the dense EXL3 linears did not all run the GPU kernel: "
                                   f"{case['dense_linears_backend']} ({traced})")
        except Exception as e:
            ok = False
            case["error"] = f"{type(e).__name__}: {e}"
            case["traceback"] = traceback.format_exc()[-4000:]
            print(f"{case['case']}: ERROR {case['error']}", flush=True)
        case["wall_s"] = round(time.time() - t_case, 2)
        last = (name, case["wall_s"])
        result["cases"].append(case)
        write_result()
        print(json.dumps({k: v for k, v in case.items()
                          if k not in ("traceback", "op_calls_traced")}), flush=True)
    timer.cancel()
    result.pop("in_progress", None)
    result["dense_speedup_over_bf16"] = speedups_over_bf16(result["cases"])
    result["tp_scaling"] = tp_scaling(result["cases"])
    write_result()

    print(f"\n{result['device']}  jax {result['versions']['jax']}  cutlass-dsl "
          f"{result['versions']['nvidia-cutlass-dsl']}  linears: {backend}  "
          f"{result['seconds']} s total")
    print(f"{'case':<16} {'dec tok/s':>10} {'ms/step':>8} {'prefill tok/s':>13} "
          f"{'compile s':>9} {'linears':>8} {'moe':>22}")
    for c in result["cases"]:
        if "decode_tokens_per_s" not in c:
            print(f"{c['case']:<16} {c.get('skipped') or c.get('error', '')[:90]}")
            continue
        print(f"{c['case']:<16} {c['decode_tokens_per_s']!s:>10} {c['decode_ms_per_step']:8.3f} "
              f"{c['prefill_tokens_per_s']!s:>13} {c['compile_s']:9.1f} "
              f"{c['dense_linears_backend']:>8} {c.get('moe_path', '-'):>22}")
    if result["dense_speedup_over_bf16"]:
        print(f"dense EXL3 / bf16 decode tok/s: {result['dense_speedup_over_bf16']}")
    for row in result["tp_scaling"]:
        print(f"scaling {json.dumps(row)}")
    print(f"wrote {a.out}", flush=True)
    return 0 if ok and any("decode_tokens_per_s" in c for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
