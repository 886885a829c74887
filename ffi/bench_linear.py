"""`exl3-jax bench linear`: the Trellis GEMM vs bf16 over the issue's grid, in parts if needed.

  exl3-jax bench linear [--shapes 4096x4096,...] [--K 2,3,4] [--codebooks mcg,mul1]
      [--m 1,4,16,32,128,1024,4096] [--part 2/3] [--budget-s 240] [--out FILE] [--resume]
  exl3-jax bench linear --merge part1.json part2.json ... --out all.json
(also ``python -m exl3_jax.ffi.bench linear ...`` and scripts/gpu_bench_linear.py)

Timing, columns and floors: exl3_jax.ffi.bench (``bench``: microseconds per call inside a jitted
loop, effective GB/s on the compressed bytes, speedup over a bf16 jnp.dot timed the same way in
the same run, fraction of the decode floor; ``wall_s`` per row = compile + warm-up + timing).

The full grid (5 shapes x K 2..4 x mcg/mul1 x 7 m = 210 rows) costs more than one GPU call:
compiling the CuTe kernels and the timing loop dominates (about 2.5 s per row on the H200,
bench/NOTES.md). ``--part i/n`` runs the i-th of n contiguous slices of the (shape, K,
codebook) groups; the bf16 baseline is measured for each shape a part touches. The JSON is
rewritten after every row (a killed run keeps what it measured); ``--resume`` skips the rows
already in --out, ``--merge`` joins part files into one result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_part(spec: str | None) -> tuple[int, int]:
    """'i/n' -> (i, n) with 1 <= i <= n; None -> (1, 1)."""
    if not spec:
        return 1, 1
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ValueError(f"--part must look like 2/3, got {spec!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--part {spec}: need 1 <= i <= n")
    return i, n


def grid_groups(shapes, Ks, codebooks) -> list[tuple]:
    """(k, n, K, codebook) groups in bench order (shape-major)."""
    return [(k, n, K, cb) for (k, n) in shapes for K in Ks for cb in codebooks]


def part_groups(groups: list, part: tuple[int, int]) -> list:
    """The i-th of n contiguous, near-equal slices (contiguous: few shapes per part, so few
    bf16 baselines)."""
    i, n = part
    return [g for j, g in enumerate(groups) if j * n // len(groups) == i - 1]


def row_key(row: dict) -> tuple:
    return (row["k"], row["n"], row["K"], row["codebook"], row["m"])


def load_rows(path: str) -> list[dict]:
    """Successful rows of an earlier result file (none if it does not exist)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in json.load(f).get("rows", []) if not r.get("error")]


def merge(paths: list[str]) -> dict:
    """One result from part files: rows keyed by (k, n, K, codebook, m), later files win,
    rows without an error preferred; the versions of every part are kept."""
    rows, versions = {}, []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        versions.append(dict(res.get("versions", {}), file=os.path.basename(path),
                             part=res.get("part")))
        for r in res.get("rows", []):
            old = rows.get(row_key(r))
            if old is None or not r.get("error") or old.get("error"):
                rows[row_key(r)] = r
    return {"versions": versions[0] if versions else {}, "parts": versions,
            "rows": sorted(rows.values(), key=row_key)}


def write(path: str | None, result: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    from . import bench as gb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in gb.ISSUE_SHAPES))
    p.add_argument("--K", default="2,3,4")
    p.add_argument("--codebooks", default="mcg,mul1")
    p.add_argument("--m", default=",".join(map(str, gb.ISSUE_M)))
    p.add_argument("--part", default=None, help="i/n: run the i-th of n slices of the grid")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--resume", action="store_true", help="skip rows already in --out")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge these result files into --out and exit (no GPU needed)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new row after this many seconds")
    p.add_argument("--l2", choices=gb.L2_MODES, default="cold",
                   help="cold: each side cycles through enough weight copies to miss the L2 "
                        "(a model's layers are distinct); warm: one copy (L2-resident where "
                        "it fits, the method before session 24)")
    p.add_argument("--rounds", type=int, default=3,
                   help="times each row's op and its bf16 dot in alternation, this many times "
                        "each (medians): both sides see the same clock at the power cap")
    a = p.parse_args(argv)
    if a.merge:
        result = merge(a.merge)
        write(a.out, result)
        print(f"merged {len(result['rows'])} rows from {len(a.merge)} files"
              + (f" into {a.out}" if a.out else ""))
        return 0

    part = parse_part(a.part)
    deadline = time.time() + a.budget_s if a.budget_s else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    Ks = [float(v) if "." in v else int(v) for v in a.K.split(",")]
    ms = [int(v) for v in a.m.split(",")]
    groups = part_groups(grid_groups(shapes, Ks, a.codebooks.split(",")), part)
    rows = load_rows(a.out) if a.resume else []
    done = {row_key(r) for r in rows}
    result = {"versions": gb.versions(), "l2": a.l2, "rounds": a.rounds,
              "part": f"{part[0]}/{part[1]}",
              "groups": [list(g) for g in groups], "m": ms, "rows": rows}
    t0 = time.time()

    def on_row(row):
        rows.append(row)
        result["seconds"] = round(time.time() - t0, 1)
        write(a.out, result)

    gb.bench(shapes, Ks, a.codebooks.split(","), ms, deadline=deadline, groups=set(groups),
             done=done, on_row=on_row, l2=a.l2, rounds=a.rounds)
    wanted = {(*g, m) for g in groups for m in ms}
    missing = sorted(wanted - {row_key(r) for r in rows if not r.get("error")})
    result.update(seconds=round(time.time() - t0, 1), complete=not missing,
                  missing=[list(k) for k in missing])
    write(a.out, result)
    print(f"bench linear part {result['part']}: {len(wanted) - len(missing)}/{len(wanted)} rows"
          f" in {result['seconds']} s" + (f"; {len(missing)} missing (rerun with --resume)"
                                          if missing else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
