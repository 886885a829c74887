# Call 72 (~4 min, an H100 / H200; queued in session 37): per-kernel durations of the prefill op
# under ncu (gpu__time_duration of every launch; the last op call's launches printed: the
# transforms or x's fusions, the dequantize kernel, cuBLAS), 8192x28672 K4 mcg at m = 1024 (the
# transforms, no fold) and 4096 (folded), because call 70's parts timed alone do not add up to
# the op (1042 us of parts against 814 of op at m = 1024).
# Predictions: at m = 1024 the output transform 60-100 us, the input transform 10-40, the
# dequantize 140-175, cuBLAS 600-670; at m = 4096 the folding dequantize 200-235 us and x's two
# fusions 30-40 together.
CALL=call72
ncu_op() {   # TAG K N M
  timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv python3 scripts/gpu_probe_linear.py run --k $2 --n $3 --K 4 --codebook mcg --m $4 --calls 5 > $RES/$1.csv 2> $RES/$1.err
  t "ncu $1 rc=$?"; python3 - $RES/$1.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
print(len(rows) - 1, "launches profiled (autotuning included); the last 16 (the last op call's):")
for r in rows[-16:]:
    print(f"{r[vi]:>12} {r[ui]:<6} {r[ki][:110]}")
PY
  save
}
ncu_op 72_ncu_8192_1024 8192 28672 1024
ncu_op 72_ncu_8192_4096 8192 28672 4096
t done
