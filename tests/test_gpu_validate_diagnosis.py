"""scripts/gpu_validate.py's layout diagnosis of a mismatching one-hot decode (run on the H200):
on permuted and corrupted copies of a random matrix, it names the permutation's offsets, or
finds no line where the values themselves are wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_layout_diagnosis(rng):
    from gpu_validate import layout_diagnosis
    want = rng.standard_normal((64, 32)).astype(np.float32)
    rows = layout_diagnosis(want[np.arange(64) ^ 8], want)          # 8-row blocks swapped
    assert rows["rows_found"] == "64/64" and rows["cols_found"] == "0/32"
    assert sorted(rows["rows_offsets"]) == [(-8, 32), (8, 32)]
    cols = layout_diagnosis(want[:, np.roll(np.arange(32), 4)], want)
    assert cols["cols_found"] == "32/32" and dict(cols["cols_offsets"]) == {-4: 28, 28: 4}
    bad = want.copy()
    bad[:, 5] += 1.0                                                # values wrong in one column
    assert layout_diagnosis(bad, want) == {"rows_found": "0/64", "rows_offsets": [],
                                           "cols_found": "31/32", "cols_offsets": [(0, 31)]}
