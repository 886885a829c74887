"""scripts/gpu_e2e_decode.py (the end-to-end throughput script of issues #5, #6 and #8) on the CPU:
its --tiny models through the single-device and the sharded Generator (two simulated devices:
the tp2 cases issue #8's multi-GPU runs will time), and its scaling summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))


def test_tiny_cases_single_and_sharded(tmp_path):
    out = tmp_path / "e2e.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cases = "moe:1:16,moe:1:16:tp2:experts,moe:1:16:tp2:tensor,dense:2:16:tp2"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_e2e_decode.py"), "--tiny",
                           "--cases", cases, "--new", "4", "--repeats", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {c["case"]: c for c in result["cases"]}
    assert list(rows) == ["moe:b1:p16", "moe:b1:p16:tp2:experts", "moe:b1:p16:tp2:tensor",
                          "dense:b2:p16:tp2:experts"]
    for label, row in rows.items():
        assert "error" not in row, (label, row.get("error"))
        assert row["greedy_tokens_repeat"] and len(row["tokens_row0_head"]) == 4
        assert row["tp"] == (2 if "tp2" in label else 1)
    assert isinstance(result["tp_scaling"], list)


def test_case_parsing_and_scaling_summary():
    from gpu_e2e_decode import parse_cases, tp_scaling
    assert parse_cases("moe:1:512,moe:8:64:tp2,dense:1:512:tp4:tensor") == [
        ("moe", 1, 512, 1, "experts"), ("moe", 8, 64, 2, "experts"),
        ("dense", 1, 512, 4, "tensor")]
    for bad in ("moe:1", "moe:1:512:two", "moe:1:512:tp2:rows", "mamba:1:512"):
        with pytest.raises(SystemExit, match="bad case"):
            parse_cases(bad)
    cases = [dict(case="moe:b1:p512", model="moe", batch=1, tp=1, moe_mode="experts",
                  decode_tokens_per_s=200.0, prefill_tokens_per_s=1000.0),
             dict(case="moe:b1:p512:tp2:experts", model="moe", batch=1, tp=2,
                  moe_mode="experts", decode_tokens_per_s=300.0, prefill_tokens_per_s=1800.0),
             dict(case="moe:b8:p64:tp2:tensor", model="moe", batch=8, tp=2, moe_mode="tensor",
                  decode_tokens_per_s=900.0),                     # no tp=1 row at batch 8
             dict(case="moe:b1:p512:tp4:experts", model="moe", tp=4, moe_mode="experts",
                  error="RuntimeError: tp=4 needs 4 devices")]
    assert tp_scaling(cases) == [dict(case="moe:b1:p512:tp2:experts", tp=2, moe_mode="experts",
                                      decode_speedup=1.5, decode_efficiency=0.75,
                                      prefill_speedup=1.8, prefill_efficiency=0.9)]
