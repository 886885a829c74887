"""The ``exl3-jax`` command.

Each subcommand is a function ``cmd_<name>(args)`` registered in ``build_parser``; heavy imports
happen inside the command so ``exl3-jax --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys


def cmd_inspect(args: argparse.Namespace) -> int:
    """Per-tensor table (K, codebook, shape, bytes) and totals of an EXL3 checkpoint."""
    from rich.console import Console
    from rich.table import Table

    from .format import Exl3Checkpoint

    ckpt = Exl3Checkpoint(args.model)
    console = Console()
    table = Table(title=f"EXL3 linears in {ckpt.directory}")
    for col in ("module", "K", "codebook", "k x n", "bytes"):
        table.add_column(col, justify="right" if col in ("K", "bytes") else "left")
    for info in ckpt.iter_linears():
        nbytes = sum(ckpt.store.nbytes(t) for t in info.tensors)
        table.add_row(info.key, f"{info.K:g}", info.codebook, f"{info.k} x {info.n}",
                      f"{nbytes:,}")
    console.print(table)
    for key, emb in ckpt.embeddings.items():
        console.print(f"quantized embedding {key}: K={emb.K}, {emb.rows} rows, {emb.groups} rings")
    if ckpt.ngram_file is not None:
        console.print(f"n-gram table {ckpt.ngram_file.name}: present (not supported yet)")
    s = ckpt.summary()
    qc = ckpt.quantization_config
    console.print(
        f"{s['linears']} EXL3 linears, {s['weights']:,} weights, {s['linear_bytes']:,} bytes "
        f"-> {s['bpw']:.3f} bits per weight (incl. suh/svh); {len(ckpt.plain)} plain tensors; "
        f"checkpoint {s['total_bytes'] / 2**20:.1f} MiB; config bits={qc.get('bits')} "
        f"head_bits={qc.get('head_bits')}")
    return 0


def _sampling(args: argparse.Namespace):
    from .generate import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the model's answer to a prompt (chat template applied when the model has one)."""
    from .generate import Generator
    from .tokenizer import StreamDecoder, Tokenizer

    sampling = _sampling(args)
    if args.model is None:
        args.model = str(_default_model())
    _require_dir(args.model)
    tok = Tokenizer.from_dir(args.model)
    model = _load(args)
    if tok.chat_template and not args.raw:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                         add_bos=False)
    else:
        ids = tok.encode(args.prompt)
    stop = set(model.config.eos_token_ids)
    if tok.eos_token_id is not None:
        stop.add(tok.eos_token_id)
    stream = StreamDecoder(tok)
    mesh = None
    if args.tp > 1:
        from .parallel import make_mesh
        mesh = make_mesh(args.tp)
    generator = Generator(model, mesh=mesh, moe_mode=args.moe_mode)
    for t in generator.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                              seed=args.seed, stop_tokens=sorted(stop)):
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    return 0


def _default_model():
    """The built-in SmolLM2 EXL3 model, built on first use with progress on stderr."""
    from rich.console import Console

    from .quant.convert import RichProgress
    from .quant.default_model import ensure_default_model

    console = Console(stderr=True)
    return ensure_default_model(progress=RichProgress(), log=console.log)


def cmd_ppl(args: argparse.Namespace) -> int:
    """Perplexity of a text file, in non-overlapping windows of --ctx tokens."""
    from .generate import perplexity
    from .tokenizer import Tokenizer

    _require_dir(args.model)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ids = Tokenizer.from_dir(args.model).encode(text)
    model = _load(args)
    ppl, n = perplexity(model, ids, ctx=args.ctx, max_windows=args.max_windows)
    print(f"perplexity {ppl:.4f} over {n} predicted tokens (ctx {args.ctx})")
    return 0


def _require_dir(path: str) -> None:
    """A model argument names a directory; say so before any file inside it is looked for."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path} does not exist" if not
                                os.path.exists(path) else f"{path} is not a directory")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="activation dtype (default bfloat16)")
    p.add_argument("--cache-dequantized", action=argparse.BooleanOptionalAction, default=None,
                   help="decode EXL3 weights once at load into fp32 (much faster without GPU "
                        "kernels, 4 bytes per weight); default: on when the op backend is the "
                        "jax.numpy reference")


def _load(args: argparse.Namespace):
    from .models import load_model
    from .ops import resolve_backend

    cache = args.cache_dequantized
    if cache is None:
        # tensor parallelism shards the EXL3 tensors themselves and ignores dequantized caches
        cache = resolve_backend() == "reference" and getattr(args, "tp", 1) == 1
    return load_model(args.model, dtype=args.dtype, cache_dequantized=cache)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize an HF safetensors model directory to an EXL3 checkpoint (no calibration yet)."""
    from rich.console import Console

    from .quant.convert import RichProgress, convert_hf

    _require_dir(args.source)
    console = Console(stderr=True)
    bits = int(args.bits) if args.bits == int(args.bits) else args.bits
    head_bits = int(args.head_bits) if args.head_bits == int(args.head_bits) else args.head_bits
    reports = convert_hf(args.source, args.output, bits=bits, head_bits=head_bits,
                         codebook=args.codebook, mode="fast" if args.fast else "exact",
                         seed=args.seed, out_scales=args.out_scales, overwrite=args.overwrite,
                         progress=RichProgress(), log=console.log if args.verbose else None)
    worst = max(reports, key=lambda r: r.info.proxy_error, default=None)
    console.print(f"wrote {args.output}: {len(reports)} EXL3 linears"
                  + (f", worst proxy error {worst.info.proxy_error:.5f} ({worst.key})"
                     if worst else ""))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a GPU benchmark; its own options follow the benchmark name."""
    from .ffi import bench
    return bench.main([args.what, *args.rest]) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl3-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="list the EXL3 tensors of a checkpoint")
    p.add_argument("model", help="EXL3 model directory")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("quantize", help="quantize an HF safetensors model to EXL3")
    p.add_argument("source", help="HF model directory (config.json + *.safetensors)")
    p.add_argument("output", help="EXL3 directory to write (atomically)")
    p.add_argument("--bits", type=float, required=True,
                   help="bits per weight of every body linear: 1..8 (1.5/2.5/3.5 with mul1)")
    p.add_argument("--head-bits", type=float, default=6,
                   help="bits per weight of lm_head (16 = keep fp16; default 6)")
    p.add_argument("--codebook", choices=("mcg", "mul1", "3inst"), default="mcg")
    p.add_argument("--fast", action="store_true",
                   help="faster approximate trellis search (tile MSE within ~1.3x of exact)")
    p.add_argument("--out-scales", choices=("always", "never", "auto"), default="always")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sign flips")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("-v", "--verbose", action="store_true", help="log every linear's error")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("generate", help="generate text from a prompt (streams the answer)")
    p.add_argument("--model", default=None,
                   help="EXL3 (or HF safetensors) model directory; default: the built-in "
                        "SmolLM2-135M-Instruct at 4 bpw, built and cached on first use")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (chat models)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree over the local devices (shard_map); default 1")
    p.add_argument("--moe-mode", choices=("experts", "tensor"), default="experts",
                   help="with --tp > 1: split MoE layers by expert ranges or split each expert")
    _model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("ppl", help="perplexity of a text file")
    p.add_argument("model", help="EXL3 (or HF safetensors) model directory")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens")
    p.add_argument("--max-windows", type=int, default=None)
    _model_args(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("bench", help="GPU benchmarks (CUDA device required)")
    p.add_argument("what", choices=["linear", "moe"],
                   help="linear: the Trellis GEMM vs bf16; moe: the Trellis MoE vs ragged_dot")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (--help)")
    p.set_defaults(func=cmd_bench)

    return parser


def main(argv: list[str] | None = None) -> int:
    from .format import Exl3FormatError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Exl3FormatError, OSError, NotImplementedError, ValueError) as e:
        print(f"exl3-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
