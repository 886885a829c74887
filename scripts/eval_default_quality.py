"""Perplexity of the built-in default model (EXL3) and of its unquantized source, on the shipped
public-domain text (exl3_jax/data/kjv_eval.txt), plus optional extra bit rates.

Usage: python scripts/eval_default_quality.py [--variant BITS[:MODE[:CALIBRATION]] ...]
                                              [--ctx 512] [--dtype float32]
                                              [--out bench/results/quality_default_model.json]

The default model is built on first use (``ensure_default_model``); every ``--variant`` builds
(once, cached next to it) the recipe with another bit rate, encoder mode ("exact"/"fast") or
calibration set ("hand"/"self"), timing the build. Writes one JSON document: date, versions,
machine, load average, build seconds, perplexities and their ratio to the unquantized model, and
the issue's target (the default 4.0 bpw recipe within +10%).
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
from exl3_jax.quant.convert import RichProgress
from exl3_jax.quant.viterbi import default_backend as default_encoder_backend
from exl3_jax.tokenizer import Tokenizer

TEXT = dm.DATA_DIR / "kjv_eval.txt"
DEFAULT_VARIANT = (float(dm.BITS), dm.MODE, dm.CALIBRATION)


def parse_variant(text: str) -> tuple[float, str, str]:
    """'3', '4:exact' or '4:fast:hand' -> (bits, mode, calibration), defaults from the recipe."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}; use BITS[:MODE[:CALIBRATION]]")
    bits = float(parts[0])
    mode = parts[1] if len(parts) > 1 else dm.MODE
    calibration = parts[2] if len(parts) > 2 else dm.CALIBRATION
    if calibration not in dm.CALIBRATION_SETS:
        raise argparse.ArgumentTypeError(f"unknown calibration set {calibration!r}")
    return bits, mode, calibration


def variant_name(variant: tuple[float, str, str]) -> str:
    """Row name of a recipe variant: its cache directory name without the model prefix."""
    return dm.model_dir_name(*variant).removeprefix("SmolLM2-135M-Instruct-exl3-")


def build_variant(variant: tuple[float, str, str], root: Path) -> tuple[Path, float | None]:
    """A recipe variant: (directory, build seconds or None if it was cached)."""
    bits, mode, calibration = variant
    out = root / dm.model_dir_name(bits, mode, calibration)
    cached = out.exists() and dm.check_manifest(out) is None
    t0 = time.perf_counter()
    out = dm.ensure_default_model(root, bits=bits, mode=mode, calibration=calibration,
                                  progress=RichProgress())
    return out, None if cached else time.perf_counter() - t0


def model_ppl(directory: Path, ids, ctx: int, dtype: str) -> dict:
    t0 = time.perf_counter()
    model = load_model(directory, dtype=dtype, cache_dequantized=True)
    ppl, n = perplexity(model, ids, ctx=ctx)
    return {"dir": directory.name, "ppl": round(float(ppl), 4), "tokens": int(n),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="extra recipe variant BITS[:MODE[:CALIBRATION]], e.g. 3 or 4:exact:hand")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="bench/results/quality_default_model.json")
    a = ap.parse_args()

    load_start = os.getloadavg()
    root = dm.cache_root()
    source = dm.source_model(root)
    ids = Tokenizer.from_dir(source).encode(TEXT.read_text(encoding="utf-8"))

    rows = {"unquantized": model_ppl(source, ids, a.ctx, a.dtype)}
    rows["unquantized"]["ratio_to_unquantized"] = 1.0
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for variant in dict.fromkeys([DEFAULT_VARIANT, *a.variant]):     # in order, without repeats
        name = variant_name(variant)
        directory, seconds = build_variant(variant, root)
        rows[name] = model_ppl(directory, ids, a.ctx, a.dtype)
        rows[name]["build_seconds"] = None if seconds is None else round(seconds, 1)
        rows[name]["ratio_to_unquantized"] = round(rows[name]["ppl"] / rows["unquantized"]["ppl"],
                                                   4)
        print(f"{name:>32}: ppl {rows[name]['ppl']:.4f} (x{rows[name]['ratio_to_unquantized']:.4f})"
              f", build {rows[name]['build_seconds']} s", flush=True)
        # rewritten after every variant, so a run cut short keeps what it measured
        out_path.write_text(json.dumps(document(a, ids, rows, load_start), indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


def document(a, ids, rows: dict, load_start) -> dict:
    default = rows.get(variant_name(DEFAULT_VARIANT))
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python scripts/eval_default_quality.py " + " ".join(
               [f"--variant {b:g}:{m}:{c}" for b, m, c in a.variant]
               + [f"--ctx {a.ctx}", f"--dtype {a.dtype}"]),
           "text": TEXT.name, "text_tokens": len(ids), "ctx": a.ctx, "dtype": a.dtype,
           "recipe": {"bits": dm.BITS, "head_bits": dm.HEAD_BITS, "codebook": dm.CODEBOOK,
                      "mode": dm.MODE, "calibration": dm.CALIBRATION,
                      "calibration_files": {k: list(v) for k, v in dm.CALIBRATION_SETS.items()},
                      "calibration_seq_len": dm.CALIBRATION_SEQ_LEN,
                      "hessian_scales": dm.HESSIAN_SCALES, "revision": dm.RECIPE_REVISION,
                      "encoder_backend": default_encoder_backend()},
           "target": "4.0 bpw perplexity within +10% of the unquantized model",
           "target_met": None if default is None else default["ratio_to_unquantized"] <= 1.10,
           "backend": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
           "machine": platform.machine(), "python": platform.python_version(),
           "jax": jax.__version__, "numpy": np.__version__,
           "loadavg_start": [round(x, 2) for x in load_start],
           "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "results": rows}


if __name__ == "__main__":
    raise SystemExit(main())
