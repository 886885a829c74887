"""Prefill / decode speed and jit compile time of exl3_jax.generate on a synthetic model.

Usage: python scripts/bench_generate.py [--layers 30] [--prompt 128] [--new 32] [--batch 1]
       [--dtype bfloat16] [--out bench/results/cpu_generate_smollm2.json]

Writes a random-trellis EXL3 checkpoint with SmolLM2-135M geometry (30 layers, hidden 576, FFN
1536, 9 q / 3 kv heads of 64, vocab 49152, K=4 body, K=6 separate lm_head) to a temporary
directory, loads it with the dequantized-weight cache (the CPU reference shortcut), and measures:
prefill (jitted prefill of one bucketed prompt) and decode (the one-jit generate loop, minus its
prefill) tokens per second, plus compile times. Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from exl3_jax.format import Exl3Writer
from exl3_jax.generate import Generator, SamplingParams, _generate, _prefill, bucket, left_pad
from exl3_jax.models import load_model

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
               hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
               rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)


def pad(d):
    return -(-d // 128) * 128


def write_checkpoint(directory: Path, cfg: dict, rng, K=4, head_K=6) -> Path:
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def lin(w, key, i, o, k):
        t = rng.integers(-32768, 32768, size=(pad(i) // 16, pad(o) // 16, 16 * k), dtype=np.int16)
        suh = (rng.standard_normal(pad(i)) / np.sqrt(i)).astype(np.float16)
        svh = (0.5 * rng.standard_normal(pad(o))).astype(np.float16)
        svh[o:] = 0
        w.add_linear(key, t, suh, svh, "mcg")

    with Exl3Writer(directory, cfg) as w:
        w.add_tensor("model.embed_tokens.weight",
                     rng.standard_normal((V, H)).astype(np.float16))
        w.add_tensor("model.norm.weight", np.ones(H, np.float16))
        lin(w, "lm_head", H, V, head_K)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            w.add_tensor(f"{p}.input_layernorm.weight", np.ones(H, np.float16))
            w.add_tensor(f"{p}.post_attention_layernorm.weight", np.ones(H, np.float16))
            for name, ii, oo in (("self_attn.q_proj", H, nh * D), ("self_attn.k_proj", H, nkv * D),
                                 ("self_attn.v_proj", H, nkv * D), ("self_attn.o_proj", nh * D, H),
                                 ("mlp.gate_proj", H, I), ("mlp.up_proj", H, I),
                                 ("mlp.down_proj", I, H)):
                lin(w, f"{p}.{name}", ii, oo, K)
    return directory


def timed(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg = dict(SMOLLM2, num_hidden_layers=args.layers)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ckpt = write_checkpoint(Path(tmp) / "smollm2-synth", cfg, rng)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        model = load_model(ckpt, dtype=args.dtype, cache_dequantized=True)
        t_load = time.perf_counter() - t0
    gen = Generator(model)
    prompts = [list(rng.integers(3, cfg["vocab_size"], size=args.prompt))
               for _ in range(args.batch)]
    t_pad, out_len = bucket(args.prompt), bucket(args.new)
    tokens, valid = (jnp.asarray(a) for a in left_pad(prompts, t_pad))
    sampling = SamplingParams()
    seed = jnp.int32(0)
    stop = jnp.full((8,), -2, jnp.int32)

    prefill = lambda: _prefill(gen.runner, gen.state, tokens, valid, seed,  # noqa: E731
                               cache_size=t_pad + out_len, sampling=sampling)[0]
    _, prefill_first = timed(prefill)
    prefill_s = statistics.median(timed(prefill)[1] for _ in range(args.repeats))

    run = lambda: _generate(gen.runner, gen.state, tokens, valid, seed,  # noqa: E731
                            jnp.int32(args.new), stop, cache_size=t_pad + out_len,
                            out_len=out_len, sampling=sampling)
    t0 = time.perf_counter()
    lowered = _generate.lower(gen.runner, gen.state, tokens, valid, seed, jnp.int32(args.new),
                              stop, cache_size=t_pad + out_len, out_len=out_len,
                              sampling=sampling)
    t_lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    t_compile = time.perf_counter() - t0
    _, gen_first = timed(run)
    gen_s = statistics.median(timed(run)[1] for _ in range(args.repeats))
    steps = args.new          # the loop runs one model step per emitted token after the first
    decode_s = max(gen_s - prefill_s, 1e-9)

    result = {
        "benchmark": "exl3_jax.generate on a synthetic SmolLM2-135M-geometry EXL3 model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(), "load_average_1_5_15": os.getloadavg(),
        "platform": platform.platform(),
        "python": sys.version.split()[0], "jax": jax.__version__,
        "model": {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "vocab_size")},
        "quant": "K=4 mcg body, K=6 lm_head (random trellis)",
        "weights_path": "dequantized fp32 cache (cache_dequantized=True, CPU reference shortcut)",
        "activation_dtype": args.dtype, "batch": args.batch, "prompt_tokens": args.prompt,
        "prompt_bucket": t_pad, "new_tokens": args.new, "cache_slots": t_pad + out_len,
        "write_checkpoint_s": round(t_write, 2), "load_and_dequantize_s": round(t_load, 2),
        "prefill_first_call_s (compile+run)": round(prefill_first, 3),
        "prefill_s": round(prefill_s, 4),
        "prefill_tokens_per_s": round(args.batch * t_pad / prefill_s, 1),
        "generate_lower_s": round(t_lower, 3), "generate_compile_s": round(t_compile, 3),
        "generate_first_call_s": round(gen_first, 3), "generate_s": round(gen_s, 4),
        "decode_tokens_per_s": round(args.batch * steps / decode_s, 2),
        "decode_ms_per_step": round(1000 * decode_s / steps, 2),
        "command": "python scripts/bench_generate.py " + " ".join(sys.argv[1:]),
        "note": "prefill_tokens_per_s counts the padded bucket; decode = (generate - prefill) / "
                "new_tokens model steps; medians of --repeats runs; 2-core CPU shared with "
                "other jobs (see load_average), so expect noise. XLA:CPU's small-M GEMM is "
                "slower per row than its GEMV, so batch > 1 decode scales sub-linearly.",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
