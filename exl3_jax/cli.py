"""The ``exl3-jax`` command.

Each subcommand is a function ``cmd_<name>(args)`` registered in ``build_parser``; heavy imports
happen inside the command so ``exl3-jax --help`` stays fast.
"""

from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl3-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="list the EXL3 tensors of a checkpoint")
    p.add_argument("model", help="EXL3 model directory")
    p.set_defaults(func=cmd_inspect)

    return parser


def main(argv: list[str] | None = None) -> int:
    from .format import Exl3FormatError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Exl3FormatError, FileExistsError, NotImplementedError) as e:
        print(f"exl3-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
