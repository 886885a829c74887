"""Ahead-of-time export of the Trellis GEMM with jax.export, and loading the artifacts.

Exporting needs no GPU: with CUTE_DSL_ARCH=sm_90a (or sm_120a) set *before cutlass is first
imported* (the DSL reads it once per process; without it, a CPU machine silently builds sm_100a),
``jax.export(..., platforms=["cuda"])`` runs cutlass_call's lowering, which compiles the CuTe
kernels and embeds their object code in the StableHLO. Running an artifact needs jax and the FFI
handlers of ``libcute_dsl_runtime.so`` only (``register_runtime``), not the CuTe compiler.

As a module it is also the compile-only check used by CI in a fresh process per arch:

  CUTE_DSL_ARCH=sm_90a python -m exl3_jax.ffi.aot --check '[["mcg", 3, 1, "decode"], ...]'
  (a case is [codebook, K, m, plan] on a 256x256 linear, or [codebook, K, m, plan, k, n])

prints one JSON line per case (custom-call target present, embedded cubin SM, sizes, seconds).

Using artifacts in a model (generate, benchmarks): set ``EXL3_JAX_AOT_DIR`` to a directory written
by scripts/build_aot.py. ``exl3_jax.ffi.trellis_gemm.trellis_matmul_gpu`` then looks every linear
up by ``linear_key`` (shape, K, codebook, m, activation dtype, bias, transforms, launch plan) and
calls the matching artifact (``Exported.call``, inlined into the caller's jit) instead of compiling
the CuTe kernels. A miss compiles just in time when CuTe DSL is importable, else raises. The FFI
handlers are registered on first use: through cutlass.jax when it is importable, else from
``$CUTE_DSL_RUNTIME_LIBRARY`` (libcute_dsl_runtime.so alone, no CuTe compiler in the process).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import importlib.util
import json
import os
import struct
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp

ARCH_ENV = "CUTE_DSL_ARCH"
AOT_DIR_ENV = "EXL3_JAX_AOT_DIR"
RUNTIME_LIBRARY_ENV = "CUTE_DSL_RUNTIME_LIBRARY"
MANIFEST = "manifest.json"
CUSTOM_CALL_PREFIX = "CuteDSLRT_NvJaxCutlassCall"

# FFI targets and types of libcute_dsl_runtime.so for jax >= 0.9.1 (FFI v2): names of the
# library's exported handler symbols (jax_gpu_paths.md 3.3).
_RUNTIME_TARGETS_V2 = {
    "CuteDSLRT_NvJaxCutlassCall_v2": {
        "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v2",
        "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
        "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2"},
    "CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v2": {
        "execute": "CuteDSLRT_NvJaxCutlassCallExecuteNoCudaGraph_v2",
        "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
        "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2"},
}
_RUNTIME_TYPES_V2 = {"CuteDSLRT_NvJaxCutlassCallTypes_v2": {
    "type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
    "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2"}}


def configured_arch() -> str | None:
    return os.environ.get(ARCH_ENV) or None


def disabled_checks():
    import cutlass.jax
    return cutlass.jax.get_export_disabled_safety_checks()


def resolve_plan(m: int, k: int, n: int, plan=None, *, sms: int | None = None,
                 codebook: str | None = None):
    """The TrellisPlan an artifact is built for: ``plan`` itself, select_plan with a forced
    kind (or None = auto) for ``sms`` SMs (default: the H200's 132, the plans' DEFAULT_SMS),
    the configured arch and ``codebook``, or for "kind:tiling" (e.g. "wgmma:128,2,1,1") that
    kind with that tiling (plans.tiled_plan)."""
    from exl3_jax.ops.plans import DEFAULT_SMS, TrellisPlan, select_plan, tiled_plan
    if isinstance(plan, TrellisPlan):
        return plan
    if isinstance(plan, str) and ":" in plan:
        kind, tiling = plan.split(":", 1)
        return tiled_plan(kind, m, k, n, tiling)
    return select_plan(m, k, n, sms=sms or DEFAULT_SMS, force=plan,
                       hopper=configured_arch() == "sm_90a", codebook=codebook)


def linear_key(k: int, n: int, K, codebook: str, m: int, x_dtype, bias: bool, plan,
               transforms: str = "cute") -> str:
    """Identity of one exported linear call: everything that changes its StableHLO.

    plan: the TrellisPlan (every field is part of the key, so an artifact built for another SM
    count or plan heuristic is not used)."""
    fields = ",".join(f"{f.name}={getattr(plan, f.name)}" for f in dataclasses.fields(plan))
    return (f"{k}x{n}|K={K}|{codebook}|m={m}|{jnp.dtype(x_dtype).name}|bias={int(bool(bias))}|"
            f"{transforms}|{fields}")


def export_linear(k: int, n: int, K, codebook: str, m: int, plan=None, x_dtype=jnp.bfloat16,
                  bias: bool = False, *, sms: int | None = None, transforms: str = "cute"):
    """jax.export of y = trellis_matmul_gpu(x[m, k], W) for platforms=["cuda"].

    The exported function takes flat arrays (x, trellis, suh, svh[, bias]) so the artifact
    serializes without registering Exl3Weight's pytree with jax.export.
    Returns (Exported, linear_key)."""
    from jax import export

    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight

    from . import trellis_gemm as tg

    if os.environ.get(AOT_DIR_ENV):
        raise RuntimeError(f"unset {AOT_DIR_ENV} while exporting (it would embed artifacts)")
    tplan = resolve_plan(m, k, n, plan, sms=sms, codebook=codebook)

    def fn(x, trellis, suh, svh, *b):
        w = Exl3Weight(trellis=trellis, suh=suh, svh=svh, bias=b[0] if b else None,
                       codebook=codebook, K=K, in_features=k, out_features=n)
        return tg.trellis_matmul_gpu(x, w, plan=tplan, transforms=transforms)

    sds = jax.ShapeDtypeStruct
    args = [sds((m, k), x_dtype), sds((k // 16, n // 16, width_from_rate(K)), jnp.int16),
            sds((k,), jnp.float16), sds((n,), jnp.float16)] + ([sds((n,), jnp.float16)]
                                                               if bias else [])
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks())(
        *args)
    return exp, linear_key(k, n, K, codebook, m, x_dtype, bias, tplan, transforms)


def export_group(k: int, members, K, codebook: str, m: int, x_dtype=jnp.bfloat16):
    """jax.export of a linear group's decode call (trellis_gemm.trellis_matmul_group: members
    of out sizes ``members`` reading one x [m, k], member 0 with a bias) for platforms=["cuda"];
    compile-only checks
    (groups have no artifacts: generate uses them only where the kernels compile in-process)."""
    from jax import export

    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight

    from . import trellis_gemm as tg

    tplan = resolve_plan(m, k, sum(members), "decode", codebook=codebook)

    def fn(x, bias0, *flat):          # member 0 has a bias, the others none
        ws = [Exl3Weight(trellis=t, suh=u, svh=v, bias=None if i else bias0,
                         codebook=codebook, K=K, in_features=k, out_features=n)
              for i, ((t, u, v), n) in enumerate(zip(zip(*[iter(flat)] * 3), members))]
        return tg.trellis_matmul_group(x, ws, tplan)

    sds = jax.ShapeDtypeStruct
    args = [sds((m, k), x_dtype), sds((members[0],), jnp.float16)]
    for n in members:
        args += [sds((k // 16, n // 16, width_from_rate(K)), jnp.int16), sds((k,), jnp.float16),
                 sds((n,), jnp.float16)]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks())(
        *args)


def cubin_sms(blob: bytes) -> set[int]:
    """SM numbers of the CUDA ELF images (e_machine 190) embedded in ``blob``.

    The SM sits in e_flags' low byte (older ELF ABI) or its second byte (newer ABI); both
    candidates are returned, so check membership of the expected value and absence of others."""
    sms = set()
    for i in _cuda_images(blob):
        flags = struct.unpack_from("<I", blob, i + 48)[0]
        sms.update({flags & 0xFF, (flags >> 8) & 0xFF})
    return sms


def _cuda_images(blob: bytes):
    """Offsets in ``blob`` of the embedded CUDA ELF64 images (e_machine 190; at least the
    header up to e_flags present)."""
    i = blob.find(b"\x7fELF")
    while i >= 0:
        if (i + 52 <= len(blob) and blob[i + 4] == 2
                and struct.unpack_from("<H", blob, i + 18)[0] == 190):
            yield i
        i = blob.find(b"\x7fELF", i + 4)


def cubin_kernels(blob: bytes) -> list[str]:
    """Kernel names (``.text.<name>`` sections) of the CUDA ELF images embedded in ``blob``, one
    entry per compiled kernel; CuTe DSL's mangled suffix of operand types is cut at
    "_tensor" and its "kernel_cutlass_" prefix dropped (e.g. "_rotate_in_kernel")."""
    names = []
    for i in _cuda_images(blob):
        try:
            shoff = struct.unpack_from("<Q", blob, i + 0x28)[0]
            entsize, count, strndx = struct.unpack_from("<HHH", blob, i + 0x3A)
            heads = [struct.unpack_from("<IIQQQQ", blob, i + shoff + j * entsize)
                     for j in range(count)]
            strtab = i + heads[strndx][4]
            for h in heads:
                end = blob.index(b"\0", strtab + h[0])
                name = blob[strtab + h[0]:end].decode("ascii", "replace")
                if name.startswith(".text."):
                    name = name[len(".text."):].removeprefix("kernel_cutlass_")
                    names.append(name.split("_tensor")[0])
        except (struct.error, ValueError, IndexError):
            pass                                      # not a whole image: skipped
    return names


_REGISTER_LOCK = threading.Lock()
_registered = False


def register_runtime(library: str | None = None) -> None:
    """Register the CuTe DSL FFI handlers (once per process) for running exported artifacts.

    With ``library`` (or, when cutlass is not importable, ``$CUTE_DSL_RUNTIME_LIBRARY``) the v2
    targets of that libcute_dsl_runtime.so are registered through ctypes; otherwise through
    cutlass.jax, which also serves its own just-in-time kernels (registering both ways in one
    process would register the FFI type twice)."""
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        if library is None and importlib.util.find_spec("cutlass") is not None:
            import cutlass.jax
            cutlass.jax.register_ffi()
            _registered = True
            return
        library = library or os.environ.get(RUNTIME_LIBRARY_ENV)
        if not library:
            raise RuntimeError("CuTe DSL is not importable and no runtime library was given: "
                               f"set {RUNTIME_LIBRARY_ENV} to libcute_dsl_runtime.so")
        lib = ctypes.CDLL(library)

        def symbol(name: str):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_void_p
            return fn

        # FFI types: the library's functions return the addresses of its TypeId / TypeInfo.
        for name, ids in _RUNTIME_TYPES_V2.items():
            jax.ffi.register_ffi_type(name, {k: jax.ffi.pycapsule(symbol(v)())
                                             for k, v in ids.items()}, platform="CUDA")
        for name, stages in _RUNTIME_TARGETS_V2.items():
            jax.ffi.register_ffi_target(name, {k: jax.ffi.pycapsule(symbol(v))
                                               for k, v in stages.items()}, platform="CUDA")
        _registered = True


def load(path: str):
    """Deserialize an artifact written by scripts/build_aot.py (register_runtime first)."""
    from jax import export
    with open(path, "rb") as f:
        return export.deserialize(bytearray(f.read()))


def device_arch() -> str | None:
    """sm_XYa of the first CUDA device, else $CUTE_DSL_ARCH (CPU processes: lowering only)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        dev = None
    cc = getattr(dev, "compute_capability", None) if dev is not None and \
        dev.platform == "gpu" else None
    if cc:
        major, minor = str(cc).split(".")[:2]
        return f"sm_{major}{minor}a"
    return configured_arch()


@dataclasses.dataclass
class ArtifactSet:
    """The artifacts of one directory for one arch: linear_key -> file, loaded on first use.

    hits / misses count lookups per key (a jitted program looks each call site up once, at
    trace time)."""
    directory: str
    arch: str
    files: dict
    loaded: dict = dataclasses.field(default_factory=dict)
    hits: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    misses: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def read(cls, directory: str, arch: str) -> "ArtifactSet":
        path = os.path.join(directory, MANIFEST)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{AOT_DIR_ENV}={directory}: no {MANIFEST} (write the "
                                    "directory with scripts/build_aot.py)")
        with open(path) as f:
            rows = json.load(f)
        files = {r["key"]: r["file"] for r in rows if r.get("arch") == arch and "key" in r}
        return cls(directory, arch, files)

    def lookup(self, key: str):
        """The deserialized Exported for ``key``, or None."""
        name = self.files.get(key)
        if name is None:
            self.misses[key] += 1
            return None
        if key not in self.loaded:
            self.loaded[key] = load(os.path.join(self.directory, name))
        self.hits[key] += 1
        return self.loaded[key]


_SETS: dict = {}


def artifacts() -> ArtifactSet | None:
    """The ArtifactSet of $EXL3_JAX_AOT_DIR for this process's device arch (None when unset).
    On a GPU backend this also registers the runtime's FFI handlers."""
    directory = os.environ.get(AOT_DIR_ENV)
    if not directory:
        return None
    arch = device_arch()
    if not arch:
        raise RuntimeError(f"{AOT_DIR_ENV} is set but the arch is unknown: no CUDA device and "
                           f"no {ARCH_ENV}")
    ident = (os.path.abspath(directory), arch)
    if ident not in _SETS:
        _SETS[ident] = ArtifactSet.read(directory, arch)
        if jax.default_backend() == "gpu":
            register_runtime()
    return _SETS[ident]


def lookup_linear(x2, weight, plan, transforms: str, *, jit_ok):
    """The artifact for y = trellis_matmul_gpu(x2 [m, k], weight) under ``plan``, or None when
    no artifact directory is configured or (with ``jit_ok()`` true) none matches.

    x2: array or ShapeDtypeStruct [m, k]; weight: Exl3Weight; plan: TrellisPlan; transforms:
    "cute" | "xla"; jit_ok: callable, whether the kernels could be compiled in this process.

    Raises RuntimeError on a miss when the kernels cannot be compiled here (jit_ok() false)."""
    arts = artifacts()
    if arts is None:
        return None
    m = int(x2.shape[0])
    key = linear_key(weight.k, weight.n, weight.K, weight.codebook, m, x2.dtype,
                     weight.bias is not None, plan, transforms)
    exp = arts.lookup(key)
    if exp is None:
        hint = (f"scripts/build_aot.py --arch {arts.arch} --linears "
                f"{weight.k}x{weight.n}:{weight.K}:{weight.codebook} --m {m} "
                f"--x-dtype {jnp.dtype(x2.dtype).name}" + (" --bias" if weight.bias is not None
                                                         else ""))
        if not jit_ok():
            raise RuntimeError(f"no AOT artifact in {arts.directory} for {key} ({arts.arch}) "
                               f"and CuTe DSL is not importable to compile it; export it with "
                               f"{hint}")
        warnings.warn(f"no AOT artifact for {key}: compiling just in time (export: {hint})",
                      stacklevel=3)
    return exp


def check_exports(cases, describe, export) -> int:
    """Compile-only export check: one JSON row per case on stdout (for the tests), with the
    case's fields ``describe(case)`` (a dict), the arch, and ok / custom_call / calls (CuTe
    custom calls in the module) / sms (cubin SMs) / kernels (cubin_kernels) / bytes, or the
    error; ``export(fields)`` returns the jax.export.Exported of the case."""
    arch = configured_arch()
    for case in cases:
        t0 = time.perf_counter()
        row = {"arch": arch, **describe(case)}
        try:
            exp = export(dict(row))
            text = exp.mlir_module()
            blob = exp.mlir_module_serialized
            row.update(ok=True, custom_call=CUSTOM_CALL_PREFIX in text,
                       calls=text.count(CUSTOM_CALL_PREFIX), sms=sorted(cubin_sms(blob)),
                       kernels=sorted(cubin_kernels(blob)), bytes=len(exp.serialize()))
        except Exception as e:   # noqa: BLE001 -- reported to the test
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(row), flush=True)
    return 0


def check_main(describe, export, description: str, case_help: str, argv=None) -> int:
    """``--check JSON`` command line around ``check_exports`` (one arch per process: the arch
    must be set in the environment before cutlass is imported)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--check", required=True, help=case_help)
    a = p.parse_args(argv)
    if not configured_arch():
        print(f"set {ARCH_ENV} (sm_90a or sm_120a) before running", file=sys.stderr)
        return 2
    return check_exports(json.loads(a.check), describe, export)


def _linear_case(case) -> dict:
    """[codebook, K, m, plan(, k, n(, members))]: members (a list of out sizes summing to n)
    makes it a linear group (plan "decode")."""
    codebook, K, m, plan = case[:4]
    k, n = case[4:6] if len(case) > 4 else (256, 256)
    row = {"codebook": codebook, "K": K, "m": m, "plan": plan, "k": k, "n": n}
    if len(case) > 6:
        row["members"] = list(case[6])
    return row


def _export_linear_case(c):
    """The case's export, with the transforms $EXL3_JAX_TRANSFORMS names (as at run time)."""
    from . import trellis_gemm as tg
    if c.get("members"):
        return export_group(c["k"], c["members"], c["K"], c["codebook"], c["m"])
    return export_linear(c["k"], c["n"], c["K"], c["codebook"], c["m"], c["plan"],
                         transforms=tg._transforms_mode(None))[0]


def main(argv=None) -> int:
    return check_main(_linear_case, _export_linear_case,
                      "compile-only export check (one arch per process)",
                      "JSON list of [codebook, K, m, plan(, k, n(, members))] cases", argv)


if __name__ == "__main__":
    sys.exit(main())
