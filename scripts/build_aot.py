"""Export the GPU Trellis GEMM ahead of time with jax.export, on any machine (no GPU needed).

  python scripts/build_aot.py --out aot/ [--arch sm_90a,sm_120a]
      [--linears 4096x14336:3:mcg,8192x28672:4:mul1] [--m 1,4,16,32,128,1024]

For each arch, linear (k x n : K : codebook) and token count m it writes
``trellis_<k>x<n>_K<K>_<cb>_m<m>_<arch>.jaxexport``: the serialized jax.export of
``trellis_matmul_gpu(x[m, k] bf16, trellis, suh, svh) -> float32 [m, n]`` for platforms=["cuda"]
with the CuTe kernels' object code embedded, plus ``manifest.json``. One child process per arch:
CuTe DSL reads CUTE_DSL_ARCH once per process (and builds sm_100a when it is unset on a machine
without a GPU).

On the GPU, with only jax and libcute_dsl_runtime.so (no CuTe compiler):
    from exl3_jax.ffi import aot
    aot.register_runtime()            # or aot.register_runtime("/path/libcute_dsl_runtime.so")
    y = aot.load(path).call(x, trellis, suh, svh)
Pick the artifact whose arch matches the device (sm_90a: H200; sm_120a: RTX PRO 6000); an sm_120a
artifact fails to load on an H200 (CUDA error 209, jax_gpu_paths.md 8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def parse_linears(spec: str):
    out = []
    for item in spec.split(","):
        shape, K, cb = item.split(":")
        k, n = (int(v) for v in shape.split("x"))
        out.append((k, n, float(K) if "." in K else int(K), cb))
    return out


def export_all(outdir: str, linears, ms) -> list[dict]:
    """In this process (CUTE_DSL_ARCH already set): export every (linear, m)."""
    from exl3_jax.ffi import aot

    arch = aot.configured_arch()
    rows = []
    for k, n, K, cb in linears:
        for m in ms:
            name = f"trellis_{k}x{n}_K{K}_{cb}_m{m}_{arch}.jaxexport"
            t0 = time.perf_counter()
            exp = aot.export_linear(k, n, K, cb, m)
            blob = exp.serialize()
            with open(os.path.join(outdir, name), "wb") as f:
                f.write(blob)
            rows.append(dict(file=name, arch=arch, k=k, n=n, K=K, codebook=cb, m=m,
                             bytes=len(blob), sms=sorted(aot.cubin_sms(bytes(blob))),
                             seconds=round(time.perf_counter() - t0, 2)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="sm_90a,sm_120a")
    p.add_argument("--linears", default="4096x14336:3:mcg,4096x14336:4:mul1")
    p.add_argument("--m", default="1,4,16,32,128,1024")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    linears = parse_linears(a.linears)
    ms = [int(v) for v in a.m.split(",")]
    if a.child:
        rows = export_all(a.out, linears, ms)
        print("ROWS " + json.dumps(rows))
        return 0
    manifest = []
    for arch in a.arch.split(","):
        env = dict(os.environ, CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--out",
                               a.out, "--linears", a.linears, "--m", a.m],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        for line in proc.stdout.splitlines():
            if line.startswith("ROWS "):
                manifest += json.loads(line[5:])
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{len(manifest)} artifacts in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
