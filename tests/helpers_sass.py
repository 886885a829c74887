"""Static checks of CPU-compiled SASS (nvdisasm text) for the asynchronous warpgroup MMA.

wgmma (SASS HGMMA) reads its A registers and writes its accumulators after it issues, until a
WARPGROUP.DEPBAR retires it; shared memory written by ordinary stores must be fenced to the
async proxy (FENCE.VIEW.ASYNC.S) before the barrier that hands it to the tensor core. Nothing at
run time reports a breach (the result is silently wrong), so these checks read the compiled code
itself; each returns the offending instructions (empty: none).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_REG = re.compile(r"\bR(\d+)\b")
_NO_DEST = ("ST", "BAR", "BRA", "HGMMA", "WARPGROUP", "MEMBAR", "FENCE", "EXIT", "RET", "NOP",
            "WARPSYNC", "DEPBAR", "BSYNC", "BSSY", "RED", "ATOM")


def nvdisasm() -> str | None:
    """The nvdisasm binary: on PATH, or from the nvidia-cuda-nvdisasm wheel."""
    if found := shutil.which("nvdisasm"):
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cuda_nvdisasm"):
            path = os.path.join(root, sub, "bin", "nvdisasm")
            if os.path.isfile(path):
                return path
    return None


def disassemble(cubin: str) -> list[tuple[str, str]]:
    """(label or "", instruction text) per instruction of a cubin, in address order; a label
    marks the instruction it precedes."""
    text = subprocess.run([nvdisasm(), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    out, label = [], ""
    for line in text.splitlines():
        if m := re.match(r"(\.L_x_\d+):", line):
            label = m.group(1)
        elif m := _INSTR.match(line):
            out.append((label, m.group(2)))
            label = ""
    return out


def destinations(ins: str) -> set[int]:
    """Registers an instruction writes (its first operand; 2 for .64 / WIDE, 4 for .128)."""
    body = ins.split(None, 1)[1] if ins.startswith("@") else ins
    op, _, rest = body.partition(" ")
    if op.startswith(_NO_DEST):
        return set()
    m = re.match(r"R(\d+)$", rest.split(",")[0].strip())
    if not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def unrolled(instrs: list[tuple[str, str]], passes: int = 3) -> list[str]:
    """The instruction stream with every backward-branch loop body repeated ``passes`` times
    (so hazards that cross the back edge show), labels dropped."""
    seq = [ins for _, ins in instrs]
    for i, (_, ins) in enumerate(instrs):
        m = re.search(r"@!?U?P\d+ BRA `\((\.L_x_\d+)\)", ins)
        if m:
            start = next((j for j, (lab, _) in enumerate(instrs) if lab == m.group(1)), None)
            if start is not None and start <= i:
                body = seq[start:i + 1]
                return seq[:i + 1] + body * (passes - 1) + seq[i + 1:]
    return seq


def _hgmma_regs(ins: str) -> tuple[set[int], set[int]]:
    """(accumulator registers, A registers) of an HGMMA (no A registers when A comes from
    shared memory: "HGMMA.64xNx16.F32 R24, gdesc[..]")."""
    m = re.search(r"HGMMA\.64x(\d+)x16\S* R(\d+), (?:R(\d+),|gdesc)", ins)
    n, d = int(m.group(1)), int(m.group(2))
    a = set(range(int(m.group(3)), int(m.group(3)) + 4)) if m.group(3) else set()
    return set(range(d, d + n // 2)), a


def async_register_breaches(instrs: list[tuple[str, str]]) -> list[str]:
    """Instructions that write an A register of an HGMMA not yet retired, touch an
    accumulator of one, or issue an HGMMA whose A registers were written after the last
    WARPGROUP.ARRIVE (wgmma.fence). An HGMMA marked gsb0 closes a commit group with the
    HGMMAs since the last one; WARPGROUP.DEPBAR.LE gsb0, n retires all but the last n groups."""
    groups: list[list] = [[]]          # closed commit groups, then the open one
    bad = []
    written_since_arrive: set[int] = set()
    for ins in unrolled(instrs):
        if "HGMMA" in ins:
            acc, a = _hgmma_regs(ins)
            if a & written_since_arrive:
                bad.append(ins)
            groups[-1].append((acc, a))
            if "gsb0" in ins:
                groups.append([])
        elif "WARPGROUP.DEPBAR.LE" in ins:
            keep = int(ins.split(",")[-1], 16)
            closed = groups[:-1]
            groups = (closed[len(closed) - keep:] if keep else []) + [groups[-1]]
        elif "WARPGROUP.ARRIVE" in ins:
            written_since_arrive = set()
        else:
            regs = {int(r) for r in _REG.findall(ins)}
            dest = destinations(ins)
            written_since_arrive |= dest
            if any(dest & a or regs & acc for g in groups for acc, a in g):   # not retired
                bad.append(ins)
    return bad


def unfenced_shared_stores(instrs: list[tuple[str, str]]) -> list[str]:
    """Shared-memory writes not fenced to the async proxy (FENCE.VIEW.ASYNC.S) before a barrier
    that an HGMMA follows (loops unrolled): ordinary stores (STS), and cp.async copies at the
    wait that completes them (DEPBAR.LE SB0, after LDGSTS). Stores that only ordinary loads
    read after the last HGMMA (an epilogue) need no fence."""
    seq = unrolled(instrs)
    last_hgmma = max((i for i, ins in enumerate(seq) if "HGMMA" in ins), default=-1)
    bad, open_writes = [], []
    for i, ins in enumerate(seq):
        if ins.startswith("STS") or ins.startswith("DEPBAR.LE SB0"):
            open_writes.append(ins)
        elif "FENCE.VIEW.ASYNC.S" in ins:
            open_writes = []
        elif ins.startswith("BAR.SYNC"):
            if i < last_hgmma:
                bad += [w for w in open_writes if w not in bad]
            open_writes = []
    return bad


def unwaited_async_copies(instrs: list[tuple[str, str]]) -> list[str]:
    """Ordinary shared stores (STS) and EXITs issued while cp.async copies (LDGSTS) may still
    be landing: groups close at LDGDEPBAR and retire at DEPBAR.LE SB0, N (at most N left)."""
    bad, open_copies, groups = [], False, 0
    for ins in unrolled(instrs):
        if ins.startswith("LDGSTS"):
            open_copies = True
        elif ins.startswith("LDGDEPBAR"):
            groups += open_copies
            open_copies = False
        elif ins.startswith("DEPBAR.LE SB0"):
            groups = min(groups, int(ins.split(",")[-1], 16))
        elif (ins.startswith("STS") or ins.startswith("EXIT")) and (groups or open_copies):
            bad.append(ins)
    return bad


def spilling_cubins(folder) -> dict[str, int]:
    """{cubin file name: local-memory loads and stores (STL / LDL)} for the cubins in ``folder``
    that spill registers (empty: none does)."""
    out = {}
    for path in sorted(os.listdir(folder)):
        if path.endswith(".cubin"):
            code = disassemble(os.path.join(folder, path))
            spills = sum(1 for _, ins in code if ins.startswith(("STL", "LDL")))
            if spills:
                out[path] = spills
    return out
