"""The H200 validation scripts themselves (scripts/gpu_validate.py, gpu_validate_moe.py) on the GPU
kernels' own PTX run on the CPU (EXL3_JAX_EMULATE=1, ffi/emulate.py) at small shapes.

What this proves without a GPU: every plan's kernels (decode, row linear, groups, prefill
dequantize, the tiles and wgmma token-tile kernels with their weight-ring and fused-epilogue
options, the Hadamard kernels, the MoE layer's launches) decode bit-exactly, compute within the
issues' bounds, write every output element, stay inside their buffers, and keep the
synchronisation rules the interpreter checks (shared-memory races, wgmma and cp.async ordering).
What it cannot prove: speed, and the hardware's reading of the ISA where it differs from the
interpreter's."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest
from helpers_cute import HAVE_CUTLASS, ROOT, emulated_env

pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def validation_reports(tmp_path_factory):
    """Both validation scripts on the emulated kernels, started together (one core each:
    the interpreter is single-threaded NumPy) with a fresh seed for the MoE weights."""
    if not HAVE_CUTLASS:
        pytest.skip("nvidia-cutlass-dsl not installed")
    d = tmp_path_factory.mktemp("emulated")
    seed = secrets.randbits(31)
    print(f"MoE validation seed: {seed}")
    argvs = {
        "dense": ["gpu_validate.py", "--quick", "--no-bench", "--group", "--budget-s", "3000",
                  "--sections", "decode_exact,gemm,group,row_linear,row_scale,dispatch",
                  "--k", "256", "--n", "512", "--m", "1,3,8,16,32,33,128",
                  "--row-shapes", "256x256,512x384:256+128", "--out", str(d / "dense.json")],
        "moe": ["gpu_validate_moe.py", "--quick", "--no-bench", "--budget-s", "3000",
                "--seed", str(seed), "--sections",
                "overflow,decode_bitwise,edge,tiers,dispatch,accuracy",
                "--out", str(d / "moe.json")]}
    procs = {k: subprocess.Popen([sys.executable, *a], env=emulated_env(), cwd=ROOT / "scripts",
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, a in argvs.items()}
    out = {}
    for k, p in procs.items():
        _, err = p.communicate(timeout=1800)
        out[k] = (p.returncode, err, d / f"{k}.json")
    return out


def _report(reports, name):
    rc, err, path = reports[name]
    assert path.exists(), err[-4000:]
    return rc, err, json.loads(path.read_text())


def test_gpu_validation_passes_on_the_emulated_kernels(validation_reports):
    rc, err, report = _report(validation_reports, "dense")
    assert rc == 0, err[-4000:]
    sections = report["sections"]
    assert not [name for name, s in sections.items() if "error" in s]
    exact = sections["decode_exact"]["result"]
    assert len(exact) == 8
    for row in exact:      # dequantize, decode (32 rows and m = 1), tiles, wgmma
        assert row["dequant_bit_exact"] and row["mma_bit_exact"], row
        # the prefill weight (rotations folded in): fp16 rounding only, emulated ~5e-4
        assert row["dequant_rotated_ok"] and 1e-5 < row["dequant_rotated_rel"] <= 8e-4, row
        assert row["token_tiles_bit_exact"] and row["wgmma_mismatches"] == 0, row
    gemm = sections["gemm"]["result"]
    kinds = {r["plan"] for r in gemm}
    assert {"decode", "decode_ring", "prefill", "tiles", "wgmma",
            "wgmma_tight", "wgmma_fused"} <= kinds, kinds
    assert [r for r in gemm if not r["ok"]] == []
    for name in ("group", "row_linear", "dispatch", "row_scale"):
        rows = sections[name]["result"]
        assert rows and all(r["ok"] for r in rows), (name, rows)


def test_moe_validation_passes_on_the_emulated_kernels(validation_reports):
    """The MoE layer's custom call (rotate-in, FC1, activation, FC2, combine) under
    gpu_validate_moe.py's checks, on fresh random weights: the three plans, fused and unfused glue,
    fp16-overflowing tokens, each decode token equal to its own m = 1 result bitwise, no and all
    experts hit, K3/K4 tiers in one launch (the Qwen3-size geometry section is left to the
    GPU: ~5 minutes here)."""
    rc, err, report = _report(validation_reports, "moe")
    sections = {k: v for k, v in report["sections"].items() if isinstance(v, dict)}
    assert set(sections) == {"overflow", "decode_bitwise", "edge", "tiers", "dispatch",
                             "accuracy"}
    assert {k: v.get("ok") for k, v in sections.items()} == dict.fromkeys(sections, True), \
        {k: str(v)[:800] for k, v in sections.items() if not v.get("ok")}
    assert report["ok"] and not report["skipped"] and rc == 0, err[-4000:]
    # The wgmma plan (the emulated arch is sm_90a: auto at 300 tokens, forced at 40) ran with
    # 32- and 128-row blocks, and the mma.sync prefill plan with 64-row blocks (forced).
    rows = sections["accuracy"]["rows"]
    assert {r["block_m"] for r in rows if r.get("plan") == "wgmma"} == {32, 128}, rows
    assert 64 in {r["block_m"] for r in rows if r.get("plan") == "prefill"}, rows
    # Mixed-bitrate layers, two and three tiers: auto at 100 tokens on the wgmma plan (one
    # launch per tier), and the mma.sync prefill plan forced there
    tiers = sections["tiers"]
    for plan in ("wgmma", "prefill"):
        assert all([r["T"] for r in tiers[k]["rows"] if r.get("plan") == plan] == [100]
                   for k in ("k3_k4_mcg", "three_codebooks")), tiers
    assert sections["edge"]["all_experts_hit_wgmma"]["ok"]
