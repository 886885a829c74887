"""A PTX interpreter that runs the repository's CuTe DSL kernels on the CPU (tests only).

Why: the kernels can only be timed on a GPU, but their arithmetic, indexing and
synchronisation are fixed by the PTX that CuTe DSL emits, which any machine can compile.
Running that PTX here, on inputs drawn fresh, checks the kernels bit for bit against the jnp
reference in CI, and checks what compute-sanitizer would (out-of-bounds and misaligned
accesses) plus the ordering rules a GPU only breaks intermittently:
  * shared-memory races between warps (a read, write or overwrite of bytes another warp wrote
    or read since the CTA's last barrier), the warps of other CTAs of a thread-block cluster
    included (distributed shared memory, ordered only by a cluster barrier);
  * wgmma (async proxy): its A registers changed or its accumulators touched before the
    wait_group that retires it, registers written since the last wgmma.fence, shared memory it
    reads written by the generic proxy without a fence.proxy.async, or overwritten while it is
    in flight;
  * cp.async: its destination read or written before the wait_group that lands it;
  * barriers reached by part of a CTA (or of a cluster), warp-collective instructions run by
    part of a warp, another CTA's shared memory accessed before a cluster barrier guarantees
    that every CTA of the cluster has started.
Races are tracked per warp, not per thread: the lanes of a warp run each instruction together
here, so a missing bar.warp.sync between lanes of one warp is not reported.

Model. Every thread of a batch of CTAs is a lane of NumPy arrays (registers hold raw bits).
The lanes with the lowest program counter execute the next instruction together (min-PC
scheduling, which reconverges structured code at its join points); a barrier waits for every
live thread of its CTA. Asynchronous operations (wgmma, cp.async) compute at issue and their
hazards are tracked explicitly, so an ordering bug is reported instead of hidden.

Clusters (sm_90 distributed shared memory): a batch holds whole clusters, each one's CTAs in
rank order. mapa sets bits 24.. of a shared offset to the target CTA's rank + 1 (shared windows
are < 16 MB), which ld/st.shared::cluster decode (0 there: the executing CTA's own window);
race entries name a warp by an id unique in the batch, so a remote access is a race like any
other: bar.sync clears only its own CTA's warps' entries, a cluster barrier whose arrive
released clears the whole cluster's. barrier.cluster.wait checks, as bar.sync does for a CTA,
that every thread of the cluster has arrived in its phase.

Arithmetic: integer, fp16 and fp32 instructions are IEEE exact (fma.rn.f32 through a
round-to-odd double sum); mma.sync and wgmma sum exact products in float64 and round once to
fp32 (the tensor core truncates differently, so GEMM tests use tolerances, while one-hot decode
checks are exact either way); approximate instructions (ex2/rcp/rsqrt .approx) use exact
math. Only the PTX forms the kernels use are implemented; anything else raises
``PtxUnsupported`` naming the instruction."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import defaultdict

import numpy as np

__all__ = ["PtxError", "PtxUnsupported", "PtxModule", "GlobalMemory", "launch"]


class PtxError(RuntimeError):
    """A kernel did something a GPU would fault on, race on, or leave undefined."""


class PtxUnsupported(NotImplementedError):
    """The PTX uses a form this interpreter does not implement."""


# ---------------------------------------------------------------------------------------------
# Parsing

_WIDTH = {"b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16, "bf16": 16,
          "b32": 32, "u32": 32, "s32": 32, "f32": 32, "f16x2": 32, "bf16x2": 32,
          "b64": 64, "u64": 64, "s64": 64, "f64": 64, "pred": 1}
_RAW = {1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_IDENT = re.compile(r"^[A-Za-z_$%][\w$]*$")
_LABEL = re.compile(r"^\s*([A-Za-z_$][\w$]*)\s*$")
_SPECIAL = re.compile(r"^%(tid|ntid|ctaid|nctaid|cluster_ctaid|cluster_nctaid|clusterid|"
                      r"nclusterid)\.([xyz])$|^%(laneid|warpid|cluster_ctarank|cluster_nctarank)$")
# A shared::cluster address (from mapa): bits 24.. hold the target CTA's rank + 1 above its
# shared::cta offset; 0 there is the executing CTA's own window (as PTX allows).
_RANK_SHIFT = 24
_OFFSET_MASK = (1 << _RANK_SHIFT) - 1


@dataclasses.dataclass
class Instr:
    op: str
    parts: list
    args: list
    guard: tuple | None          # (register, negated)
    text: str
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()


@dataclasses.dataclass
class Entry:
    name: str
    params: list                  # (name, bytes)
    regs: dict                    # register -> width
    ranges: dict                  # prefix -> width  (%r<100>)
    code: list
    labels: dict
    static_shared: dict           # symbol -> (offset, bytes)
    shared_bytes: int
    dynamic_shared: str | None

    @functools.cached_property
    def has_wgmma(self) -> bool:
        """Whether the kernel issues wgmma (only then is wgmma.fence bookkeeping needed)."""
        return any(ins.parts[0] == "wgmma" for ins in self.code)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _split_top(s: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_int(tok: str):
    t = tok.rstrip("U")
    if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", t):
        return int(t, 16)
    if re.fullmatch(r"-?\d+", t):
        return int(t)
    return None


class _Body:
    """Splits an entry body into statements, tracking `{ }` scopes (inline asm blocks declare
    scope-local registers, renamed here to unique names)."""

    def __init__(self, entry: Entry):
        self.entry = entry
        self.scopes = [{}]
        self.n_scopes = 0

    def resolve(self, name: str) -> str:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return name

    def is_reg(self, name: str) -> bool:
        if name in self.entry.regs:
            return True
        m = re.match(r"^(%[A-Za-z_]+)\d+$", name)
        return bool(m and m.group(1) in self.entry.ranges)

    def declare(self, decl: str):
        m = re.match(r"^\.reg\s+\.(\w+)\s+(.*)$", decl.strip(), re.S)
        if not m:
            raise PtxUnsupported(f"declaration {decl!r}")
        width = _WIDTH[m.group(1)]
        for name in _split_top(m.group(2)):
            r = re.fullmatch(r"(%?[\w$]+)<(\d+)>", name)
            if r:
                self.entry.ranges[r.group(1)] = width
                continue
            unique = name if len(self.scopes) == 1 else f"{name}#{self.n_scopes}"
            self.scopes[-1][name] = unique
            self.entry.regs[unique] = width

    def operand(self, tok: str):
        tok = tok.strip()
        if tok.startswith("{"):
            return ("vec", [self.operand(t) for t in _split_top(tok[1:-1])])
        if tok.startswith("["):
            inner = tok[1:-1].replace(" ", "")
            m = re.fullmatch(r"([^+]+?)(?:\+(-?(?:0x)?[0-9a-fA-F]+))?", inner)
            base, off = m.group(1), int(m.group(2), 0) if m.group(2) else 0
            b = self.operand(base)
            return ("mem", b, off)
        if tok.startswith("!"):
            return ("not", self.operand(tok[1:]))
        if "|" in tok:
            return ("pair", [self.operand(t) for t in tok.split("|")])
        if tok == "_":
            return ("sink",)
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", tok):
            return ("fimm", int(tok[2:], 16), 32)
        if re.fullmatch(r"0[dD][0-9a-fA-F]{16}", tok):
            return ("fimm", int(tok[2:], 16), 64)
        v = _parse_int(tok)
        if v is not None:
            return ("imm", v)
        if _SPECIAL.match(tok):
            return ("special", tok)
        name = self.resolve(tok)
        if self.is_reg(name):
            return ("reg", name)
        if _IDENT.match(tok):
            return ("sym", tok)
        raise PtxUnsupported(f"operand {tok!r}")

    def statement(self, stmt: str):
        stmt = stmt.strip()
        if not stmt:
            return
        if stmt.startswith(".reg"):
            self.declare(stmt)
            return
        if stmt.startswith(".shared"):
            m = re.match(r"\.shared\s+(?:\.align\s+(\d+)\s+)?\.\w+\s+([\w$]+)\[(\d+)\]", stmt)
            if not m:
                raise PtxUnsupported(f"shared declaration {stmt!r}")
            align, name, size = int(m.group(1) or 1), m.group(2), int(m.group(3))
            off = -(-self.entry.shared_bytes // align) * align
            self.entry.static_shared[name] = (off, size)
            self.entry.shared_bytes = off + size
            return
        if stmt.startswith(".pragma") or stmt.startswith(".loc"):
            return
        guard = None
        m = re.match(r"^@(!?)([%\w$#]+)\s+(.*)$", stmt, re.S)
        if m:
            guard = (self.resolve(m.group(2)), m.group(1) == "!")
            stmt = m.group(3)
        m = re.match(r"^([a-z][\w.:]*)\s*(.*)$", stmt, re.S)
        if not m:
            raise PtxUnsupported(f"statement {stmt!r}")
        op, rest = m.group(1), m.group(2)
        args = [self.operand(t) for t in _split_top(rest)] if rest.strip() else []
        ins = Instr(op, op.split("."), args, guard, stmt)
        self.entry.code.append(ins)

    def parse(self, body: str):
        cur = []
        i = 0
        while i < len(body):
            ch = body[i]
            blank = not "".join(cur).strip()
            if ch == "{" and blank:
                self.scopes.append({})
                self.n_scopes += 1
            elif ch == "}" and blank:
                self.scopes.pop()
            elif ch == ";":
                self.statement("".join(cur))
                cur = []
            elif ch == ":" and body[i + 1:i + 2] != ":" and _LABEL.match("".join(cur)) \
                    and (i == 0 or body[i - 1] != ":"):
                self.entry.labels[_LABEL.match("".join(cur)).group(1)] = len(self.entry.code)
                cur = []
            else:
                cur.append(ch)
            i += 1
        if "".join(cur).strip():
            raise PtxUnsupported(f"trailing text {''.join(cur)!r}")


def _operand_regs(op) -> set:
    kind = op[0]
    if kind == "reg":
        return {op[1]}
    if kind in ("vec", "pair"):
        return set().union(*[_operand_regs(o) for o in op[1]])
    if kind == "mem":
        return _operand_regs(op[1])
    if kind == "not":
        return _operand_regs(op[1])
    return set()


_NO_DEST = {"st", "bar", "barrier", "bra", "ret", "exit", "cp", "fence", "griddepcontrol",
            "wgmma", "membar", "red"}


def _annotate(ins: Instr):
    """Registers read and written (for the async-proxy hazard checks)."""
    base = ins.parts[0]
    regs = [_operand_regs(a) for a in ins.args]
    if ins.guard:
        regs.append({ins.guard[0]})
    if base in _NO_DEST or not ins.args:
        ins.reads = frozenset(set().union(*regs) if regs else set())
        ins.writes = frozenset()
        if ins.op.startswith("wgmma.mma_async"):
            ins.writes = frozenset(_operand_regs(ins.args[0]))
        return
    dest = ins.args[0]
    ins.writes = frozenset(_operand_regs(dest))
    ins.reads = frozenset(set().union(*regs[1:]) if len(regs) > 1 else set())


class PtxModule:
    """A parsed PTX module: ``entries`` by name."""

    def __init__(self, text: str):
        text = _strip_comments(text)
        self.entries: dict[str, Entry] = {}
        self.extern_shared = re.findall(r"\.extern\s+\.shared\s+(?:\.align\s+(\d+)\s+)?\.b8\s+"
                                        r"([\w$]+)\[\]", text)
        for m in re.finditer(r"\.entry\s+([\w$]+)\s*\((.*?)\)([^{]*)\{", text, re.S):
            name = m.group(1)
            params = []
            for p in _split_top(m.group(2)):
                pm = re.search(r"\.(\w+)\s+([\w$]+)(?:\[(\d+)\])?\s*$", p)
                nbytes = int(pm.group(3)) if pm.group(3) else _WIDTH[pm.group(1)] // 8
                params.append((pm.group(2), nbytes))
            start = m.end()
            depth, i = 1, start
            while depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            entry = Entry(name, params, {}, {}, [], {}, {}, 0, None)
            _Body(entry).parse(text[start:i - 1])
            for ins in entry.code:
                _annotate(ins)
            if self.extern_shared:
                entry.dynamic_shared = self.extern_shared[0][1]
            self.entries[name] = entry

    def entry(self, kernel_name: str) -> Entry:
        """The entry named ``kernel_name``, else the one entry whose name contains it (CuTe
        DSL mangles the Python name)."""
        if kernel_name in self.entries:
            return self.entries[kernel_name]
        found = [e for n, e in self.entries.items() if f"_{kernel_name}_" in n]
        if len(found) != 1:
            raise KeyError(f"{kernel_name}: {len(found)} matching entries in "
                           f"{list(self.entries)}")
        return found[0]


# ---------------------------------------------------------------------------------------------
# Memory

GLOBAL_BASE = 0x7F00_0000_0000
GLOBAL_STRIDE = 1 << 32


class GlobalMemory:
    """Device buffers, each in its own 4 GiB window (so an address names its buffer and any
    access outside a buffer's bytes is caught)."""

    def __init__(self):
        self.buffers: list[np.ndarray] = []
        self.names: list[str] = []
        # Ordering between the launches of one custom call: per byte, the last launch that
        # wrote it and the last that read it (-1: none), the current launch, and the earlier
        # launches that may still run while it does (programmatic dependent launch).
        self.writer: list[np.ndarray] = []
        self.reader: list[np.ndarray] = []
        self.launch_id = 0
        self.unordered: frozenset = frozenset()

    def alloc(self, data: np.ndarray | bytes | int, name: str = "") -> int:
        if isinstance(data, int):
            buf = np.full(data, 0xFF, np.uint8)              # unwritten bytes read as NaN
        else:
            buf = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8).copy()
        self.buffers.append(buf)
        self.writer.append(np.full(len(buf), -1, np.int32))
        self.reader.append(np.full(len(buf), -1, np.int32))
        self.names.append(name or f"buffer{len(self.buffers) - 1}")
        return GLOBAL_BASE + (len(self.buffers) - 1) * GLOBAL_STRIDE

    def read(self, addr: int) -> np.ndarray:
        return self.buffers[(addr - GLOBAL_BASE) // GLOBAL_STRIDE]

    def _locate(self, addr: np.ndarray, nbytes: int, what: str, ins: Instr):
        rel = addr.astype(np.uint64) - np.uint64(GLOBAL_BASE)
        buf = (rel >> np.uint64(32)).astype(np.int64)
        off = (rel & np.uint64(0xFFFFFFFF)).astype(np.int64)
        bad_align = off % nbytes != 0
        if bad_align.any():
            raise PtxError(f"misaligned {nbytes}-byte {what} at {hex(int(addr[bad_align][0]))}: "
                           f"{ins.text}")
        ok = (addr >= GLOBAL_BASE) & (buf < len(self.buffers))
        sizes = np.array([len(b) for b in self.buffers] + [0])
        ok &= off + nbytes <= sizes[np.where(ok, buf, len(self.buffers))]
        if not ok.all():
            j = int(np.argmin(ok))
            name = self.names[buf[j]] if 0 <= buf[j] < len(self.buffers) else "no buffer"
            raise PtxError(f"out-of-bounds global {what} of {nbytes} bytes at offset "
                           f"{int(off[j])} of {name}: {ins.text}")
        return buf, off

    def _order(self, b, idx, unwaited, write: bool, ins):
        """A load / store of buffer b's bytes idx [n, nbytes]; unwaited [n]: the thread has not
        passed griddepcontrol.wait, so launches still running (``unordered``) may race it."""
        if self.unordered and unwaited.any():
            wr = self.writer[b][idx[unwaited]]
            clash = np.isin(wr, list(self.unordered))
            if write:
                clash |= np.isin(self.reader[b][idx[unwaited]], list(self.unordered))
            if clash.any():
                other = int(wr[clash][0]) if (wr[clash] >= 0).any() else "an earlier launch"
                raise PtxError(f"{'store to' if write else 'load of'} {self.names[b]} before "
                               f"griddepcontrol.wait, racing launch {other} (programmatic "
                               f"dependent launch): {ins.text}")
        if write:
            self.writer[b][idx] = self.launch_id
        else:
            if "nc" in ins.parts and (self.writer[b][idx] == self.launch_id).any():
                raise PtxError(f"ld.global.nc of {self.names[b]} bytes this kernel wrote (the "
                               f"non-coherent path may return stale data): {ins.text}")
            self.reader[b][idx] = np.maximum(self.reader[b][idx], self.launch_id)

    def load(self, addr, nbytes, ins, unwaited=None):
        buf, off = self._locate(addr, nbytes, "load", ins)
        out = np.empty((len(addr), nbytes), np.uint8)
        for b in np.unique(buf):
            sel = buf == b
            idx = off[sel][:, None] + np.arange(nbytes)
            self._order(b, idx, np.zeros(len(idx), bool) if unwaited is None else unwaited[sel],
                        False, ins)
            out[sel] = self.buffers[b][idx]
        return out

    def store(self, addr, data, ins, unwaited=None):
        nbytes = data.shape[1]
        buf, off = self._locate(addr, nbytes, "store", ins)
        for b in np.unique(buf):
            sel = buf == b
            idx = off[sel][:, None] + np.arange(nbytes)
            self._order(b, idx, np.zeros(len(idx), bool) if unwaited is None else unwaited[sel],
                        True, ins)
            self.buffers[b][idx] = data[sel]


# ---------------------------------------------------------------------------------------------
# Value helpers

def _bits_to(bits: np.ndarray, t: str) -> np.ndarray:
    w = _WIDTH[t]
    bits = bits.astype(_RAW[w], copy=False) if bits.dtype != _RAW[w] else bits
    if t in ("f32",):
        return bits.view(np.float32)
    if t == "f64":
        return bits.view(np.float64)
    if t == "f16":
        return bits.view(np.float16)
    if t[0] == "s":
        return bits.view({8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[w])
    return bits


def _to_bits(val: np.ndarray, width: int) -> np.ndarray:
    raw = _RAW[width]
    if val.dtype == raw:
        return val
    if val.dtype.itemsize * 8 == width:
        return val.view(raw)
    if val.dtype.kind == "f":      # a float's bits go only into a register of its own width
        raise PtxError(f"internal: {val.dtype} value for a {width}-bit register")
    return val.astype(np.int64).astype(raw)


def _fma_f32(a, b, c, mode: str = "rn"):
    """a*b+c rounded once to fp32 (``mode`` rn / rz / rm / rp): the product is exact in
    float64 and the sum's rounding error is exact (two-sum). rn: the sum rounded to odd in
    float64 (53 >= 24 + 2 bits) then to fp32; directed modes: the fp32 nearest to the double
    sum, stepped once toward the mode's side where it lies beyond the exact value."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        err = np.where(np.isfinite(err), err, 0.0)
        if mode == "rn":
            mant_even = (s.view(np.uint64) & np.uint64(1)) == 0
            fix = (err != 0) & mant_even & np.isfinite(s)
            s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
            return s.astype(np.float32)
        r = s.astype(np.float32)
        over = (r.astype(np.float64) - s) > err        # r above the exact value s + err
        under = (r.astype(np.float64) - s) < err
        down = over & ((mode == "rm") | ((mode == "rz") & (s + err > 0)))
        up = under & ((mode == "rp") | ((mode == "rz") & (s + err < 0)))
        r = np.where(down, np.nextafter(r, np.float32(-np.inf)), r)
        r = np.where(up, np.nextafter(r, np.float32(np.inf)), r)
    return r.astype(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    rounded = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
               >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, np.uint16(0x7FC0), rounded)


def _bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _ftz(x: np.ndarray) -> np.ndarray:
    tiny = np.abs(x) < np.finfo(np.float32).tiny
    return np.where(tiny & (x != 0), np.copysign(np.float32(0), x), x).astype(np.float32)


def _halves(bits32):
    lo = (bits32 & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (bits32 >> np.uint32(16)).astype(np.uint16).view(np.float16)
    return lo, hi


def _pack_halves(lo, hi):
    return (lo.astype(np.float16).view(np.uint16).astype(np.uint32)
            | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << np.uint32(16)))


# ---------------------------------------------------------------------------------------------
# Execution

@dataclasses.dataclass
class _Wgmma:
    lanes: np.ndarray            # lane indices of the issuing warpgroup
    group: int                   # commit sequence number it belongs to
    a_regs: frozenset
    acc_regs: frozenset
    smem_flat: np.ndarray        # smem bytes read, as batch-local cta * stride + offset


@dataclasses.dataclass
class _CpAsync:
    lane: np.ndarray
    seq: np.ndarray              # commit count of each lane at issue
    cta: np.ndarray
    dst: np.ndarray              # [n, 16] byte offsets
    data: np.ndarray             # [n, 16]


_EXITED_PC = 2 ** 62      # an exited lane's pc: never the minimum while a lane still runs


class _Batch:
    """One batch of CTAs of one launch: whole clusters, each one's CTAs consecutive in rank
    order (so CTA row r of the batch has rank r % csize in cluster r // csize)."""

    def __init__(self, entry: Entry, memory: GlobalMemory, params: bytes, ctas, block,
                 grid, smem_bytes: int, check_races: bool, cluster=(1, 1, 1)):
        self.e, self.mem = entry, memory
        self.params = params
        nt = block[0] * block[1] * block[2]
        self.nt, self.block, self.grid = nt, block, grid
        nc = len(ctas)
        self.nc = nc
        L = nc * nt
        self.L = L
        t = np.arange(L) % nt
        self.cta = np.arange(L) // nt
        self.tid = (t % block[0], (t // block[0]) % block[1], t // (block[0] * block[1]))
        cids = np.asarray(ctas)
        self.ctaid = tuple(cids[self.cta, i] for i in range(3))
        self.thread = t
        self.lane = t % 32
        self.warp = t // 32                                   # warp within the CTA
        self.gwarp = np.arange(L) // 32                       # warp within the batch
        # Race bookkeeping names a warp by an id unique in the batch (a warp of another CTA
        # of the cluster may access this CTA's bytes): CTA row c's warps are c * wpc + warp.
        self.wpc = -(-nt // 32)
        self.warp_id = (self.cta * self.wpc + self.warp).astype(np.int32)
        self.cdims = tuple(int(c) for c in cluster)
        self.csize = self.cdims[0] * self.cdims[1] * self.cdims[2]
        self.cluster_ctaid = tuple(self.ctaid[i] % self.cdims[i] for i in range(3))
        rank = self.cluster_ctaid[0] + self.cdims[0] * (self.cluster_ctaid[1] + self.cdims[1]
                                                        * self.cluster_ctaid[2])
        if nc % self.csize or (rank != self.cta % self.csize).any():
            raise ValueError("a batch of CTAs must be whole clusters in rank order")
        self.ctarank = rank
        self.regs: dict[str, np.ndarray] = {}
        base = -(-entry.shared_bytes // 1024) * 1024
        self.dyn_base = base
        self.smem_size = base + smem_bytes
        self.smem = np.zeros((nc, max(self.smem_size, 1)), np.uint8)
        self.check_races = check_races
        # Race bookkeeping per CTA byte since the CTA's last barrier: the warp (warp_id) that
        # wrote it (-1 none) and the warp that read it (-1 none, -2 several of its own CTA,
        # -3 several, one of another CTA at least). ``foreign``: a CTA row may hold entries
        # of another CTA's warps (which its bar.sync does not clear).
        self.writer = np.full((nc, max(self.smem_size, 1)), -1, np.int32)
        self.reader = np.full((nc, max(self.smem_size, 1)), -1, np.int32)
        self.foreign = np.zeros(nc, bool)
        self.unfenced = np.zeros((nc, max(self.smem_size, 1)), np.int32)  # writer's lane + 1
        self.pending_cp = np.zeros((nc, max(self.smem_size, 1)), np.int32)
        # Flat views of the four (cheaper to gather from than with two index arrays).
        self.smem_stride = self.writer.shape[1]
        self.writer_f, self.reader_f = self.writer.reshape(-1), self.reader.reshape(-1)
        self.unfenced_f, self.pending_cp_f = self.unfenced.reshape(-1), self.pending_cp.reshape(-1)
        # A lane's batch index is cta * nt + thread, so its warpgroup is index // 128.
        self.wg_pad = -L % 128
        self.cp_records: list[_CpAsync] = []
        self.cp_commits = np.zeros(L, np.int64)
        self.wgmma_inflight: list[_Wgmma] = []
        self.wgmma_open: dict[int, int] = defaultdict(int)     # warpgroup -> open group seq
        self.fence_dirty: dict[int, set] = defaultdict(set)    # warpgroup -> regs written
        self.pc = np.zeros(L, np.int64)               # _EXITED_PC once a lane has exited
        self.waited = np.zeros(L, bool)            # passed griddepcontrol.wait
        # Cluster barrier: arrivals and waits of each lane (its phase), whether its latest
        # arrival released, the phase up to which each cluster's bookkeeping was cleared, and
        # the smem bytes accessed between a release arrive and its wait (not ordered by that
        # phase): (flat indices, phase) records, kept only while such a window is open.
        self.arrives = np.zeros(L, np.int64)
        self.waits = np.zeros(L, np.int64)
        self.released = np.zeros(L, bool)
        self.cleared = np.zeros(nc // self.csize, np.int64)
        self.in_window = np.zeros(L, bool)
        self.n_window = 0
        self.window: list[tuple[np.ndarray, np.ndarray]] = []

    # -- registers -------------------------------------------------------------------------
    def width(self, name: str) -> int:
        if name in self.e.regs:
            return self.e.regs[name]
        m = re.match(r"^(%[A-Za-z_]+)\d+$", name)
        return self.e.ranges[m.group(1)]

    def reg(self, name: str) -> np.ndarray:
        r = self.regs.get(name)
        if r is None:
            w = self.width(name)
            # Uninitialised registers hold a pattern that reads as NaN in fp16 and fp32.
            fill = {1: False, 8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}[w]
            r = self.regs[name] = np.full(self.L, fill, _RAW[w])
        return r

    def read(self, op, t: str) -> np.ndarray:
        """Operand value as type ``t`` (a PTX type name), one per lane."""
        kind = op[0]
        if kind == "reg":
            bits = self.reg(op[1])
            if t == "pred":
                return bits if bits.dtype == np.bool_ else bits != 0
            w = _WIDTH[t]
            rw = self.width(op[1])
            if rw != w:
                bits = bits.astype(_RAW[w])       # e.g. a .b32 register read by a .b16 op
            return _bits_to(bits, t)
        if kind == "imm":
            if t == "pred":
                return np.full(self.L, bool(op[1]))
            w = _WIDTH[t]
            v = op[1] & ((1 << w) - 1)
            return _bits_to(np.full(self.L, v, _RAW[w]), t)
        if kind == "fimm":
            if op[2] == 32:
                v = np.full(self.L, op[1], np.uint32).view(np.float32)
            else:
                v = np.full(self.L, op[1], np.uint64).view(np.float64)
            return v.astype(np.float32) if t == "f32" else v.astype(np.float64) \
                if t == "f64" else _bits_to(_to_bits(v, _WIDTH[t]), t)
        if kind == "not":
            return ~self.read(op[1], "pred")
        if kind == "special":
            return self.special(op[1]).astype(_RAW[_WIDTH[t]])
        if kind == "sym":
            return np.full(self.L, self.symbol(op[1]), _RAW[_WIDTH[t]])
        raise PtxUnsupported(f"read of {op}")

    def special(self, name):
        m = _SPECIAL.match(name)
        scalar = m.group(3)
        if scalar is not None:
            return {"laneid": lambda: self.lane, "warpid": lambda: self.warp,
                    "cluster_ctarank": lambda: self.ctarank,
                    "cluster_nctarank": lambda: np.full(self.L, self.csize),
                    }[scalar]().astype(np.uint32)
        axis = "xyz".index(m.group(2))
        c = self.cdims[axis]
        return {"tid": lambda: self.tid[axis], "ntid": lambda: np.full(self.L, self.block[axis]),
                "ctaid": lambda: self.ctaid[axis],
                "nctaid": lambda: np.full(self.L, self.grid[axis]),
                "cluster_ctaid": lambda: self.cluster_ctaid[axis],
                "cluster_nctaid": lambda: np.full(self.L, c),
                "clusterid": lambda: self.ctaid[axis] // c,
                "nclusterid": lambda: np.full(self.L, self.grid[axis] // c),
                }[m.group(1)]().astype(np.uint32)

    def symbol(self, name):
        if name == self.e.dynamic_shared:
            return self.dyn_base
        if name in self.e.static_shared:
            return self.e.static_shared[name][0]
        raise PtxUnsupported(f"symbol {name}")

    def write(self, op, val: np.ndarray, mask: np.ndarray):
        if op[0] == "sink":
            return
        if op[0] != "reg":
            raise PtxUnsupported(f"write to {op}")
        r = self.reg(op[1])
        if r.dtype == np.bool_:
            bits = val.astype(bool)
        else:
            bits = _to_bits(val, _WIDTH_OF[r.dtype])
        np.copyto(r, bits, where=mask)

    # -- scheduling ------------------------------------------------------------------------
    def run(self, max_steps: int, counts=None):
        """Execute the batch to its end. ``counts`` (a dict, or None): add to counts[op] the
        warp-instructions each instruction issues (the warps with a lane at it, predicated
        off or not; the two sides of a divergent branch issue separately), by its first name
        part (ld, mma, shfl, ...)."""
        code = self.e.code
        steps = 0
        warp_starts = np.flatnonzero(self.lane == 0) if counts is not None else None
        while True:
            cur = int(self.pc.min())
            if cur == _EXITED_PC:
                break
            active = self.pc == cur
            if cur >= len(code):
                raise PtxError("fell off the end of the kernel")
            ins = code[cur]
            mask = active
            if ins.guard is not None:
                g = self.reg(ins.guard[0])
                mask = active & (~g if ins.guard[1] else g)
            if self.wgmma_inflight and (ins.reads or ins.writes):
                self.check_wgmma_hazards(ins, mask)
            if self.e.has_wgmma and ins.writes and ins.parts[0] not in ("wgmma", "mov"):
                # Register copies are exempt: LLVM materialises inline-asm operands as movs
                # right before the asm (after the fence), and ptxas coalesces them (the first
                # HGMMA of the wgmma kernel then reads RZ with scale-d off).
                self.note_fence_dirty(ins, mask)
            handler = _HANDLERS.get(ins.parts[0])
            if handler is None:
                raise PtxUnsupported(f"instruction {ins.op}: {ins.text}")
            if counts is not None:
                op = ins.parts[0]
                counts[op] = counts.get(op, 0) + int(
                    np.logical_or.reduceat(active, warp_starts).sum())
            jumped = handler(self, ins, mask, active)
            if not jumped:
                self.pc += active          # bool adds 0 / 1: cheaper than a masked +=
            steps += 1
            if steps > max_steps:
                raise PtxError(f"no exit after {max_steps} instructions (a hang?)")
        if self.wgmma_inflight:
            raise PtxError("kernel exited with wgmma in flight (no final wait_group)")
        if self.cp_records:
            raise PtxError("kernel exited with cp.async copies in flight")

    # -- hazard checks ---------------------------------------------------------------------
    def warpgroups(self, mask):
        if self.wg_pad:
            mask = np.concatenate([mask, np.zeros(self.wg_pad, bool)])
        return np.flatnonzero(mask.reshape(-1, 128).any(axis=1))

    def check_wgmma_hazards(self, ins, mask):
        if ins.op.startswith("wgmma"):
            return
        wgs = None
        for w in self.wgmma_inflight:
            if not (ins.writes & w.a_regs or (ins.reads | ins.writes) & w.acc_regs):
                continue
            if wgs is None:
                wgs = set(self.warpgroups(mask).tolist())
            if int(w.lanes[0]) // 128 not in wgs:      # w.lanes: one whole warpgroup
                continue
            if ins.writes & w.a_regs:
                raise PtxError(f"wgmma A register {sorted(ins.writes & w.a_regs)[0]} changed "
                               f"before its wait_group: {ins.text}")
            touched = (ins.reads | ins.writes) & w.acc_regs
            if touched:
                raise PtxError(f"wgmma accumulator {sorted(touched)[0]} accessed before its "
                               f"wait_group: {ins.text}")

    def note_fence_dirty(self, ins, mask):
        for wg in self.warpgroups(mask).tolist():
            self.fence_dirty[wg] |= ins.writes

    def smem_index(self, addr: np.ndarray, nbytes: int, ins, lanes):
        a = addr.astype(np.int64)
        if (a % nbytes != 0).any():
            raise PtxError(f"misaligned {nbytes}-byte shared access at {int(a[a % nbytes != 0][0])}"
                           f": {ins.text}")
        if ((a < 0) | (a + nbytes > self.smem_size)).any():
            bad = int(a[(a < 0) | (a + nbytes > self.smem_size)][0])
            if bad >> _RANK_SHIFT > 0:
                raise PtxError(f"shared::cluster address {bad:#x} (CTA rank bits set, from mapa)"
                               f" used as a shared::cta address: {ins.text}")
            raise PtxError(f"out-of-bounds shared access at {bad} (size {self.smem_size}): "
                           f"{ins.text}")
        return self.cta[lanes], a[:, None] + np.arange(nbytes)

    def dsmem_index(self, addr: np.ndarray, nbytes: int, ins, lanes):
        """(target CTA rows, byte offsets, which lanes access another CTA or None) of a
        shared::cluster access."""
        a = addr.astype(np.int64)
        hi = a >> _RANK_SHIFT
        if (hi <= 0).all():                       # the executing CTA's own window
            cta, idx = self.smem_index(a, nbytes, ins, lanes)
            return cta, idx, None
        if (hi > self.csize).any():
            raise PtxError(f"shared::cluster address {int(a[hi > self.csize][0]):#x} names CTA "
                           f"rank {int(hi.max()) - 1} of a cluster of {self.csize}: {ins.text}")
        own, idx = self.smem_index(np.where(hi > 0, a & _OFFSET_MASK, a), nbytes, ins, lanes)
        cta = np.where(hi > 0, own - own % self.csize + hi - 1, own)
        remote = cta != own
        if not remote.any():
            return cta, idx, None
        if (self.waits[lanes[remote]] == 0).any():
            raise PtxError("distributed shared memory accessed before the cluster barrier that "
                           "guarantees every CTA of the cluster has started (no "
                           f"barrier.cluster.wait yet): {ins.text}")
        return cta, idx, remote

    def note_smem(self, cta, idx, lanes, write: bool, ins, remote=None):
        """Race bookkeeping of an access of bytes ``idx`` of CTA rows ``cta`` by ``lanes``
        (``remote``: which of them belong to another CTA, None when none do)."""
        if not self.check_races:
            return
        nb = idx.shape[1]
        flat = (cta[:, None] * self.smem_stride + idx).reshape(-1)    # lane-major, as idx
        warp = np.repeat(self.warp_id[lanes], nb)
        if self.pending_cp_f.take(flat).any():
            raise PtxError(f"shared bytes accessed before their cp.async landed: {ins.text}")
        hint = "" if remote is None and not self.foreign.any() else \
            " (another CTA's accesses are ordered only by a cluster barrier)"
        wr = self.writer_f.take(flat)
        if ((wr >= 0) & (wr != warp)).any():
            kind = "write-after-write" if write else "read-after-write"
            raise PtxError(f"shared-memory race ({kind} between warps without a barrier){hint}: "
                           f"{ins.text}")
        rd = self.reader_f.take(flat)
        if write:
            if ((rd <= -2) | ((rd >= 0) & (rd != warp))).any():
                raise PtxError("shared-memory race (write-after-read between warps without a "
                               f"barrier){hint}: {ins.text}")
            self.writer_f[flat] = warp
            self.unfenced_f[flat] = np.repeat(lanes + 1, nb)
            for w in self.wgmma_inflight:
                hit = np.isin(flat, w.smem_flat)
                if hit.any():
                    raise PtxError(f"shared bytes overwritten while a wgmma reads them: "
                                   f"{ins.text}")
        else:
            several = -2 if not hint else self.several_readers(cta, rd, nb, remote)
            self.reader_f[flat] = np.where((rd == -1) | (rd == warp), warp, several)
        if remote is not None:
            self.foreign[cta[remote]] = True
        if self.n_window and self.in_window[lanes].any():
            inside = np.repeat(self.in_window[lanes], nb)
            self.window.append((flat[inside], np.repeat(self.arrives[lanes], nb)[inside]))

    def several_readers(self, cta, rd, nb, remote):
        """The reader entry (-2 or -3) of bytes now read by several warps: -3 when one of
        them belongs to another CTA than the bytes."""
        first = np.repeat(cta * self.wpc, nb)             # warp_id of the CTA's warp 0
        other = (rd == -3) | ((rd >= 0) & ((rd < first) | (rd >= first + self.wpc)))
        if remote is not None:
            other |= np.repeat(remote, nb)
        return np.where(other, -3, -2)

    def barrier(self, mask, active):
        ctas = np.unique(self.cta[active])
        for c in ctas:
            need = (self.cta == c) & (self.pc != _EXITED_PC)
            if (need & ~active).any():
                raise PtxError("bar.sync reached by part of a CTA (divergent barrier)")
            if not self.foreign[c]:
                self.writer[c] = -1
                self.reader[c] = -1
                continue
            # Only CTA c's own warps are ordered: other CTAs' entries stay until a cluster
            # barrier (and -3, several readers of which one of another CTA).
            lo, hi = c * self.wpc, (c + 1) * self.wpc
            w, r = self.writer[c], self.reader[c]
            w[(w >= lo) & (w < hi)] = -1
            r[((r >= lo) & (r < hi)) | (r == -2)] = -1

    # -- cluster barrier (barrier.cluster.arrive / wait) -----------------------------------
    def cluster_arrive(self, lanes, release: bool, ins):
        if (self.arrives[lanes] != self.waits[lanes]).any():
            raise PtxError("barrier.cluster.arrive by a thread that arrived and has not waited "
                           f"yet: {ins.text}")
        self.arrives[lanes] += 1
        self.released[lanes] = release
        if release and self.check_races:     # accesses until the wait: not ordered by it
            self.in_window[lanes] = True
            self.n_window += len(lanes)

    def cluster_wait(self, lanes, ins):
        """The first wait of a phase completes it for the whole cluster (min-PC scheduling:
        the other threads' waits come later), so a thread that reads between its arrive and a
        later wait of its own is taken as having acquired (not reported)."""
        if (self.arrives[lanes] == self.waits[lanes]).any():
            raise PtxError(f"barrier.cluster.wait without a prior barrier.cluster.arrive: "
                           f"{ins.text}")
        per = self.csize * self.nt                  # lanes of a cluster (consecutive)
        phase = self.arrives[lanes]
        cl = lanes // per
        used = np.unique(cl)
        want = np.zeros(len(self.cleared), np.int64)
        np.maximum.at(want, cl, phase)
        short = self.arrives.reshape(-1, per)[used] < want[used, None]
        if short.any():
            if (short & (self.pc == _EXITED_PC).reshape(-1, per)[used]).any():
                raise PtxError("cluster barrier waits for a thread that exited without arriving"
                               f": {ins.text}")
            raise PtxError("cluster barrier reached by part of a cluster (a thread of the "
                           f"cluster has not arrived): {ins.text}")
        for c in used[want[used] > self.cleared[used]].tolist():
            # The phase completes: every thread of the cluster has arrived in it (none can have
            # waited in it yet), so ``released`` is each one's arrival in this phase.
            rel = self.released[c * per:(c + 1) * per]
            if rel.all():
                self.cluster_clear(c, int(want[c]))
            elif rel.any():
                raise PtxUnsupported(f"a cluster barrier phase with both relaxed and release "
                                     f"arrivals: {ins.text}")
            self.cleared[c] = want[c]
        self.waits[lanes] += 1
        self.n_window -= int(self.in_window[lanes].sum())
        self.in_window[lanes] = False

    def cluster_clear(self, c: int, phase: int):
        """A release arrive + acquire wait of ``phase`` orders every access of the cluster's
        threads before their arrival: clear the bookkeeping of all its CTAs, except the
        bytes accessed after an arrival of ``phase`` (or later)."""
        rows = slice(c * self.csize, (c + 1) * self.csize)
        if not self.check_races:
            return
        keep = np.zeros(0, np.int64)
        if self.window:
            flat = np.concatenate([f for f, _ in self.window])
            ph = np.concatenate([p for _, p in self.window])
            mine = flat // self.smem_stride // self.csize == c
            keep = np.unique(flat[mine & (ph >= phase)])
            self.window = [(flat[~mine], ph[~mine])] if (~mine).any() else []
            if len(keep):
                self.window.append((keep, np.full(len(keep), phase)))
        w, r = self.writer_f[keep], self.reader_f[keep]
        self.writer[rows] = -1
        self.reader[rows] = -1
        self.foreign[rows] = False
        if len(keep):
            self.writer_f[keep], self.reader_f[keep] = w, r
            self.foreign[rows] = True

    def full_warps(self, mask, what):
        w = self.gwarp[mask]
        counts = np.bincount(w, minlength=self.L // 32)
        used = counts > 0
        if (counts[used] != 32).any():
            raise PtxError(f"{what} executed by part of a warp")
        return np.nonzero(used)[0]


_WIDTH_OF = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16, np.dtype(np.uint32): 32,
             np.dtype(np.uint64): 64}

# ---------------------------------------------------------------------------------------------
# Instruction handlers: handler(batch, ins, mask, active) -> True when it set the pc itself


def _type(ins) -> str:
    return ins.parts[-1]


def _int_binary(fn):
    def h(b, ins, mask, active):
        t = _type(ins)
        x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
        with np.errstate(over="ignore"):
            b.write(ins.args[0], fn(x, y, t), mask)
    return h


_DIRECTED = {"rz", "rm", "rp"}


def _float_binary(fn):
    def h(b, ins, mask, active):
        t = _type(ins)
        if _DIRECTED & set(ins.parts) and t == "f32" and fn in _AS_FMA:
            x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
            if "ftz" in ins.parts:
                x, y = _ftz(x), _ftz(y)
            mode = (_DIRECTED & set(ins.parts)).pop()
            r = _fma_f32(*_AS_FMA[fn](x, y), mode)
            b.write(ins.args[0], _ftz(r) if "ftz" in ins.parts else r, mask)
            return
        if _DIRECTED & set(ins.parts):
            raise PtxUnsupported(ins.op)
        if t == "f16x2":
            (xl, xh), (yl, yh) = _halves(b.read(ins.args[1], "b32")), \
                _halves(b.read(ins.args[2], "b32"))
            with np.errstate(over="ignore", invalid="ignore"):
                lo = fn(xl.astype(np.float64), yl.astype(np.float64)).astype(np.float16)
                hi = fn(xh.astype(np.float64), yh.astype(np.float64)).astype(np.float16)
            b.write(ins.args[0], _pack_halves(lo, hi), mask)
            return
        x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
        if t == "f16":            # exact in float64, rounded once to fp16
            with np.errstate(all="ignore"):
                r = fn(x.astype(np.float64), y.astype(np.float64)).astype(np.float16)
            b.write(ins.args[0], r, mask)
            return
        if t != "f32":
            raise PtxUnsupported(ins.op)
        if "ftz" in ins.parts:
            x, y = _ftz(x), _ftz(y)
        with np.errstate(all="ignore"):
            r = fn(x, y).astype(np.float32)
        if "ftz" in ins.parts:
            r = _ftz(r)
        if "sat" in ins.parts:
            r = np.clip(np.nan_to_num(r, nan=0.0), 0, 1).astype(np.float32)
        b.write(ins.args[0], r, mask)
    return h


_AS_FMA = {                       # a op b as an fma, for the directed rounding modes
    np.add: lambda x, y: (x, np.ones_like(x), y),
    np.subtract: lambda x, y: (x, np.ones_like(x), -y),
    np.multiply: lambda x, y: (x, y, np.zeros_like(x)),
}


def _is_float(t):
    return t[0] == "f"


def _add(b, ins, mask, active):
    t = _type(ins)
    return (_float_binary(np.add) if _is_float(t) else _int_binary(lambda x, y, t: x + y))(
        b, ins, mask, active)


def _sub(b, ins, mask, active):
    t = _type(ins)
    return (_float_binary(np.subtract) if _is_float(t) else
            _int_binary(lambda x, y, t: x - y))(b, ins, mask, active)


def _div(b, ins, mask, active):
    t = _type(ins)
    if _is_float(t):
        if t != "f32" or not ({"rn", "approx", "full"} & set(ins.parts)):
            raise PtxUnsupported(ins.op)
        return _float_binary(np.divide)(b, ins, mask, active)   # .rn exact; .approx/.full ~
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    if (y[mask] == 0).any():
        raise PtxError(f"integer division by zero: {ins.text}")
    y = np.where(y == 0, 1, y)
    q = np.trunc(x.astype(np.float64) / y.astype(np.float64)) if t[0] == "s" else x // y
    b.write(ins.args[0], q.astype(x.dtype), mask)


def _rem(b, ins, mask, active):
    t = _type(ins)
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    if (y[mask] == 0).any():
        raise PtxError(f"integer remainder by zero: {ins.text}")
    y = np.where(y == 0, 1, y)
    r = np.fmod(x, y) if t[0] == "s" else x % y
    b.write(ins.args[0], r.astype(x.dtype), mask)


def _wide_int(t):
    return np.int64 if t[0] == "s" else np.uint64


def _mul_int(x, y, mode, t):
    w = _WIDTH[t]
    if w == 64:
        if mode == "lo":
            return x * y
        raise PtxUnsupported(f"mul.{mode}.{t}")
    wide = x.astype(_wide_int(t)) * y.astype(_wide_int(t))
    if mode == "wide":
        return wide
    if mode == "hi":
        return (wide >> w).astype(x.dtype)
    return wide.astype(x.dtype)


def _mul(b, ins, mask, active):
    t = _type(ins)
    if _is_float(t):
        return _float_binary(np.multiply)(b, ins, mask, active)
    mode = ins.parts[1]
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    with np.errstate(over="ignore"):
        b.write(ins.args[0], _mul_int(x, y, mode, t), mask)


def _mad(b, ins, mask, active):
    t = _type(ins)
    mode = ins.parts[1]
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    with np.errstate(over="ignore"):
        p = _mul_int(x, y, mode, t)
        c = b.read(ins.args[3], t) if mode != "wide" else \
            b.read(ins.args[3], ("s" if t[0] == "s" else "u") + "64")
        b.write(ins.args[0], p + c, mask)


def _fma(b, ins, mask, active):
    t = _type(ins)
    if t == "f16x2":
        (al, ah), (bl, bh), (cl, ch) = (_halves(b.read(a, "b32")) for a in ins.args[1:4])
        with np.errstate(over="ignore", invalid="ignore"):      # overflow to inf, as PTX
            lo = (al.astype(np.float64) * bl + cl.astype(np.float64)).astype(np.float16)
            hi = (ah.astype(np.float64) * bh + ch.astype(np.float64)).astype(np.float16)
        b.write(ins.args[0], _pack_halves(lo, hi), mask)
        return
    if t != "f32":
        raise PtxUnsupported(ins.op)
    x, y, z = (b.read(a, "f32") for a in ins.args[1:4])
    if "ftz" in ins.parts:
        x, y, z = _ftz(x), _ftz(y), _ftz(z)
    mode = next((p for p in ins.parts if p in ("rn", "rz", "rm", "rp")), "rn")
    r = _fma_f32(x, y, z, mode)
    b.write(ins.args[0], _ftz(r) if "ftz" in ins.parts else r, mask)


def _minmax(fn_int, fn_f):
    def h(b, ins, mask, active):
        t = _type(ins)
        x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
        if _is_float(t):
            if "NaN" in ins.parts:
                r = fn_int(x, y)
            else:
                r = fn_f(x, y)
            b.write(ins.args[0], r.astype(x.dtype), mask)
        else:
            b.write(ins.args[0], fn_int(x, y), mask)
    return h


def _unary(fn):
    def h(b, ins, mask, active):
        t = _type(ins)
        x = b.read(ins.args[1], t)
        with np.errstate(all="ignore"):
            r = fn(x, t)
        if "ftz" in ins.parts:
            r = _ftz(r)
        b.write(ins.args[0], r, mask)
    return h


def _neg(x, t):
    if _is_float(t):
        return (-x).astype(x.dtype)
    return (0 - x.astype(np.int64)).astype(x.dtype)


def _abs(x, t):
    if _is_float(t):
        return np.abs(x)
    return np.abs(x.astype(np.int64)).astype(x.dtype)


def _approx(fn):
    def h(x, t):
        if t != "f32":
            raise PtxUnsupported(f"{fn} on .{t}")
        return fn(x.astype(np.float64)).astype(np.float32)
    return h


def _logic(fn):
    def h(b, ins, mask, active):
        t = _type(ins)
        if t == "pred":
            x, y = b.read(ins.args[1], "pred"), b.read(ins.args[2], "pred")
        else:
            x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
        b.write(ins.args[0], fn(x, y), mask)
    return h


def _not(b, ins, mask, active):
    t = _type(ins)
    x = b.read(ins.args[1], "pred" if t == "pred" else t)
    b.write(ins.args[0], ~x, mask)


def _shift(left: bool):
    def h(b, ins, mask, active):
        t = _type(ins)
        w = _WIDTH[t]
        x = b.read(ins.args[1], t)
        n = b.read(ins.args[2], "u32").astype(np.int64)
        big = n >= w
        nn = np.minimum(n, w - 1).astype(x.dtype if x.dtype.kind == "u" else np.int64)
        if left:
            r = np.where(big, 0, x << nn.astype(x.dtype))
        elif t[0] == "s":
            r = np.where(big, np.where(x < 0, -1, 0), x >> nn.astype(x.dtype))
        else:
            r = np.where(big, 0, x >> nn.astype(x.dtype))
        b.write(ins.args[0], r.astype(x.dtype), mask)
    return h


def _shf(b, ins, mask, active):
    lo = b.read(ins.args[1], "u32").astype(np.uint64)
    hi = b.read(ins.args[2], "u32").astype(np.uint64)
    n = b.read(ins.args[3], "u32").astype(np.uint64)
    n = n & np.uint64(31) if "wrap" in ins.parts else np.minimum(n, np.uint64(32))
    both = (hi << np.uint64(32)) | lo
    if ins.parts[1] == "l":
        r = ((both << n) >> np.uint64(32)) & np.uint64(0xFFFFFFFF)
    else:
        r = (both >> n) & np.uint64(0xFFFFFFFF)
    b.write(ins.args[0], r.astype(np.uint32), mask)


def _lop3(b, ins, mask, active):
    x, y, z = (b.read(a, "b32") for a in ins.args[1:4])
    lut = ins.args[4][1]
    r = np.zeros_like(x)
    for i in range(8):
        if lut >> i & 1:
            r |= (x if i & 4 else ~x) & (y if i & 2 else ~y) & (z if i & 1 else ~z)
    b.write(ins.args[0], r, mask)


def _prmt(b, ins, mask, active):
    if len(ins.parts) != 2:
        raise PtxUnsupported(ins.op)
    x, y, sel = (b.read(a, "b32").astype(np.uint64) for a in ins.args[1:4])
    both = (y << np.uint64(32)) | x
    r = np.zeros_like(x)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(nib & np.uint64(8), sign, byte)
        r |= byte << np.uint64(8 * i)
    b.write(ins.args[0], r.astype(np.uint32), mask)


def _dp4a(b, ins, mask, active):
    ta, tb = ins.parts[1], ins.parts[2]
    x, y = b.read(ins.args[1], "b32"), b.read(ins.args[2], "b32")
    acc = b.read(ins.args[3], "b32").astype(np.int64)
    xb = x.view(np.uint8).reshape(-1, 4).astype(np.int64)
    yb = y.view(np.uint8).reshape(-1, 4).astype(np.int64)
    if ta == "s32":
        xb = np.where(xb > 127, xb - 256, xb)
    if tb == "s32":
        yb = np.where(yb > 127, yb - 256, yb)
    r = (acc + (xb * yb).sum(1)) & 0xFFFFFFFF
    b.write(ins.args[0], r.astype(np.uint32), mask)


_CMP = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
    "hi": np.greater, "hs": np.greater_equal,
}


def _compare(cmp, x, y, t):
    if _is_float(t):
        nan = np.isnan(x) | np.isnan(y)
        if cmp == "num":
            return ~nan
        if cmp == "nan":
            return nan
        if cmp.endswith("u") and cmp[:-1] in _CMP:
            return _CMP[cmp[:-1]](x, y) | nan
        return _CMP[cmp](x, y) & (~nan if cmp != "ne" else ~nan)
    if cmp in ("lo", "ls", "hi", "hs"):
        x, y = x.view(_RAW[_WIDTH[t]]), y.view(_RAW[_WIDTH[t]])
    return _CMP[cmp](x, y)


def _setp(b, ins, mask, active):
    parts = ins.parts
    t = parts[-1]
    cmp = parts[1]
    boolop = parts[2] if parts[2] in ("and", "or", "xor") else None
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    r = _compare(cmp, x, y, t)
    dest = ins.args[0]
    q = None
    if dest[0] == "pair":
        dest, q = dest[1]
    if boolop:
        c = b.read(ins.args[3], "pred")
        f = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[boolop]
        r, rq = f(r, c), f(~r, c)
    else:
        rq = ~r
    b.write(dest, r, mask)
    if q is not None:
        b.write(q, rq, mask)


def _selp(b, ins, mask, active):
    t = _type(ins)
    x, y = b.read(ins.args[1], t), b.read(ins.args[2], t)
    c = b.read(ins.args[3], "pred")
    b.write(ins.args[0], np.where(c, x, y), mask)


def _mov(b, ins, mask, active):
    t = _type(ins)
    dst, src = ins.args
    if dst[0] == "vec":                            # unpack
        parts = dst[1]
        w = _WIDTH[t] // len(parts)
        bits = b.read(src, "b64" if _WIDTH[t] == 64 else "b32").astype(np.uint64)
        for i, p in enumerate(parts):
            v = (bits >> np.uint64(w * i)) & np.uint64((1 << w) - 1)
            b.write(p, v.astype(_RAW[w]), mask)
        return
    if src[0] == "vec":                            # pack
        parts = src[1]
        w = _WIDTH[t] // len(parts)
        r = np.zeros(b.L, np.uint64)
        for i, p in enumerate(parts):
            r |= b.read(p, f"b{w}").astype(np.uint64) << np.uint64(w * i)
        b.write(dst, r.astype(_RAW[_WIDTH[t]]), mask)
        return
    if t == "pred":
        b.write(dst, b.read(src, "pred"), mask)
        return
    b.write(dst, b.read(src, t), mask)


def _cvt(b, ins, mask, active):
    parts = [p for p in ins.parts[1:] if p not in ("rn", "rz", "rni", "rzi", "rmi", "rpi",
                                                   "ftz", "sat", "relu")]
    rnd = next((p for p in ins.parts[1:] if p in ("rn", "rz", "rni", "rzi", "rmi", "rpi")), None)
    dt, st = parts
    if dt == "f16x2" and st == "f32":
        hi, lo = b.read(ins.args[1], "f32"), b.read(ins.args[2], "f32")
        b.write(ins.args[0], _pack_halves(lo.astype(np.float16), hi.astype(np.float16)), mask)
        return
    if dt == "bf16x2" and st == "f32":
        hi, lo = b.read(ins.args[1], "f32"), b.read(ins.args[2], "f32")
        r = _f32_to_bf16_bits(lo).astype(np.uint32) | \
            (_f32_to_bf16_bits(hi).astype(np.uint32) << np.uint32(16))
        b.write(ins.args[0], r, mask)
        return
    if st == "bf16":
        x = _bf16_bits_to_f32(b.read(ins.args[1], "b16"))
    elif st == "f16":
        x = b.read(ins.args[1], "f16")
    else:
        x = b.read(ins.args[1], st)
    if dt == "bf16":
        if rnd not in (None, "rn"):
            raise PtxUnsupported(ins.op)
        r = _f32_to_bf16_bits(x.astype(np.float32))
    elif dt == "f16":
        if rnd not in (None, "rn"):
            raise PtxUnsupported(ins.op)
        r = x.astype(np.float16)
    elif dt in ("f32", "f64"):
        r = x.astype(np.float32 if dt == "f32" else np.float64)
        if "ftz" in ins.parts:
            r = _ftz(r)
        if "sat" in ins.parts:                      # clamp to [0, 1], NaN -> 0
            r = np.clip(np.nan_to_num(r, nan=0.0, posinf=1.0, neginf=0.0), 0, 1).astype(r.dtype)
    else:                                           # to an integer
        if _is_float(st):
            f = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}.get(rnd)
            if f is None:
                raise PtxUnsupported(ins.op)
            info = np.iinfo(_bits_to(np.zeros(1, _RAW[_WIDTH[dt]]), dt).dtype)
            with np.errstate(invalid="ignore"):
                r = np.clip(np.nan_to_num(f(x.astype(np.float64))), info.min, info.max)
            r = r.astype(np.int64)
        else:
            r = x.astype(np.int64) if st[0] == "s" else x.astype(np.uint64)
        r = _bits_to(r.astype(_RAW[_WIDTH[dt]]), dt)
    b.write(ins.args[0], r, mask)


_SPACES = ("global", "shared", "param", "local", "const")


def _space(ins):
    """The state space of a load / store: "shared::cluster" (addresses from mapa, decoded to
    a CTA of the cluster) apart from "shared" (and shared::cta: the executing CTA's)."""
    for p in ins.parts[1:]:
        if p == "shared::cluster":
            return p
        if p in _SPACES or p.split("::")[0] in _SPACES:
            return p.split("::")[0]
    return "generic"


def _vec(ins):
    for p in ins.parts:
        if p in ("v2", "v4", "v8"):
            return int(p[1:])
    return 1


def _address(b, memop, lanes):
    base, off = memop[1], memop[2]
    if base[0] == "sym":
        a = np.full(len(lanes), b.symbol(base[1]) if base[1] not in dict(b.e.params)
                    else 0, np.int64)
        return a + off
    if base[0] == "imm":
        return np.full(len(lanes), base[1] + off, np.int64)
    bits = b.reg(base[1])[lanes]
    if b.width(base[1]) == 64:                  # a 64-bit address wraps modulo 2^64
        return bits.astype(np.uint64) + np.uint64(off & 0xFFFFFFFFFFFFFFFF)
    return bits.astype(np.int64) + off          # a 32-bit (shared-window) address


def _access(ins, mask):
    """(state space, bytes per element, vector length, executing lanes) of a load / store."""
    return _space(ins), _WIDTH[_type(ins)] // 8, _vec(ins), np.nonzero(mask)[0]


def _ld(b, ins, mask, active):
    space, w, n, lanes = _access(ins, mask)
    dsts = ins.args[0][1] if ins.args[0][0] == "vec" else [ins.args[0]]
    if space == "param":
        name = ins.args[1][1][1]
        off = ins.args[1][2]
        pidx = [p[0] for p in b.e.params].index(name)
        start = sum(p[1] for p in b.e.params[:pidx]) + off
        raw = np.frombuffer(b.params[start:start + w * n], np.uint8)
        data = np.broadcast_to(raw, (len(lanes), w * n))
    elif space == "global":
        addr = _address(b, ins.args[1], lanes).astype(np.uint64)
        data = b.mem.load(addr, w * n, ins, ~b.waited[lanes])
    elif space == "shared":
        addr = _address(b, ins.args[1], lanes).astype(np.int64)
        cta, idx = b.smem_index(addr, w * n, ins, lanes)
        b.note_smem(cta, idx, lanes, False, ins)
        data = b.smem[cta[:, None], idx]
    elif space == "shared::cluster":
        addr = _address(b, ins.args[1], lanes).astype(np.int64)
        cta, idx, remote = b.dsmem_index(addr, w * n, ins, lanes)
        b.note_smem(cta, idx, lanes, False, ins, remote)
        data = b.smem[cta[:, None], idx]
    else:
        raise PtxUnsupported(f"{space} load: {ins.text}")
    if len(lanes) == 0:
        return
    vals = np.ascontiguousarray(data).view(_RAW[w * 8]).reshape(len(lanes), n)
    for i, d in enumerate(dsts):
        full = np.zeros(b.L, _RAW[w * 8])
        full[lanes] = vals[:, i]
        b.write(d, full, mask)


def _st(b, ins, mask, active):
    space, w, n, lanes = _access(ins, mask)
    if len(lanes) == 0:
        return
    srcs = ins.args[1][1] if ins.args[1][0] == "vec" else [ins.args[1]]
    vals = np.stack([_to_bits(b.read(s, f"b{w * 8}"), w * 8)[lanes] for s in srcs], 1)
    data = np.ascontiguousarray(vals).view(np.uint8).reshape(len(lanes), w * n)
    if space == "global":
        b.mem.store(_address(b, ins.args[0], lanes).astype(np.uint64), data, ins,
                    ~b.waited[lanes])
    elif space == "shared":
        addr = _address(b, ins.args[0], lanes).astype(np.int64)
        cta, idx = b.smem_index(addr, w * n, ins, lanes)
        b.note_smem(cta, idx, lanes, True, ins)
        b.smem[cta[:, None], idx] = data
    elif space == "shared::cluster":
        addr = _address(b, ins.args[0], lanes).astype(np.int64)
        cta, idx, remote = b.dsmem_index(addr, w * n, ins, lanes)
        b.note_smem(cta, idx, lanes, True, ins, remote)
        b.smem[cta[:, None], idx] = data
    else:
        raise PtxUnsupported(f"{space} store: {ins.text}")


def _bra(b, ins, mask, active):
    target = b.e.labels[ins.args[0][1]]
    b.pc[mask] = target
    b.pc += active & ~mask
    return True


def _ret(b, ins, mask, active):
    b.pc[mask] = _EXITED_PC
    b.pc += active & ~mask
    return True


def _bar(b, ins, mask, active):
    if ins.parts[0] == "barrier" or ins.parts[1] in ("sync", "red"):
        if not (mask == active).all():
            raise PtxUnsupported(f"predicated barrier: {ins.text}")
        barrier_id = ins.args[1][1] if ins.parts[1] == "red" else ins.args[0][1]
        if barrier_id != 0 or (ins.parts[1] != "red" and len(ins.args) > 1):
            raise PtxUnsupported(f"named or partial barrier: {ins.text}")
        b.barrier(mask, active)
        if ins.parts[1] == "red":
            if ins.parts[2] != "popc":
                raise PtxUnsupported(ins.op)
            p = b.read(ins.args[2], "pred") & mask
            counts = np.bincount(b.cta[p], minlength=b.nc)
            b.write(ins.args[0], counts[b.cta].astype(np.uint32), mask)
        return
    if ins.parts[1:3] == ["warp", "sync"]:
        # Full-warp member mask only; the lanes of a warp already run in step here.
        members = b.read(ins.args[0], "b32")[mask]
        if (members != 0xFFFFFFFF).any():
            raise PtxUnsupported(f"partial member mask: {ins.text}")
        b.full_warps(mask, "bar.warp.sync")
        return
    raise PtxUnsupported(ins.op)


def _bar_cluster(b, ins, mask, active):
    """barrier.cluster.arrive[.relaxed|.release][.aligned] / barrier.cluster.wait[.acquire]
    [.aligned]: each thread alternates arrive and wait; a wait returns once every thread of
    the cluster has arrived in its phase (a release arrive + the wait order all their
    accesses before it; a relaxed arrive orders nothing)."""
    kind, sem = ins.parts[2], set(ins.parts[3:])
    allowed = {"arrive": {"relaxed", "release", "aligned"}, "wait": {"acquire", "aligned"}}
    if kind not in allowed or not sem <= allowed[kind] or {"relaxed", "release"} <= sem:
        raise PtxUnsupported(ins.op)
    if not (mask == active).all():
        raise PtxUnsupported(f"predicated barrier: {ins.text}")
    if "aligned" in sem:
        b.full_warps(mask, ins.op)
    lanes = np.nonzero(mask)[0]
    if kind == "arrive":
        b.cluster_arrive(lanes, "relaxed" not in sem, ins)
    else:
        b.cluster_wait(lanes, ins)


def _barrier(b, ins, mask, active):
    if ins.parts[1] == "cluster":
        return _bar_cluster(b, ins, mask, active)
    return _bar(b, ins, mask, active)


def _mapa(b, ins, mask, active):
    """mapa.shared::cluster.u32 d, a, rank: shared address a's offset in CTA ``rank`` of the
    cluster, as a shared::cluster address (rank + 1 in bits 24..)."""
    if ins.op not in ("mapa.shared::cluster.u32", "mapa.shared::cluster.b32"):
        raise PtxUnsupported(ins.op)
    a = b.read(ins.args[1], "u32")
    rank = b.read(ins.args[2], "u32")
    bad = mask & (a >> np.uint32(_RANK_SHIFT) > b.csize)
    if bad.any():
        raise PtxError(f"mapa of {int(a[bad][0]):#x}, not a shared address: {ins.text}")
    bad = mask & (rank >= b.csize)
    if bad.any():
        raise PtxError(f"mapa to CTA rank {int(rank[bad][0])} of a cluster of {b.csize} CTAs "
                       f"(%cluster_nctarank): {ins.text}")
    d = (a & np.uint32(_OFFSET_MASK)) | ((rank + np.uint32(1)) << np.uint32(_RANK_SHIFT))
    b.write(ins.args[0], d, mask)


def _shfl(b, ins, mask, active):
    mode = ins.parts[2]
    b.full_warps(mask, "shfl.sync")          # all 32 lanes, as the full member mask says
    if ins.args[4][0] != "imm" or ins.args[4][1] & 0xFFFFFFFF != 0xFFFFFFFF:
        raise PtxUnsupported(f"partial shfl mask: {ins.text}")
    a = b.read(ins.args[1], "b32")
    bval = b.read(ins.args[2], "u32").astype(np.int64) & 31
    c = b.read(ins.args[3], "u32").astype(np.int64)
    lane = b.lane.astype(np.int64)
    seg = (c >> 8) & 31
    cval = c & 31
    max_lane = (lane & seg) | (cval & ~seg)
    min_lane = lane & seg
    if mode == "bfly":
        j = lane ^ bval
        ok = j <= max_lane
    elif mode == "idx":
        j = min_lane | (bval & ~seg)
        ok = j <= max_lane
    elif mode == "up":
        j = lane - bval
        ok = j >= max_lane
    elif mode == "down":
        j = lane + bval
        ok = j <= max_lane
    else:
        raise PtxUnsupported(ins.op)
    j = np.where(ok, j, lane)
    src = b.gwarp * 32 + j
    dest = ins.args[0]
    p = None
    if dest[0] == "pair":
        dest, p = dest[1]
    b.write(dest, a[src], mask)
    if p is not None:
        b.write(p, ok, mask)


def _match(b, ins, mask, active):
    """match.any.sync.b32 d, a, membermask (full warps, full mask): d = the lanes of this
    lane's warp whose a equals its a."""
    if ins.parts[1:] != ["any", "sync", "b32"]:
        raise PtxUnsupported(ins.op)
    b.full_warps(mask, "match.any.sync")
    if ins.args[2][0] != "imm" or ins.args[2][1] & 0xFFFFFFFF != 0xFFFFFFFF:
        raise PtxUnsupported(f"partial match mask: {ins.text}")
    a = b.read(ins.args[1], "b32").astype(np.int64)
    base = b.gwarp * 32
    warp_vals = a[base[:, None] + np.arange(32)[None, :]]               # [lanes, 32]
    bits = (warp_vals == a[:, None]).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    b.write(ins.args[0], bits.sum(axis=1).astype(np.uint32), mask)


def _popc(b, ins, mask, active):
    t = _type(ins)
    if t not in ("b32", "b64"):
        raise PtxUnsupported(ins.op)
    x = b.read(ins.args[1], t).astype(np.uint64)
    n = np.zeros(x.shape, np.uint32)
    for i in range(_WIDTH[t]):
        n += ((x >> np.uint64(i)) & np.uint64(1)).astype(np.uint32)
    b.write(ins.args[0], n, mask)


def _imma_u8(b, ins, mask, warps, lanes, regs):
    """mma.sync m16n8k32 u8 x u8 + s32 (exact integer sums, wrapping as the s32 adder)."""
    d_ops, a_ops, b_ops, c_ops = (a[1] for a in ins.args)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    W = len(warps)
    ar, br, cr = regs(a_ops), regs(b_ops), regs(c_ops)

    def bytes_of(r):
        return [(r >> np.uint32(8 * j)) & np.uint32(0xFF) for j in range(4)]

    A = np.zeros((W, 16, 32), np.int64)
    B = np.zeros((W, 32, 8), np.int64)
    for i, (row, k0) in enumerate([(g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t),
                                   (g + 8, 16 + 4 * t)]):
        for j, v in enumerate(bytes_of(ar[..., i])):
            A[:, row, k0 + j] = v
    for i, k0 in enumerate([4 * t, 16 + 4 * t]):
        for j, v in enumerate(bytes_of(br[..., i])):
            B[:, k0 + j, g] = v
    C = np.zeros((W, 16, 8), np.int64)
    pos = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
    for i, (row, col) in enumerate(pos):
        C[:, row, col] = cr[..., i].astype(np.int32)
    D = (np.einsum("wmk,wkn->wmn", A, B) + C) & 0xFFFFFFFF
    for i, (row, col) in enumerate(pos):
        full = np.zeros(b.L, np.uint32)
        full[lanes] = D[:, row, col].ravel().astype(np.uint32)
        b.write(d_ops[i], full, mask)


def _mma(b, ins, mask, active):
    if ins.op not in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32"):
        raise PtxUnsupported(ins.op)
    warps = b.full_warps(mask, "mma.sync")
    d_ops, a_ops, b_ops, c_ops = (a[1] for a in ins.args)
    lanes = (warps[:, None] * 32 + np.arange(32)).ravel()
    g, t = np.arange(32) // 4, np.arange(32) % 4
    W = len(warps)

    def regs(ops):
        return np.stack([b.read(o, "b32")[lanes].reshape(W, 32) for o in ops], -1)

    if ".u8." in ins.op:
        return _imma_u8(b, ins, mask, warps, lanes, regs)
    ar, br = regs(a_ops), regs(b_ops)
    cr = np.stack([b.read(o, "f32")[lanes].reshape(W, 32) for o in c_ops], -1)
    A = np.zeros((W, 16, 16))
    B = np.zeros((W, 16, 8))
    for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                    (g + 8, 2 * t + 8)]):
        lo, hi = _halves(ar[..., i])
        A[:, row, col] = lo
        A[:, row, col + 1] = hi
    for i, krow in enumerate([2 * t, 2 * t + 8]):
        lo, hi = _halves(br[..., i])
        B[:, krow, g] = lo
        B[:, krow + 1, g] = hi
    C = np.zeros((W, 16, 8))
    for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                    (g + 8, 2 * t + 1)]):
        C[:, row, col] = cr[..., i]
    D = (np.einsum("wmk,wkn->wmn", A, B) + C).astype(np.float32)
    for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                    (g + 8, 2 * t + 1)]):
        full = np.zeros(b.L, np.float32)
        full[lanes] = D[:, row, col].ravel()
        b.write(d_ops[i], full, mask)


def _wgmma_offsets(desc: int, n: int) -> np.ndarray:
    """Shared byte offsets of an operand [n, k] (n x 16 fp16, K-major: B with n its N, or A with
    n = 64) read through a wgmma matrix descriptor with the 128-byte swizzle (PTX ISA, "Matrix
    Descriptor Format" and the canonical K-major layouts). Only the layouts the kernels build
    are accepted."""
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    base_offset = (desc >> 49) & 7
    swizzle = (desc >> 62) & 3
    if swizzle != 1 or base_offset != 0:
        raise PtxUnsupported(f"wgmma descriptor swizzle {swizzle}, base offset {base_offset}")
    del lbo                    # unused by swizzled K-major layouts whose k16 fits in a row
    rows = np.arange(n)[:, None]
    k = np.arange(16)[None, :]
    addr = start + (rows // 8) * sbo + (rows % 8) * 128 + k * 2
    chunk = ((addr >> 4) & 7) ^ ((addr >> 7) & 7)
    return (addr & ~0x70) | (chunk << 4)


def _wgmma(b, ins, mask, active):
    kind = ins.parts[1]
    if kind == "fence":
        for wg in b.warpgroups(mask).tolist():
            b.fence_dirty[wg] = set()
        return
    if kind == "commit_group":
        b.full_warps(mask, "wgmma.commit_group")
        for wg in b.warpgroups(mask).tolist():
            b.wgmma_open[wg] += 1
        return
    if kind == "wait_group":
        b.full_warps(mask, "wgmma.wait_group")
        keep = ins.args[0][1]
        wgs = set(b.warpgroups(mask).tolist())
        still = []
        for w in b.wgmma_inflight:
            wg = int(w.lanes[0]) // 128             # w.lanes: one whole warpgroup
            if wg in wgs and w.group < b.wgmma_open[wg] - keep:
                continue
            still.append(w)
        b.wgmma_inflight = still
        return
    if kind != "mma_async":
        raise PtxUnsupported(ins.op)
    m = re.fullmatch(r"m64n(\d+)k16", ins.parts[4])
    if not m or ins.parts[5:] != ["f32", "f16", "f16"]:
        raise PtxUnsupported(ins.op)
    n = int(m.group(1))
    # A from registers (a vector of 4: "RS") or through a descriptor like B ("SS")
    a_smem = ins.args[1][0] != "vec"
    d_ops, a_ops = ins.args[0][1], (None if a_smem else ins.args[1][1])
    desc_op, scale_d_op = ins.args[2], ins.args[3]
    if [a[1] for a in ins.args[4:]] != ([1, 1, 0, 0] if a_smem else [1, 1, 0]):
        raise PtxUnsupported(f"wgmma scale/transpose immediates: {ins.text}")
    warps = b.full_warps(mask, "wgmma.mma_async")
    wg_of = np.arange(b.L) // 128                  # a lane's batch index is cta * nt + thread
    groups = np.unique(wg_of[warps * 32])
    for wg in groups.tolist():
        lanes = np.nonzero(wg_of == wg)[0]
        if len(lanes) != 128 or not mask[lanes].all():
            raise PtxError("wgmma.mma_async issued by part of a warpgroup")
        regs = set(_operand_regs(ins.args[0])) | (set() if a_smem else
                                                  set(_operand_regs(ins.args[1])))
        dirty = b.fence_dirty[wg] & regs
        if dirty:
            raise PtxError(f"register {sorted(dirty)[0]} written since the last wgmma.fence "
                           f"before a wgmma reads it: {ins.text}")
        descs = b.read(desc_op, "b64")[lanes]
        if (descs != descs[0]).any():
            raise PtxError("wgmma descriptor differs across the warpgroup")
        offs = _wgmma_offsets(int(descs[0]), n)
        if a_smem:
            a_descs = b.read(ins.args[1], "b64")[lanes]
            if (a_descs != a_descs[0]).any():
                raise PtxError("wgmma A descriptor differs across the warpgroup")
            a_offs = _wgmma_offsets(int(a_descs[0]), 64)
        cta = int(b.cta[lanes[0]])
        read = np.concatenate([offs.ravel()] + ([a_offs.ravel()] if a_smem else []))
        if read.min() < 0 or read.max() + 2 > b.smem_size:
            raise PtxError(f"wgmma reads shared memory out of bounds: {ins.text}")
        idx = (read[:, None] + np.arange(2)).reshape(-1)
        if b.check_races:
            if (b.unfenced[cta, idx] > 0).any():
                raise PtxError("wgmma reads shared bytes written without a fence.proxy.async: "
                               + ins.text)
            if (b.pending_cp[cta, idx] > 0).any():
                raise PtxError(f"wgmma reads shared bytes before their cp.async landed: "
                               f"{ins.text}")
            # Strict: the async proxy reads for the whole warpgroup, so every byte it reads
            # must have been written before the CTA's last barrier.
            if (b.writer[cta, idx] >= 0).any():
                raise PtxError("shared-memory race: wgmma reads bytes written since the CTA's "
                               f"last barrier: {ins.text}")
            warps_here = np.unique(b.warp_id[lanes])
            rd = b.reader[cta, idx]
            several = -2 if not b.foreign[cta] else \
                b.several_readers(np.array([cta]), rd, len(idx), None)
            b.reader[cta, idx] = np.where(rd == -1, int(warps_here[0]), several)
        Bm = b.smem[cta][offs.ravel()[:, None] + np.arange(2)].reshape(n, 16, 2)
        Bm = np.ascontiguousarray(Bm).view(np.float16).reshape(n, 16).astype(np.float64)
        g, t = np.arange(32) // 4, np.arange(32) % 4
        if a_smem:           # A [64, 16] from shared memory; warp w's rows are 16w..16w+15
            A = b.smem[cta][a_offs.ravel()[:, None] + np.arange(2)].reshape(64, 16, 2)
            A = np.ascontiguousarray(A).view(np.float16).reshape(4, 16, 16).astype(np.float64)
        else:                # A: warp w of the group holds rows 16w.. in mma.sync's A layout
            ar = np.stack([b.read(o, "b32")[lanes].reshape(4, 32) for o in a_ops], -1)
            A = np.zeros((4, 16, 16))
            for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                            (g + 8, 2 * t + 8)]):
                lo, hi = _halves(ar[..., i])
                A[:, row, col] = lo
                A[:, row, col + 1] = hi
        scale_d = b.read(scale_d_op, "pred")[lanes] if scale_d_op[0] != "imm" else \
            np.full(128, bool(scale_d_op[1]))
        if (scale_d != scale_d[0]).any():
            raise PtxError("wgmma scale-d differs across the warpgroup")
        acc = np.stack([b.read(o, "f32")[lanes].reshape(4, 32) for o in d_ops], -1)
        C = np.zeros((4, 16, n))
        pos = []
        for j in range(n // 8):
            for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                            (g + 8, 2 * t + 1)]):
                pos.append((row, 8 * j + col))
        if scale_d[0]:
            for i, (row, col) in enumerate(pos):
                C[:, row, col] = acc[..., i]
        D = (np.einsum("wmk,nk->wmn", A, Bm) + C).astype(np.float32)
        for i, (row, col) in enumerate(pos):
            full = b.reg(d_ops[i][1]).copy()
            full[lanes] = D[:, row, col].ravel().view(np.uint32)
            np.copyto(b.reg(d_ops[i][1]), full)
        b.wgmma_inflight.append(_Wgmma(lanes, b.wgmma_open[wg],
                                       frozenset() if a_smem else
                                       frozenset(_operand_regs(ins.args[1])),
                                       frozenset(_operand_regs(ins.args[0])),
                                       cta * b.smem_stride + idx))


def _cp(b, ins, mask, active):
    op = ins.op
    lanes = np.nonzero(mask)[0]
    if op == "cp.async.cg.shared.global" or op == "cp.async.ca.shared.global":
        size = ins.args[2][1]
        if len(ins.args) > 3:
            raise PtxUnsupported(f"cp.async with src-size: {ins.text}")
        dst = _address(b, ins.args[0], lanes).astype(np.int64)
        src = _address(b, ins.args[1], lanes).astype(np.uint64)
        data = b.mem.load(src, size, ins, ~b.waited[lanes])
        cta, idx = b.smem_index(dst, size, ins, lanes)
        b.note_smem(cta, idx, lanes, True, ins)
        b.writer[cta[:, None], idx] = -1          # lands later, as the waiting thread's write
        b.pending_cp[cta[:, None], idx] += 1
        b.cp_records.append(_CpAsync(lanes, b.cp_commits[lanes].copy(), cta, idx, data))
        return
    if op == "cp.async.commit_group":
        b.cp_commits[lanes] += 1
        return
    if op in ("cp.async.wait_group", "cp.async.wait_all"):
        keep = ins.args[0][1] if op == "cp.async.wait_group" else 0
        landed = np.zeros(b.L, bool)
        landed[lanes] = True
        still = []
        for r in b.cp_records:
            done = landed[r.lane] & ((r.seq < b.cp_commits[r.lane] - keep) |
                                     (op == "cp.async.wait_all"))
            if done.any():
                c, i = r.cta[done], r.dst[done]
                b.pending_cp[c[:, None], i] -= 1
                b.smem[c[:, None], i] = r.data[done]
                if b.check_races:
                    b.writer[c[:, None], i] = b.warp_id[r.lane[done]][:, None]
                    b.unfenced[c[:, None], i] = r.lane[done][:, None] + 1
            if (~done).any():
                still.append(_CpAsync(r.lane[~done], r.seq[~done], r.cta[~done],
                                      r.dst[~done], r.data[~done]))
        b.cp_records = still
        return
    raise PtxUnsupported(op)


def _fence(b, ins, mask, active):
    if ins.op.startswith("fence.proxy.async"):
        # The fencing threads' own generic-proxy writes (unfenced holds the writer's lane + 1)
        # in their CTA's window, or in every window of their cluster unless .shared::cta.
        group = 1 if "shared::cta" in ins.parts else b.csize
        lanes = np.nonzero(mask)[0]
        rows = b.cta[lanes] // group
        for g in np.unique(rows).tolist():
            block = b.unfenced[g * group:(g + 1) * group]
            block[np.isin(block, lanes[rows == g] + 1)] = 0
        return
    if ins.op in ("fence.acq_rel.gpu", "fence.sc.gpu"):
        return
    raise PtxUnsupported(ins.op)


def _griddepcontrol(b, ins, mask, active):
    if ins.parts[1] == "wait":          # every earlier launch has completed and is visible
        b.waited[mask] = True
    elif ins.parts[1] != "launch_dependents":
        raise PtxUnsupported(ins.op)


_HANDLERS = {
    "add": _add, "sub": _sub, "mul": _mul, "mad": _mad, "fma": _fma, "div": _div, "rem": _rem,
    "min": _minmax(np.minimum, np.fmin), "max": _minmax(np.maximum, np.fmax),
    "neg": _unary(_neg), "abs": _unary(_abs),
    "ex2": _unary(_approx(np.exp2)), "lg2": _unary(_approx(np.log2)),
    "rcp": _unary(_approx(lambda x: 1.0 / x)), "sqrt": _unary(_approx(np.sqrt)),
    "rsqrt": _unary(_approx(lambda x: 1.0 / np.sqrt(x))),
    "and": _logic(np.bitwise_and), "or": _logic(np.bitwise_or), "xor": _logic(np.bitwise_xor),
    "not": _not, "shl": _shift(True), "shr": _shift(False), "shf": _shf, "lop3": _lop3,
    "prmt": _prmt, "dp4a": _dp4a, "setp": _setp, "selp": _selp, "mov": _mov, "cvt": _cvt,
    "ld": _ld, "st": _st, "bra": _bra, "ret": _ret, "exit": _ret, "bar": _bar,
    "barrier": _barrier, "mapa": _mapa, "shfl": _shfl, "mma": _mma, "wgmma": _wgmma,
    "cp": _cp, "fence": _fence,
    "griddepcontrol": _griddepcontrol, "match": _match, "popc": _popc,
}


def _cluster_order(grid, cluster) -> list:
    """The CTAs of ``grid``, cluster by cluster (clusters x-fastest), each cluster's CTAs in
    rank order (x-fastest): without clusters, the CTAs x-fastest."""
    n = [g // c for g, c in zip(grid, cluster)]
    cx, cy, cz = cluster
    return [(X * cx + x, Y * cy + y, Z * cz + z)
            for Z in range(n[2]) for Y in range(n[1]) for X in range(n[0])
            for z in range(cz) for y in range(cy) for x in range(cx)]


def launch(module: PtxModule, kernel: str, grid, block, args: list[int], memory: GlobalMemory,
           smem_bytes: int, *, check_races: bool = True, max_lanes: int = 4096,
           max_steps: int = 5_000_000, launch_id: int = 0, unordered=(), cluster=None,
           counts=None):
    """Run ``kernel`` of ``module`` over ``grid`` x ``block`` threads. ``args``: one 64-bit
    value per kernel parameter (a buffer address from ``memory.alloc`` for a tensor), written
    at the start of each parameter's bytes. CTAs run in batches of up to ``max_lanes``
    threads (shared memory and barriers are per CTA within a batch), made of whole clusters
    (``cluster``: its dims, None for (1, 1, 1); at least one cluster a batch). ``launch_id``: this
    launch's number in its stream; ``unordered``: the numbers of earlier launches that may
    still run beside it (a programmatic dependent launch): its threads may touch their bytes
    only after griddepcontrol.wait. ``counts``: a dict to which the launch adds the
    warp-instructions it issues, by instruction (``_Batch.run``): PTX, not SASS (ptxas
    schedules, folds and expands), so a measure of a kernel change's issue work, not time."""
    memory.launch_id, memory.unordered = launch_id, frozenset(unordered)
    entry = module.entry(kernel)
    if len(args) != len(entry.params):
        raise ValueError(f"{kernel}: {len(entry.params)} parameters, {len(args)} given")
    params = bytearray()
    for (name, nbytes), value in zip(entry.params, args):
        chunk = bytearray(nbytes)
        chunk[:8] = int(value).to_bytes(8, "little")
        params += chunk[:nbytes]
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    nt = block[0] * block[1] * block[2]
    cluster = (1, 1, 1) if cluster is None else tuple(int(c) for c in cluster) + \
        (1,) * (3 - len(cluster))
    if any(c < 1 or g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"{kernel}: grid {grid} is not divisible by the cluster {cluster}")
    ctas = _cluster_order(grid, cluster)
    csize = cluster[0] * cluster[1] * cluster[2]
    per = max(1, max_lanes // (nt * csize)) * csize
    for i in range(0, len(ctas), per):
        batch = _Batch(entry, memory, bytes(params), ctas[i:i + per], block, grid, smem_bytes,
                       check_races, cluster)
        try:
            batch.run(max_steps, counts)
        except PtxError as e:
            raise PtxError(f"{kernel} (grid {grid}, block {block}, CTAs {ctas[i]}.."
                           f"{ctas[min(i + per, len(ctas)) - 1]}): {e}") from None
