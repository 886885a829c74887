#!/usr/bin/env bash
# Validate + benchmark the GPU Trellis GEMM on an offline CUDA machine (H200 image: Python 3.12,
# jax 0.11.2, no nvidia-cutlass-dsl), from the repository root:
#
#   bash scripts/gpu_validate.sh [OUTDIR] [extra args for gpu_validate.py]
#
# Needs .device/cutlass_dsl_cp312_cu13.tar.xz (copy of shared/device/, ignored by git) in the tree.
# Writes OUTDIR/gpu_validate.json (bit-exact decode, GEMM accuracy, dispatch), gpu_bench.json
# (timing vs bf16), sass.txt (cuobjdump of two decode kernels), memcheck_{decode,prefill,group}.log.
# Env: BENCH_SHAPES (default 4096x14336,8192x28672), BENCH_BUDGET_S (default 170).
set -u
OUTDIR=${1:-${OUT:-/tmp/exl3_gpu_out}}
shift || true
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1

if ! python3 -c "import cutlass.jax" 2>/dev/null; then
  mkdir -p /tmp/site
  tar -xJf .device/cutlass_dsl_cp312_cu13.tar.xz -C /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/tmp/pip_err.log; then
  # Fallback without installing: expose ffi/ and models/ as exl3_jax subpackages via links.
  tail -3 /tmp/pip_err.log
  ln -sfn "$PWD/ffi" exl3_jax/ffi
  ln -sfn "$PWD/models" exl3_jax/models
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

# compute-sanitizer memcheck, one configuration per plan, concurrently with the validation (it
# needs no timing; XLA's platform allocator gives every buffer its own cudaMalloc so that
# out-of-bounds accesses are caught; host API return codes are not reported; XLA's GEMM
# autotuning off: with it compute-sanitizer crashed before the prefill plan's first launch,
# session 39, and which GEMM XLA picks does not matter to the CuTe kernels' check).
(
  if command -v compute-sanitizer >/dev/null; then
    for kind in decode prefill group; do
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
        python3 scripts/gpu_validate.py --memcheck $kind > "$OUTDIR/memcheck_$kind.log" 2>&1
      echo "memcheck $kind rc=$? :: $(grep -E 'ERROR SUMMARY|memcheck run' "$OUTDIR/memcheck_$kind.log" | tr '\n' ' ')"
    done
  fi
) &
MEMCHECK_PID=$!
(python3 scripts/gpu_validate.py --sass /tmp/exl3_sass > /tmp/exl3_sass.log 2>&1 \
  && cp /tmp/exl3_sass/sass.txt "$OUTDIR/") &
SASS_PID=$!

XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python3 scripts/gpu_validate.py \
  --out "$OUTDIR/gpu_validate.json" --no-bench "$@"
RC=$?
wait $MEMCHECK_PID $SASS_PID

python3 scripts/gpu_bench_linear.py --shapes "${BENCH_SHAPES:-4096x14336,8192x28672}" --K 3,4 \
  --codebooks mcg,mul1 --budget-s "${BENCH_BUDGET_S:-170}" --out "$OUTDIR/gpu_bench.json"
exit $RC
