"""Summarise an Nsight Compute source page (SASS) by where the warps stall (tuning aid).

  ncu ... --section SourceCounters -o rep python3 scripts/gpu_probe_linear.py run ...
  ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
  python scripts/ncu_source_summary.py rep_sass.csv [--top 40]

Prints the SASS lines with the most warp-stall samples, the samples summed by opcode, and the
per-reason sample columns summed over the kernel where the page has them. Column names differ
between ncu versions, so they are matched by substring ("Sampling", "Source", "Address").
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def _column(header: list[str], *needles: str) -> str | None:
    for name in header:
        if all(n.lower() in name.lower() for n in needles):
            return name
    return None


def read_source_page(text: str) -> list[dict]:
    """The rows of an ncu ``--page source --csv`` export (ncu's own ==PROF== lines and any title
    before the CSV header are skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if '"Address"' in line or '"Source"' in line), None)
    if start is None:
        raise ValueError("no CSV header with an Address or Source column")
    return list(csv.DictReader(lines[start:]))


def _opcode(sass: str) -> str:
    parts = sass.split()
    if parts and parts[0].startswith("@"):  # predicated: the opcode is the next token
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else "?"


def stall_summary(rows: list[dict]) -> dict:
    """Warp-stall samples of a source page: the sampling column's name, the total, per line
    (index, samples, not-issued samples, SASS), per opcode (lines, samples) and per stall-reason
    column (samples summed over the kernel)."""
    header = list(rows[0].keys()) if rows else []
    source = _column(header, "source")
    samples = _column(header, "sampling", "all") or _column(header, "sampling")
    not_issued = _column(header, "sampling", "not")
    if source is None or samples is None:
        raise ValueError(f"columns {header[:12]} lack Source or a warp-stall sampling column")
    lines = [(i, _number(r[samples]), _number(r[not_issued]) if not_issued else 0.0,
              r[source].strip()) for i, r in enumerate(rows)]
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for _, s, _, sass in lines:
        by_op[_opcode(sass)][0] += 1
        by_op[_opcode(sass)][1] += s
    reasons = [c for c in header if c not in (samples, not_issued) and "stall" in c.lower()]
    return {"column": samples, "total": sum(s for _, s, _, _ in lines),
            "lines": sorted(lines, key=lambda t: -t[1]),
            "by_opcode": dict(by_op),
            "reasons": {c: sum(_number(r[c]) for r in rows) for c in reasons}}


def summarise(path: str, top: int) -> int:
    with open(path, newline="") as f:
        summary = stall_summary(read_source_page(f.read()))
    total = summary["total"] or 1.0
    print(f"{len(summary['lines'])} SASS lines, {total:.0f} samples ({summary['column']!r})")
    print(f"top {top} lines: index, % of samples, not-issued %, SASS")
    for i, s, ni, sass in summary["lines"][:top]:
        print(f"{i:5d} {100 * s / total:6.2f} {100 * ni / total:6.2f}  {sass[:90]}")
    print("by opcode: lines, % of samples")
    for op, (count, s) in sorted(summary["by_opcode"].items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"  {op:10s} {count:5d} {100 * s / total:6.2f}")
    if summary["reasons"]:
        print("stall reasons summed over the kernel (% of samples)")
        for c, s in sorted(summary["reasons"].items(), key=lambda kv: -kv[1])[:16]:
            print(f"  {100 * s / total:6.2f}  {c}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    return summarise(a.csv, a.top)


if __name__ == "__main__":
    sys.exit(main())
