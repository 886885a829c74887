"""Where the default model's build time goes, per layer: cProfile of the same recipe on the first
N layers of SmolLM2 (no head), grouped into calibration, global-scale search and LDLQ encode.

    python scripts/profile_default_build.py [--layers 2] [--out F.json]

Uses the unquantized source in the exl3-jax cache (built on first use, as ``exl3-jax generate``
does). The slice keeps the embeddings, the first N decoder layers and the final norm; the head is
left unquantized (head_bits 16) so the numbers are the body's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import tempfile
import time
from pathlib import Path

from _gpu_bench_common import run_metadata, versions, write_json
from safetensors.numpy import load_file, save_file

from exl3_jax.quant import default_model as dm
from exl3_jax.quant.calibrate import load_calibration
from exl3_jax.quant.convert import convert_hf

# (label, file suffix, function name or names) of the functions whose cumulative time is reported.
# The calibration layer runs are jitted and dispatched asynchronously, so their compute time
# lands in input_hessian_matmuls (which waits for the recorded inputs), not in _run_layer.
PARTS = (("convert_hf", "quant/convert.py", "convert_hf"),
         ("ldlq_body_encode", "quant/ldlq.py", "ldlq"),
         ("global_scale_search", "quant/regularize.py",
          ("search_global_scale", "search_global_scale_fast")),
         ("hessian_capture", "quant/calibrate.py", "hessian"),
         ("calibration_layer_runs", "quant/calibrate.py", "_run_layer"),
         ("input_hessian_matmuls", "quant/calibrate.py", "input_hessian"),
         ("finalize_hessian", "quant/ldlq.py", "finalize_hessian"),
         ("rotate_hessian", "quant/ldlq.py", "rotate_hessian"),
         ("regularize", "quant/regularize.py", "regularize"),
         ("proxy_error", "quant/ldlq.py", "proxy_error"),
         ("encode_tiles_all", "quant/viterbi.py", "encode_tiles"))
TOP = 25          # functions listed by their own (exclusive) time


def sliced_source(src: Path, layers: int, out: Path) -> None:
    """The first ``layers`` decoder layers of an HF-layout directory (config, tokenizer files,
    embeddings, final norm)."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in state.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers},
              str(out / "model.safetensors"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    src = dm.source_model()
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "src", Path(tmp) / "out"
        source.mkdir()
        sliced_source(src, a.layers, source)
        hessians = load_calibration(source, dm.calibration_text(dm.CALIBRATION),
                                    seq_len=dm.CALIBRATION_SEQ_LEN)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        convert_hf(source, out, bits=dm.BITS, head_bits=16, codebook=dm.CODEBOOK, mode=dm.MODE,
                   hessians=hessians, hessian_scales=dm.HESSIAN_SCALES)
        prof.disable()
        wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats          # {(file, line, name): (cc, nc, tt, ct, callers)}
    parts = {}
    for label, suffix, names in PARTS:
        names = (names,) if isinstance(names, str) else names
        hits = [(v[1], v[3]) for (f, _, fn), v in stats.items()
                if fn in names and f.endswith(suffix)]
        parts[label] = {"calls": sum(h[0] for h in hits), "cumulative_s": sum(h[1] for h in hits)}
    by_self = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP]
    top_self = [{"function": f"{Path(f).name}:{line}:{fn}", "calls": v[1],
                 "self_s": round(v[2], 2), "cumulative_s": round(v[3], 2)}
                for (f, line, fn), v in by_self]
    result = {**run_metadata(__file__, argv), "versions": versions(), "layers": a.layers,
              "wall_s": wall,
              "recipe": {"bits": dm.BITS, "codebook": dm.CODEBOOK, "mode": dm.MODE,
                         "calibration": dm.CALIBRATION, "hessian_scales": dm.HESSIAN_SCALES,
                         "revision": dm.RECIPE_REVISION, "head": "not quantized"},
              "parts": parts, "top_self_time": top_self}
    print(json.dumps(result, indent=1))
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
