"""scripts/ncu_source_summary.py on a synthetic ncu source page (random samples per SASS line):
the per-line, per-opcode and per-reason sums against NumPy's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

SASS = ["LDG.E.128 R4, desc[UR4][R2.64]", "@P0 IMAD R5, R4, 0x3, RZ", "LOP3.LUT R6, R5, 0xf, RZ, 0xc0, !PT",
        "HMMA.16816.F32 R8, R4, R6, R8", "@!P1 BRA 0x100", "IMAD.WIDE.U32 R2, R3, 0x4, R2"]


def test_stall_summary_matches_numpy():
    from ncu_source_summary import read_source_page, stall_summary
    rng = np.random.default_rng()
    n = 40
    ops = rng.integers(0, len(SASS), n)
    all_s = rng.integers(0, 1000, n)
    not_issued = rng.integers(0, 1000, n) % (all_s + 1)
    long_sb = rng.integers(0, 500, n)
    rows = ['"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Warp Stall Sampling (Not-issued Samples)","stall_long_sb"']
    rows += [f'"0x{16 * i:x}","{SASS[o]}","{a:,}","{b}","{c}"'
             for i, (o, a, b, c) in enumerate(zip(ops, all_s, not_issued, long_sb))]
    text = "==PROF== Connected to process 1\n" + "\n".join(rows) + "\n"
    s = stall_summary(read_source_page(text))
    assert s["total"] == all_s.sum()
    i, top, ni, sass = s["lines"][0]
    assert top == all_s.max() and ni == not_issued[i] and sass == SASS[ops[i]]
    names = [SASS[o].lstrip("@!P01 ").split()[0].split(".")[0] for o in ops]
    for op in set(names):
        sel = np.array([nm == op for nm in names])
        assert s["by_opcode"][op] == [sel.sum(), all_s[sel].sum()]
    assert s["reasons"] == {"stall_long_sb": long_sb.sum()}


def test_page_without_a_header_is_refused():
    from ncu_source_summary import read_source_page
    with pytest.raises(ValueError, match="no CSV header"):
        read_source_page("==PROF== nothing profiled\n")
