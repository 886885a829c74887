"""Run the CuTe DSL custom calls on the CPU through the PTX interpreter (EXL3_JAX_EMULATE=1).

Why: the kernels can only be timed on a GPU, but what they compute, where they read and write
and how they synchronise is fixed by the PTX that CuTe DSL emits, which any machine can build.
With EXL3_JAX_EMULATE=1 (and CUTE_DSL_ARCH, sm_90a by default, set before cutlass is
imported) ``trellis_gemm.available()`` is true on the CPU and every cutlass_call lowers to a
host callback: at trace time the call's launcher is compiled with cute.compile while a hook on
the DSL's kernel launches records each kernel it launches (name, grid, block, cluster, which
launcher tensors it takes, the shared memory its SmemAllocator asked for, whether it is a
programmatic dependent launch); at run time each tensor gets its own bounded buffer (outputs
filled with 0xFF bytes, i.e. NaN, unless aliased to an input) and the recorded launches run in
order in ``ptx_interpreter``, a dependent launch checked against the launches that may still
run beside it. So the package's jitted GPU
paths (transforms, kernels, plans, layouts) and the GPU validation scripts run unchanged,
slowly (minutes for one Qwen3-30B-A3B MoE layer): small shapes."""

from __future__ import annotations

import collections
import functools
import os
import tempfile
import threading

import jax
import numpy as np
from jax.interpreters import mlir

from . import ptx_interpreter as emu

EMULATE_ENV = "EXL3_JAX_EMULATE"
TRACE_ENV = "EXL3_JAX_EMULATE_TRACE"      # print each launch's NaN counts (debugging)
# "1": each LAUNCH_LOG entry also holds ``issued``, the launch's PTX warp-instructions by
# instruction (ptx_interpreter.launch's counts; scripts/emulated_issue_counts.py)
COUNT_ENV = "EXL3_JAX_EMULATE_COUNT"
ARCH_ENV = "CUTE_DSL_ARCH"
DEFAULT_ARCH = "sm_90a"
_lock = threading.Lock()
# The latest emulated launches (kernel, grid, block, cluster, smem, pdl), for tests and
# debugging.
LAUNCH_LOG: collections.deque = collections.deque(maxlen=256)


def _mlir_values(obj) -> list:
    try:
        return list(obj.__extract_mlir_values__())
    except Exception:
        return []


_ORIGINALS: dict = {}


def _source_tensor(arg, tensors, values, depth: int = 6) -> list[int]:
    """Indices of the launcher tensors that a kernel argument is, or is a view of (e.g.
    cute.recast_tensor): the argument's SSA values are followed up through their defining ops'
    operands (DSL objects, or raw values) until one is a launcher tensor or its value."""
    frontier = [arg]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            hit = [i for i, t in enumerate(tensors) if t is node]
            vals = [node] if hasattr(node, "owner") else _mlir_values(node)
            hit += [i for i, lv in enumerate(values) if lv and any(
                v == w for v in vals for w in lv)]
            if hit:
                return hit
            for v in vals:
                nxt += list(getattr(getattr(v, "owner", None), "operands", None) or [])
        frontier = nxt
    return []


@functools.lru_cache(maxsize=None)
def _compile(fn, spec):
    """PTX module and launch records of one cutlass_call (cached per launcher and spec)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.cutlass_dsl.cutlass import KernelLauncher
    from cutlass.jax.compile import jit_wrapper
    from cutlass.memory.smem import SmemAllocator

    seen: dict = {}
    records: list = []
    # The DSL's own methods, saved by install(): the class attributes are patched only while
    # _lock is held, but host callbacks of one program run on several threads.
    orig, orig_alloca = _ORIGINALS["launch"], _ORIGINALS["alloca"]
    allocs: list = []

    def recording_alloca(self, layout, dtype, byte_alignment, *args, **kwargs):
        allocs.append((cute.size(layout) * max(dtype.width, 8) // 8, byte_alignment))
        return orig_alloca(self, layout, dtype, byte_alignment, *args, **kwargs)

    def recording_fn(stream, *tensors, **kwargs):
        seen["tensors"] = tensors
        return fn(stream, *tensors, **kwargs)

    def recording_launch(self, *args, **kwargs):
        tensors = seen["tensors"]
        values = [_mlir_values(t) for t in tensors]
        params = []
        for a in self.func_args:
            if not hasattr(a, "__extract_mlir_values__") or isinstance(a, (int, float)):
                continue                                # a constexpr argument: no parameter
            hit = _source_tensor(a, tensors, values)
            if not hit:
                raise RuntimeError(f"{self.funcBody.__name__}: a kernel tensor argument that is "
                                   "neither one of its launcher's tensors nor a view of one")
            params.append(hit[0])
        del allocs[:]
        out = orig(self, *args, **kwargs)            # traces the kernel body
        smem = 0
        for nbytes, align in allocs:                 # the allocator's packing, as an upper bound
            smem = -(-smem // align) * align + int(nbytes)
        records.append(dict(kernel=self._launch_name or self.funcBody.__name__, params=params,
                            grid=tuple(int(g) for g in kwargs["grid"]),
                            block=tuple(int(b) for b in kwargs["block"]),
                            cluster=tuple(int(c) for c in kwargs["cluster"])
                            if kwargs.get("cluster") else None,
                            smem=int(kwargs.get("smem") or smem),
                            pdl=bool(kwargs.get("use_pdl", False))))
        return out

    with _lock:
        KernelLauncher.launch = recording_launch
        SmemAllocator._smem_alloca = recording_alloca
        try:
            with tempfile.TemporaryDirectory() as dump:    # --keep-ptx writes a file
                compiled = cute.compile(jit_wrapper, cuda.CUstream(0), *spec.get_compile_args(),
                                        wrapped_fn=recording_fn, spec=spec,
                                        options=f"--keep-ptx --dump-dir={dump}")
                ptx = compiled.__ptx__
        finally:
            KernelLauncher.launch = orig
            SmemAllocator._smem_alloca = orig_alloca
    if not ptx:
        raise RuntimeError("cute.compile gave no PTX")
    module = emu.PtxModule(ptx)
    if not records:
        raise RuntimeError("no kernel launch was traced (a cached build?)")
    return module, records


def run_call(fn, spec, inputs: list[np.ndarray], out_shapes) -> list[np.ndarray]:
    """Execute one cutlass_call with NumPy inputs; returns its outputs."""
    module, records = _compile(fn, spec)
    mem = emu.GlobalMemory()
    in_addr = [mem.alloc(np.asarray(x), f"input{i}") for i, x in enumerate(inputs)]
    aliased = dict((o, i) for i, o in spec.input_output_aliases)
    out_addr = {}
    for j, s in enumerate(out_shapes):
        if j not in aliased:
            out_addr[j] = mem.alloc(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize,
                                    f"output{j}")
    kernel_tensors = in_addr + [out_addr[j] for j in range(len(out_shapes)) if j not in aliased]
    trace = os.environ.get(TRACE_ENV, "0") not in ("", "0")
    count = os.environ.get(COUNT_ENV, "0") not in ("", "0")
    for i, r in enumerate(records):
        issued = {} if count else None
        LAUNCH_LOG.append(dict(r, issued=issued) if count else r)
        # A programmatic dependent launch may start while its predecessors back to the last
        # ordinary launch still run (an ordinary launch starts after all before it completed).
        first = i
        while first > 0 and records[first]["pdl"]:
            first -= 1
        emu.launch(module, r["kernel"], r["grid"], r["block"],
                   [kernel_tensors[p] for p in r["params"]], mem, r["smem"], launch_id=i,
                   unordered=range(first, i) if r["pdl"] else (), cluster=r["cluster"],
                   counts=issued)
        if trace:       # NaN words (as fp32 / fp16) of every buffer the kernel was passed
            counts = {p: (int(np.isnan(b[:len(b) // 4 * 4].view(np.float32)).sum()),
                          int(np.isnan(b[:len(b) // 2 * 2].view(np.float16)).sum()))
                      for p in r["params"] for b in [mem.read(kernel_tensors[p])]}
            print(f"[emulate] {r['kernel'][:60]} grid {r['grid']}: NaN (f32, f16) by tensor "
                  f"{counts}", flush=True)
    outs = []
    for j, s in enumerate(out_shapes):
        addr = in_addr[aliased[j]] if j in aliased else out_addr[j]
        raw = mem.read(addr)
        outs.append(raw.view(np.dtype(s.dtype)).reshape(s.shape).copy())
    return outs


def _emulated_lowering(ctx, *args, lowering_target, spec, output_shape_dtype_flat, **_):
    """cutlass_call's CPU lowering: a host callback that runs the launches in the interpreter.

    Why not ``jax.pure_callback``: it device_puts its NumPy operands onto CPU device 0 before
    calling back, and with several simulated devices (shard_map over
    --xla_force_host_platform_device_count) every device thread then waits on a transfer that
    needs a thread of the pool they occupy: the 2-device tensor-parallel test hung in that wait
    (bench/NOTES.md, session 21). ``emit_python_callback`` hands the callback the operand
    buffers as NumPy arrays, with the sharding rule pure_callback uses (one call per device
    inside shard_map, one call on device 0 otherwise)."""
    from jax._src import callback as jax_callback
    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in output_shape_dtype_flat]

    def host(*xs):
        return tuple(run_call(lowering_target.fn, spec, [np.asarray(x) for x in xs], shapes))

    sharding = jax_callback._callback_op_sharding(ctx.module_context.axis_context, None,
                                                  ctx.avals_out)
    results, _, _ = mlir.emit_python_callback(
        ctx, host, None, list(args), ctx.avals_in, ctx.avals_out, has_side_effect=False,
        returns_token=False, sharding=sharding)
    return results


def enabled() -> bool:
    return os.environ.get(EMULATE_ENV, "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def install() -> None:
    """Make cutlass_call lower for the CPU through the interpreter (once per process)."""
    import sys
    if ARCH_ENV not in os.environ:
        if "cutlass" in sys.modules:      # the DSL read its target already (sm_100a on a CPU)
            raise RuntimeError(f"{EMULATE_ENV}: set {ARCH_ENV} before cutlass is imported")
        os.environ[ARCH_ENV] = DEFAULT_ARCH
    from cutlass.cutlass_dsl.cutlass import KernelLauncher
    from cutlass.jax import primitive
    from cutlass.memory.smem import SmemAllocator
    _ORIGINALS.update(launch=KernelLauncher.launch, alloca=SmemAllocator._smem_alloca)
    mlir.register_lowering(primitive.cutlass_call_inner_p,
                           _emulated_lowering, platform="cpu")
