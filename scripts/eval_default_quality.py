"""Perplexity of the built-in default model (EXL3) and of its unquantized source, on the shipped
public-domain text (exl3_jax/data/kjv_eval.txt), plus optional extra bit rates.

Usage: python scripts/eval_default_quality.py [--bits 3 ...] [--ctx 512] [--dtype float32]
                                              [--out bench/results/quality_default_model.json]

The default model is built on first use (``ensure_default_model``); every ``--bits B`` builds
(once, cached next to it) the same recipe at B bits per weight, timing the build. Writes one JSON
document: date, versions, machine, load average, build seconds, perplexities and their ratio to the
unquantized model, and the issue's target (4.0 bpw within +10%).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from exl3_jax.generate import perplexity
from exl3_jax.models import load_model
from exl3_jax.quant import default_model as dm
from exl3_jax.tokenizer import Tokenizer

TEXT = dm.DATA_DIR / "kjv_eval.txt"


def build_variant(bits: float, root: Path) -> tuple[Path, float | None]:
    """The default recipe at ``bits``: (directory, build seconds or None if it was cached)."""
    out = root / dm.model_dir_name(bits)
    cached = out.exists() and dm.check_manifest(out) is None
    t0 = time.perf_counter()
    out = dm.ensure_default_model(root, bits=bits)
    return out, None if cached else time.perf_counter() - t0


def model_ppl(directory: Path, ids, ctx: int, dtype: str) -> dict:
    t0 = time.perf_counter()
    model = load_model(directory, dtype=dtype, cache_dequantized=True)
    ppl, n = perplexity(model, ids, ctx=ctx)
    return {"dir": directory.name, "ppl": round(float(ppl), 4), "tokens": int(n),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=float, nargs="*", default=[], help="extra bit rates to build")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="bench/results/quality_default_model.json")
    a = ap.parse_args()

    load_start = os.getloadavg()
    root = dm.cache_root()
    source = dm.source_model(root)
    ids = Tokenizer.from_dir(source).encode(TEXT.read_text(encoding="utf-8"))

    rows = {"unquantized": model_ppl(source, ids, a.ctx, a.dtype)}
    for bits in [dm.BITS, *a.bits]:
        directory, seconds = build_variant(bits, root)
        rows[f"{bits:g}bpw"] = model_ppl(directory, ids, a.ctx, a.dtype)
        rows[f"{bits:g}bpw"]["build_seconds"] = None if seconds is None else round(seconds, 1)
    base = rows["unquantized"]["ppl"]
    for row in rows.values():
        row["ratio_to_unquantized"] = round(row["ppl"] / base, 4)
    for name, row in rows.items():
        print(f"{name:>12}: ppl {row['ppl']:.4f} (x{row['ratio_to_unquantized']:.4f})", flush=True)

    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python scripts/eval_default_quality.py " + " ".join(
               [f"--bits {b:g}" for b in a.bits] + [f"--ctx {a.ctx}", f"--dtype {a.dtype}"]),
           "text": TEXT.name, "text_tokens": len(ids), "ctx": a.ctx, "dtype": a.dtype,
           "recipe": {"bits": dm.BITS, "head_bits": dm.HEAD_BITS, "codebook": dm.CODEBOOK,
                      "mode": dm.MODE, "calibration": "exl3_jax/data/calibration.txt",
                      "calibration_seq_len": dm.CALIBRATION_SEQ_LEN},
           "target": "4.0 bpw perplexity within +10% of the unquantized model",
           "target_met": rows[f"{dm.BITS:g}bpw"]["ratio_to_unquantized"] <= 1.10,
           "backend": jax.default_backend(), "cpus": os.cpu_count(),
           "machine": platform.machine(), "python": platform.python_version(),
           "jax": jax.__version__, "numpy": np.__version__,
           "loadavg_start": [round(x, 2) for x in load_start],
           "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "results": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
