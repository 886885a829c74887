"""The committed measurements stay readable and the repository stays small: every JSON under
bench/results (plain or xz-compressed) parses, and the tracked files stay under the size budget
the developers' guide sets (well under 6 MB; the whole tree travels to the GPU machine)."""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TRACKED_BUDGET_BYTES = 5_000_000
COMPRESS_FROM_BYTES = 20_000      # bench/results/README.md: larger JSON files are kept as .xz


def _results_files():
    return sorted(p for p in RESULTS.rglob("*") if p.name.endswith((".json", ".json.xz")))


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_file_parses(path):
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:     # JSON lines (one record per run, e.g. cpu_decode_reference)
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert data, f"{path} holds no measurements"
    if path.suffix == ".json":
        assert path.stat().st_size < COMPRESS_FROM_BYTES, (
            f"{path.relative_to(ROOT)} is {path.stat().st_size} bytes: keep it as "
            f"{path.name}.xz (bench/results/README.md)")


def test_tracked_files_within_budget():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    sizes = {n.decode(): (ROOT / n.decode()).stat().st_size for n in names
             if n and (ROOT / n.decode()).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < TRACKED_BUDGET_BYTES, (
        f"tracked files take {total} bytes (budget {TRACKED_BUDGET_BYTES}); largest: {largest}")
