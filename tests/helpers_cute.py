"""Compile-only CuTe DSL checks shared by the kernel tests (no GPU needed).

CuTe DSL reads CUTE_DSL_ARCH once per process, so every build runs in a child process with the
arch set before cutlass is imported and JAX on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAVE_CUTLASS, reason="nvidia-cutlass-dsl not installed")

EXPECTED_SM = {"sm_90a": 90, "sm_120a": 120}


def emulated_env(arch: str = "sm_90a") -> dict:
    """The environment of a child process whose CuTe custom calls run on the CPU through the
    PTX interpreter (EXL3_JAX_EMULATE=1, ffi/emulate.py) for ``arch``."""
    return dict(os.environ, EXL3_JAX_EMULATE="1", CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")


def _child(argv, arch: str, timeout: int, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_rows(module: str, cases, arch: str, timeout: int = 600,
               env: dict | None = None) -> list[dict]:
    """Run ``python -m module --check cases`` (the compile-only export check of
    exl3_jax.ffi.aot.check_main) for ``arch`` (``env``: more environment, e.g. CUTE_DSL_KEEP
    to keep the cubins); assert one row per case, each ok with cubins for that arch's SM and no
    other. Returns the rows (dicts) for further checks."""
    proc = _child(["-m", module, "--check", json.dumps(cases)], arch, timeout, env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), proc.stderr[-3000:]
    other = {v for k, v in EXPECTED_SM.items() if k != arch}
    for row in rows:
        assert row["ok"], row
        assert EXPECTED_SM[arch] in row["sms"] and not other & set(row["sms"]), row
    return rows


def last_line_of_script(code: str, arch: str = "sm_90a", timeout: int = 600,
                        env: dict | None = None) -> str:
    """Run ``python -c code`` for ``arch`` (``env``: more environment); its last line of
    stdout."""
    return _child(["-c", code], arch, timeout, env).stdout.split("\n")[-2]
