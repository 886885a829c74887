"""Global-scale search sample: the reference's width-3 tile diagonal vs a width-1 diagonal.

    python scripts/bench_scale_search.py --layers 0,15,29 [--K 4] [--codebook mcg] [--out F.json]

For each linear of the chosen SmolLM2 layers (the default model's unquantized source, from the
exl3-jax cache): the regularised weight W_r (exl3_jax.quant.regularize without a search), then
the global scale g found from each sample with the fast encoder (as the default recipe searches),
the search's wall time, and for linears of <= 1000 tiles the MSE of the whole body encoded at
both scales. Answers whether the cheaper sample (about a third of the search tiles) moves g or
the error enough to matter (bench/NOTES.md, issue #4's build-time levers).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from _gpu_bench_common import run_metadata, versions, write_json
from safetensors.numpy import load_file

from exl3_jax.quant import default_model as dm
from exl3_jax.quant.ldlq import pad_to, padded, random_signs
from exl3_jax.quant.regularize import (regularize, scale_errors, scale_sample_tiles,
                                       search_global_scale, to_tiles)
from exl3_jax.quant.viterbi import encode_tiles

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="0,15,29")
    p.add_argument("--K", type=float, default=4)
    p.add_argument("--codebook", default="mcg")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    K = int(a.K) if a.K == int(a.K) else a.K
    src = dm.source_model()
    state = load_file(str(src / "model.safetensors"))

    def quantize(tiles):
        return encode_tiles(tiles, K, a.codebook, mode="fast")[1]

    rows = []
    for layer in (int(s) for s in a.layers.split(",")):
        for name in LINEARS:
            w = state[f"model.layers.{layer}.{name}.weight"].astype(np.float32).T
            k, n = padded(w.shape[0]), padded(w.shape[1])
            rng = np.random.default_rng(0)
            reg = regularize(pad_to(w, (k, n)), random_signs(rng, k), random_signs(rng, n), None)
            row = {"layer": layer, "linear": name}
            for width in (3, 1):
                t0 = time.perf_counter()
                row[f"g_w{width}"] = search_global_scale(scale_sample_tiles(reg.w_r, width),
                                                         quantize)
                row[f"search_s_w{width}"] = time.perf_counter() - t0
            body = to_tiles(reg.w_r).reshape(-1, 256)
            if body.shape[0] <= 1000:
                mse = scale_errors(body, np.array([row["g_w3"], row["g_w1"]]), quantize)
                row["body_mse_ratio_w1_over_w3"] = float(mse[1] / mse[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    rel = [abs(r["g_w1"] / r["g_w3"] - 1) for r in rows]
    per_layer = len(LINEARS) / len(rows)
    summary = {"linears": len(rows), "max_abs_rel_g": max(rel),
               "search_s_per_layer_w3": sum(r["search_s_w3"] for r in rows) * per_layer,
               "search_s_per_layer_w1": sum(r["search_s_w1"] for r in rows) * per_layer}
    print(json.dumps(summary))
    if a.out:
        write_json(a.out, {**run_metadata(__file__, argv), "versions": versions(), "K": K,
                           "codebook": a.codebook, "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
