"""Scaffolding shared by the benchmark scripts (gpu_e2e_decode.py, gpu_ttft.py; run metadata
and the JSON writer also by the CPU ones, bench_scale_search.py, profile_default_build.py).

Run metadata (date, command line, versions), a timer that wraps a library entry point in place
(CuTe DSL kernel compiles, AOT artifact loads), one timed generate call, an atomic JSON writer,
and a scoped environment switch (the kernels read their EXL3_JAX_* switches at trace time). Imported as a sibling module: ``python scripts/<script>.py`` puts scripts/ on sys.path.
Nothing here touches a device at import time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    """$name set to ``value`` (None: unset) inside the block, the caller's setting restored
    after, also on an exception."""
    saved = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_metadata(script_file: str, argv: list[str] | None) -> dict:
    """{"date", "command"} of a script run; ``argv`` None means the process's own arguments."""
    args = sys.argv[1:] if argv is None else argv
    return {"date": utc_now(),
            "command": f"python scripts/{Path(script_file).name} " + " ".join(args)}


def versions() -> dict:
    """exl3_jax.ffi.bench.versions() (jax, python, date, CuTe DSL, device) plus jaxlib, flax and
    the platform. Initialises jax's default backend (it asks for the device)."""
    from importlib import metadata

    from exl3_jax.ffi import bench
    out = bench.versions()
    out["platform"] = platform.platform()
    for dist in ("jaxlib", "flax"):
        try:
            out[dist] = metadata.version(dist)
        except Exception:
            out[dist] = None
    return out


def hlo_kernels(fn, *args) -> list[str]:
    """The fusions and custom calls of jit(fn)'s optimized HLO on these arguments, as
    "fusion:<kind> <shape>" / "custom-call:<target> <shape>" (what a probe compiles to)."""
    import jax
    return kernels_in_hlo(jax.jit(fn).lower(*args).compile().as_text())


def kernels_in_hlo(text: str) -> list[str]:
    """hlo_kernels of an optimized-HLO text. A result may be a tuple, "(f32[..]{..}, s8[..]{0})"
    (cuBLAS's output and workspace, a multi-output fusion)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = (\([^()]*\)|\S+) (fusion|custom-call)\(.*?"
                     r"(?:kind=(\w+)|custom_call_target=\"([^\"]+)\")", line)
        if m:
            out.append(f"{m[2]}:{m[3] or m[4]} {m[1]}")
    return out


class CallTimer:
    """Replaces ``module.<name>`` by a wrapper that adds the seconds spent inside it to
    ``self.seconds`` (every call, whatever it returns or raises)."""

    def __init__(self, module, name: str):
        self.seconds = 0.0
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(module, name, timed)


def cute_compile_timer() -> CallTimer | None:
    """Times cutlass.jax's kernel compile entry point (CuTe tracing + compile, cache hits
    included); None where CuTe DSL is not importable."""
    try:
        import cutlass.jax.primitive as cjp
    except Exception:
        return None
    return CallTimer(cjp, "get_or_compile_kernel")


def cute_kernels_compiled() -> int | None:
    """Kernels in cutlass.jax's compile cache (None where it cannot be read)."""
    try:
        import cutlass.jax.compile as cjc
        return len(cjc._CUTLASS_COMPILE_CACHE)
    except Exception:
        return None


def timed_generate(gen, prompts: list[list[int]], new: int) -> tuple[float, list]:
    """(seconds, tokens [B][new]) of one Generator.generate with stop tokens disabled (the
    results are fetched to the host, so the time is synchronised)."""
    t0 = time.perf_counter()
    out = gen.generate(prompts, max_new_tokens=new, stop_tokens=[])
    return time.perf_counter() - t0, out.tokens


def write_json(path: str | os.PathLike, obj: dict) -> None:
    """Write ``obj`` as indented JSON, atomically (a temporary file, then a rename), creating
    the parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
