# Call 73 (~9 min, an H200): why the prefill plan's fp16 dot is slower than the bf16 dot.
# Call 70 (H200, 8192x28672 m = 4096) timed the plan's fp16 x fp16 dot, its weight dequantized
# outside the loop, at 2972 us with fp16 out and 3017 with float32 out against 2788 for XLA's
# bf16 dot: 6-8% of the m = 4096 gap to 0.9x is the dot itself, not the dequantize.
# 1. scripts/gpu_dot_power.py: bf16 / fp16 dots with 8, 9 and 11 significant weight bits, an
#    all-zero weight, the plan's own operands; us, SM clock, power, clock-event reasons.
#    Prediction: the H200 is at its power cap in these dots (reasons show the power cap), the
#    fp16 dots with bf16's 8 bits run within 2% of bf16 and the 11-bit ones 4-8% slower at a
#    clock 4-8% lower; bf16_zero_w runs at the top clock.
# 2. Seven variants at 8192x28672 once each under ncu (the autotuner's launches left out):
#    kernel names (cuBLAS's choice), durations and the SM clock.
#    Prediction: the same kernel family for bf16 and fp16 at each output width.
# 3. Call 72 (the prefill op's own kernels under ncu, m = 1024 and 4096), as queued.
CALL=call73
timeout 170 python3 scripts/gpu_dot_power.py --sustain-s 1.5 --out $RES/73_power.json > $RES/73_power.log 2>&1
t "dot power rc=$?"; grep '^{' $RES/73_power.log | cut -c1-240; save
for V in bf16 bf16_f32 f16_bf16bits_f32 f16_bf16bits_f16 f16_full_f32 f16_full_f16 plan_f32; do
  timeout 40 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second --csv python3 scripts/gpu_dot_power.py --once --shapes 8192x28672 --only $V > $RES/73_names_$V.csv 2> $RES/73_names_$V.err
  echo "== $V rc=$?"; grep -v "^==PROF==" $RES/73_names_$V.err | tail -2 | cut -c1-200; python3 - $RES/73_names_$V.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no rows"); sys.exit()
hdr = rows[0]; ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value")
for r in rows[1:]:
    print(f"{r[mi][:28]:<28} {r[vi]:>14} {r[ki][:110]}")
PY
done
t "ncu names"; save
source scripts/gpu_calls/call72_prefill_ncu.sh
