#!/usr/bin/env bash
# exl3-jax <-> exllamav3 1.6.5 interoperability on the GPU machine, in one call (issue #4 item 10):
#
#   bash scripts/interop_exllamav3.sh [OUTDIR]          (carry [".whl_interop"]; ~5-8 minutes)
#
# Needs .whl_interop/ (git-ignored): the exllamav3 1.6.5 wheel and the cp312 wheels of its missing
# dependencies; optionally exllamav3_ext.so.xz[.partN] from an earlier run (skips the ~5 minute
# JIT build of the CUDA extension). Writes OUTDIR/interop_exllamav3.json (versions, timings,
# metrics, per-phase errors with tracebacks) and a few logs; with a fresh build it also writes the
# compressed extension (exllamav3_ext.so.xz.part*, if <= 48 MiB) for the next run. Phases: see
# scripts/interop_exllamav3.py. The exllamav3 build runs in the background while exl3-jax
# converts the model; every phase has its own time limit and the report is always written.
set -u
OUTDIR=${1:-${OUT:-/tmp/interop_out}}
W=${INTEROP_WORK:-/tmp/interop_work}
WH=${INTEROP_WHEELS:-.whl_interop}
BUDGET_S=${INTEROP_BUDGET_S:-560}     # stop starting new phases after this many seconds
mkdir -p "$OUTDIR"
rm -rf "$W" && mkdir -p "$W/logs"
exec > >(tee "$OUTDIR/interop_run.log") 2>&1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false EXL3_JAX_BACKEND=reference
export EXL3_INT8_GEMV=0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(el) s] $*"; }
left() { echo $(( BUDGET_S - $(el) )); }
lim() { local t=$(( $(left) - $1 )); [ $t -lt 15 ] && t=15; echo $t; }   # seconds left minus $1
PY="python3 scripts/interop_exllamav3.py"

# -- 1. wheels (offline) and exl3-jax --------------------------------------------------------------
PREBUILT=0
if [ "${INTEROP_SKIP_INSTALL:-0}" != 1 ]; then
  say "installing wheels from $WH"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WH"/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if ls "$WH"/exllamav3_ext.so.xz* >/dev/null 2>&1; then
    cat "$WH"/exllamav3_ext.so.xz* | xz -dc > /tmp/site/exllamav3_ext.so \
      && python3 -c "import torch, exllamav3_ext" && PREBUILT=1 \
      || rm -f /tmp/site/exllamav3_ext.so       # unusable: exllamav3 JIT-builds it instead
    say "prebuilt extension: $PREBUILT"
  fi
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . 2>"$W/logs/pip_e.log"; then
    tail -3 "$W/logs/pip_e.log"
    ln -sfn "$PWD/ffi" exl3_jax/ffi
    ln -sfn "$PWD/models" exl3_jax/models
    export PYTHONPATH=$PWD:$PYTHONPATH
  fi
  say "installed"
fi

# -- 2. model; exllamav3 chain in the background: build, convert (4 and 3.5 bpw), then both runtimes
#       run those checkpoints ---------------------------------------------------------------------
$PY gen --work "$W" $([ "${INTEROP_TINY:-0}" = 1 ] && echo --tiny)
$PY env --work "$W" >/dev/null 2>&1 &
(
  timeout $(lim 150) $PY ex-build --work "$W" > "$W/logs/ex_build.log" 2>&1
  tail -3 "$W/logs/ex_build.log"
  if grep -q '"ok": true' "$W/parts/ex_build.json" 2>/dev/null; then
    for b in 4 3.5; do
      tag=$( [ $b = 4 ] && echo ex || echo ex_b35 )
      timeout $(lim 60) $PY ex-convert --work "$W" --bits $b --tag $tag --timeout $(lim 70) 2>&1 \
        | tail -3
    done
    ms=$(for m in ex ex_b35; do [ -f "$W/$m/config.json" ] && echo -n "$m,"; done)
    if [ -n "$ms" ]; then
      timeout $(lim 5) nice -n 5 $PY jax-logits --work "$W" --models "$ms" --tag ex 2>&1 | tail -3 &
      timeout $(lim 5) $PY ex-logits --work "$W" --models "$ms" --tag ex 2>&1 | tail -3
      wait
    fi
  fi
) &
EX_PID=$!

# -- 3. meanwhile: torch reference; exl3-jax conversions (one process each) and logits -------------
export OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4
timeout 150 nice -n 10 $PY torch-ref --work "$W" 2>&1 | tail -2 &
SIDE_PIDS=$!
for spec in "mul1 4" "mcg 4" "mul1 3.5"; do
  set -- $spec
  timeout $(lim 200) nice -n 10 $PY jax-convert --work "$W" --codebooks $1 --bits $2 \
    --mode "${INTEROP_MODE:-exact}" --tag "$1_b$2" 2>&1 | tail -2 &
  SIDE_PIDS="$SIDE_PIDS $!"
done
wait $SIDE_PIDS
JM=$(for m in jax_mul1 jax_mcg jax_mul1_b35; do [ -f "$W/$m/config.json" ] && echo -n "$m,"; done)
timeout $(lim 120) nice -n 10 $PY jax-logits --work "$W" --models "hf,$JM" --tag own 2>&1 | tail -2
say "exl3-jax side done"
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS

# -- 4. exllamav3 runs exl3-jax's checkpoints and the unquantized model (once it has built) --------
while ! grep -q '"seconds"' "$W/parts/ex_build.json" 2>/dev/null && kill -0 $EX_PID 2>/dev/null; do
  sleep 2
done
if grep -q '"ok": true' "$W/parts/ex_build.json" 2>/dev/null; then
  timeout $(lim 40) $PY ex-logits --work "$W" --models "${JM}hf" --tag jax 2>&1 | tail -4
else
  say "exllamav3 did not build/import: skipping its phases"
fi
wait $EX_PID

# keep a freshly built extension for the next run (parts of < 16 MiB each come back from $OUT)
SO=$(ls $TORCH_EXTENSIONS_DIR/exllamav3_ext/exllamav3_ext.so 2>/dev/null | head -1)
if [ "$PREBUILT" = 0 ] && [ -n "$SO" ]; then
  xz -T16 -6 -c "$SO" > "$W/exllamav3_ext.so.xz" \
    && split -b 15M -d -a 1 "$W/exllamav3_ext.so.xz" "$W/exllamav3_ext.so.xz.part" \
    && if [ "$(stat -c %s "$W/exllamav3_ext.so.xz")" -le $((48 << 20)) ]; then
         cp "$W"/exllamav3_ext.so.xz.part* "$OUTDIR/"; fi
  echo "extension $(stat -c %s "$SO") B, xz $(stat -c %s "$W/exllamav3_ext.so.xz") B"
fi

# -- 5. report -------------------------------------------------------------------------------------
$PY report --work "$W" --out "$OUTDIR/interop_exllamav3.json"
cat "$W"/logs/ex*_convert.log > "$OUTDIR/ex_convert.log" 2>/dev/null
tail -c 20000 "$W/logs/ex_build.log" > "$OUTDIR/ex_build.log" 2>/dev/null
say "done"
sleep 1   # let tee flush the run log
