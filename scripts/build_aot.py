"""Export the GPU Trellis GEMM ahead of time with jax.export, on any machine (no GPU needed).

  python scripts/build_aot.py --out .aot/run [--arch sm_90a,sm_120a]
      [--linears 4096x14336:3:mcg,8192x28672:4:mul1] [--m 1,4,16,32,128,1024]
      [--x-dtype bfloat16] [--bias] [--sms 132]

For each arch, linear (k x n : K : codebook) and token count m it writes
``trellis_<k>x<n>_K<K>_<cb>_m<m>_<dtype>[_bias]_<arch>.jaxexport``: the serialized jax.export of
``trellis_matmul_gpu(x[m, k], trellis, suh, svh[, bias]) -> float32 [m, n]`` for
platforms=["cuda"] with the CuTe kernels' object code embedded, and adds its row (file, arch,
linear_key, plan, sizes) to ``manifest.json`` (rows of other keys or arches already there are
kept). The plan is the one the device will pick (select_plan for --sms SMs; 132 = H200), and is
part of the key, so an artifact is only used where it matches. Activations reach the kernels as
bfloat16 from Exl3Linear in a bf16 model and from `exl3-jax bench linear` (the Hadamard kernels
scale rows at the fp16 boundary themselves). One child process per arch: CuTe DSL reads CUTE_DSL_ARCH once per process
(and builds sm_100a when it is unset on a machine without a GPU).

Use on the GPU (only jax and libcute_dsl_runtime.so needed, no CuTe compiler):
    EXL3_JAX_AOT_DIR=.aot/run python ...      # every trellis_matmul looks its artifact up
or by hand:
    from exl3_jax.ffi import aot
    aot.register_runtime()            # or aot.register_runtime("/path/libcute_dsl_runtime.so")
    y = aot.load(path).call(x, trellis, suh, svh)
An sm_120a artifact fails to load on an H200 (CUDA error 209, jax_gpu_paths.md 8); the lookup
only considers artifacts of the device's arch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time


def parse_linears(spec: str):
    out = []
    for item in spec.split(","):
        try:
            shape, K, cb = item.split(":")
            k, n = (int(v) for v in shape.split("x"))
        except ValueError:
            raise SystemExit(f"bad --linears item {item!r}: expected KxN:K:codebook, "
                             "e.g. 4096x14336:3:mcg") from None
        out.append((k, n, float(K) if "." in K else int(K), cb))
    return out


def artifact_name(k, n, K, cb, m, dtype: str, bias: bool, arch: str) -> str:
    return f"trellis_{k}x{n}_K{K}_{cb}_m{m}_{dtype}{'_bias' if bias else ''}_{arch}.jaxexport"


def export_all(outdir: str, linears, ms, *, x_dtype: str, bias: bool, sms: int) -> list[dict]:
    """In this process (CUTE_DSL_ARCH already set): export every (linear, m)."""
    from exl3_jax.ffi import aot

    arch = aot.configured_arch()
    rows = []
    for k, n, K, cb in linears:
        for m in ms:
            name = artifact_name(k, n, K, cb, m, x_dtype, bias, arch)
            t0 = time.perf_counter()
            plan = aot.resolve_plan(m, k, n, sms=sms, codebook=cb)
            exp, key = aot.export_linear(k, n, K, cb, m, plan, x_dtype=x_dtype, bias=bias)
            blob = exp.serialize()
            with open(os.path.join(outdir, name), "wb") as f:
                f.write(blob)
            rows.append(dict(file=name, arch=arch, key=key, k=k, n=n, K=K, codebook=cb, m=m,
                             x_dtype=x_dtype, bias=bias, plan=dataclasses.asdict(plan),
                             bytes=len(blob), sms=sorted(aot.cubin_sms(bytes(blob))),
                             seconds=round(time.perf_counter() - t0, 2)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def merge_manifest(outdir: str, rows: list[dict]) -> list[dict]:
    """Existing manifest rows of other (arch, key) pairs, then ``rows``; written back."""
    path = os.path.join(outdir, "manifest.json")
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    new = {(r["arch"], r.get("key")) for r in rows}
    merged = [r for r in old if (r.get("arch"), r.get("key")) not in new] + rows
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="sm_90a,sm_120a")
    p.add_argument("--linears", default="4096x14336:3:mcg,4096x14336:4:mul1")
    p.add_argument("--m", default="1,4,16,32,128,1024")
    p.add_argument("--x-dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"),
                   help="activation dtype at the kernel (bfloat16 from Exl3Linear in a bf16 model)")
    p.add_argument("--bias", action="store_true", help="export with a bias operand")
    p.add_argument("--sms", type=int, default=132, help="SM count the plans are chosen for")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    linears = parse_linears(a.linears)
    ms = [int(v) for v in a.m.split(",")]
    if a.child:
        rows = export_all(a.out, linears, ms, x_dtype=a.x_dtype, bias=a.bias, sms=a.sms)
        print("ROWS " + json.dumps(rows))
        return 0
    rows = []
    for arch in a.arch.split(","):
        env = dict(os.environ, CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")
        env.pop("EXL3_JAX_AOT_DIR", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", a.out,
               "--linears", a.linears, "--m", a.m, "--x-dtype", a.x_dtype, "--sms", str(a.sms)]
        proc = subprocess.run(cmd + (["--bias"] if a.bias else []), env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        for line in proc.stdout.splitlines():
            if line.startswith("ROWS "):
                rows += json.loads(line[5:])
    merged = merge_manifest(a.out, rows)
    print(f"{len(rows)} artifacts exported to {a.out} ({len(merged)} in its manifest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
