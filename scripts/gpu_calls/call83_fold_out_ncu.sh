# Ran in session 39 with `here` = main + scripts/gpu_calls/fold_out.patch (the output-side fold,
# rejected by call 84: main keeps the both-sides fold everywhere). To rerun, replace `tree here`
# by `tree_patched foldout scripts/gpu_calls/fold_out.patch` (and `tree $T` likewise for here).
# Call 83 (~4 min, an H100 / H200): why the output-side fold is slower (call 82: 8192x28672
# m = 256 +45%, m = 1024 +8%, m = 4096 +2-3% against main; 4096x14336 within +-4%): per-kernel
# durations of the prefill op under ncu (every launch's gpu__time_duration; the last op call's
# launches printed) in this tree and in s38, then the new dequantize kernel's own profile.
# Predictions: the new dequantize kernel takes ~300+ us at 8192x28672 (the W_hat kernel ~204,
# call 72); the x pass (reduction + input transform) under 30 us at m = 256.
CALL=call83
ncu_op() {   # TAG K N M
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv python3 $ROOT/scripts/gpu_probe_linear.py run --k $2 --n $3 --K 4 --codebook mcg --m $4 --calls 4 > $RES/$1.csv 2> $RES/$1.err
  t "ncu $1 rc=$?"; python3 - $RES/$1.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
print(len(rows) - 1, "launches profiled; the last 8 (the last op call's):")
for r in rows[-8:]:
    print(f"{r[vi]:>12} {r[ui]:<6} {r[ki][:100]}")
PY
  save
}
for T in here s38; do
  tree $T
  ncu_op 83_${T}_8192_256 8192 28672 256
  ncu_op 83_${T}_4096_1024 4096 14336 1024
done
tree here
EXL3_JAX_PLAN=prefill NCU_TOP=25 ncu_kernel 83_dequant dequant --k 8192 --n 28672 --K 4 --codebook mcg --m 256 --calls 3
t done
