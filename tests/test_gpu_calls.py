"""The queued GPU calls (scripts/gpu_calls/) stay runnable: every script parses as bash, and the
probe patch that `tree_patched` applies on the device still applies to this tree (a call that
fails there costs device time, which is scarce)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CALLS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_calls"


@pytest.mark.parametrize("script", sorted(p.name for p in CALLS.glob("*.sh")))
def test_call_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(CALLS / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("patch", sorted(p.name for p in CALLS.glob("*.patch")))
def test_probe_patches_apply_to_this_tree(patch, tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not found")
    root = CALLS.parents[1]
    for d in ("ffi", "exl3_jax"):
        shutil.copytree(root / d, tmp_path / d)
    proc = subprocess.run(["git", "apply", "--check", str(CALLS / patch)], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
