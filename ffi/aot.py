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
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import sys
import time

import jax
import jax.numpy as jnp

ARCH_ENV = "CUTE_DSL_ARCH"
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


def export_linear(k: int, n: int, K, codebook: str, m: int, plan: str | None = None,
                  x_dtype=jnp.bfloat16, bias: bool = False):
    """jax.export of y = trellis_matmul_gpu(x[m, k], W) for platforms=["cuda"].

    The exported function takes flat arrays (x, trellis, suh, svh[, bias]) so the artifact
    serializes without registering Exl3Weight's pytree with jax.export."""
    from jax import export

    from exl3_jax.format.spec import width_from_rate
    from exl3_jax.trellis import Exl3Weight

    from . import trellis_gemm as tg

    def fn(x, trellis, suh, svh, *b):
        w = Exl3Weight(trellis=trellis, suh=suh, svh=svh, bias=b[0] if b else None,
                       codebook=codebook, K=K, in_features=k, out_features=n)
        return tg.trellis_matmul_gpu(x, w, plan=plan)

    sds = jax.ShapeDtypeStruct
    args = [sds((m, k), x_dtype), sds((k // 16, n // 16, width_from_rate(K)), jnp.int16),
            sds((k,), jnp.float16), sds((n,), jnp.float16)] + ([sds((n,), jnp.float16)]
                                                               if bias else [])
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks())(
        *args)


def cubin_sms(blob: bytes) -> set[int]:
    """SM numbers of the CUDA ELF images (e_machine 190) embedded in ``blob``.

    The SM sits in e_flags' low byte (older ELF ABI) or its second byte (newer ABI); both
    candidates are returned, so check membership of the expected value and absence of others."""
    sms = set()
    i = blob.find(b"\x7fELF")
    while i >= 0:
        if i + 52 <= len(blob) and blob[i + 4] == 2:
            machine = struct.unpack_from("<H", blob, i + 18)[0]
            flags = struct.unpack_from("<I", blob, i + 48)[0]
            if machine == 190:
                sms.update({flags & 0xFF, (flags >> 8) & 0xFF})
        i = blob.find(b"\x7fELF", i + 4)
    return sms


def register_runtime(library: str | None = None) -> None:
    """Register the CuTe DSL FFI handlers for running exported artifacts.

    Uses cutlass.jax when importable; otherwise loads ``libcute_dsl_runtime.so`` (path from the
    argument or $CUTE_DSL_RUNTIME_LIBRARY) and registers its v2 targets directly."""
    if library is None:
        try:
            import cutlass.jax
            cutlass.jax.register_ffi()
            return
        except ImportError:
            library = os.environ.get("CUTE_DSL_RUNTIME_LIBRARY")
    if not library:
        raise RuntimeError("libcute_dsl_runtime.so not found: pass its path or set "
                           "CUTE_DSL_RUNTIME_LIBRARY")
    lib = ctypes.CDLL(library)
    for name, ids in _RUNTIME_TYPES_V2.items():
        jax.ffi.register_ffi_type(name, {k: jax.ffi.pycapsule(getattr(lib, v))
                                         for k, v in ids.items()}, platform="CUDA")
    for name, stages in _RUNTIME_TARGETS_V2.items():
        jax.ffi.register_ffi_target(name, {k: jax.ffi.pycapsule(getattr(lib, v))
                                           for k, v in stages.items()}, platform="CUDA")


def load(path: str):
    """Deserialize an artifact written by scripts/build_aot.py (register_runtime first)."""
    from jax import export
    with open(path, "rb") as f:
        return export.deserialize(bytearray(f.read()))


def _check(cases) -> int:
    arch = configured_arch()
    for case in cases:
        codebook, K, m, plan = case[:4]
        k, n = case[4:6] if len(case) > 4 else (256, 256)
        t0 = time.perf_counter()
        row = {"arch": arch, "codebook": codebook, "K": K, "m": m, "plan": plan, "k": k, "n": n}
        try:
            exp = export_linear(k, n, K, codebook, m, plan)
            text = exp.mlir_module()
            blob = exp.mlir_module_serialized
            row.update(ok=True, custom_call=CUSTOM_CALL_PREFIX in text,
                       calls=text.count(CUSTOM_CALL_PREFIX), sms=sorted(cubin_sms(blob)),
                       bytes=len(exp.serialize()))
        except Exception as e:   # noqa: BLE001 -- reported to the test
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compile-only export check (one arch per process)")
    p.add_argument("--check", required=True,
                   help='JSON list of [codebook, K, m, plan(, k, n)] cases')
    a = p.parse_args(argv)
    if not configured_arch():
        print(f"set {ARCH_ENV} (sm_90a or sm_120a) before running", file=sys.stderr)
        return 2
    return _check(json.loads(a.check))


if __name__ == "__main__":
    sys.exit(main())
