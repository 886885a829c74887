# Call 70 (~4 min, an H100 / H200; session 37): where the prefill plan's time goes at m = 1024 /
# 4096 (scripts/gpu_prefill_parts.py: each part of the plan auto picks timed alone, against XLA's
# bf16 dot), K4 mcg on the two large shapes, then K3 mul1 at m = 4096.
# Predictions (H200; call 52: 8192x28672 m = 4096 3217 us against bf16's 2856, 4096x14336 759
# against 673): folded at 4096 on both shapes; the dequantize kernel ~0.6-0.7 ns per weight
# (150-165 us at 235 M weights, 35-42 us at 58.7 M), x_prep 40-60 / 20-30 us, the fp16 dot with
# float32 out within 3% of bf16_f32, bf16_f32 25-60 us above bf16 at m = 4096 (its output is
# twice the bytes). 8192x28672 m = 1024 takes the transforms (no fold): had_in ~10 us, dequant
# 120-140, had_out 60-80.
CALL=call70
timeout 240 python3 scripts/gpu_prefill_parts.py --shapes 8192x28672,4096x14336 --m 1024,4096 --K 4 --codebook mcg --out $RES/70_parts_k4_mcg.json > $RES/70_parts_k4_mcg.log 2>&1
t "parts K4 mcg rc=$?"; grep '^{' $RES/70_parts_k4_mcg.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['k'],r['n'],r['m'],r['part'],r['us'],(r['error'] or '')[:80])"
grep -v '^{' $RES/70_parts_k4_mcg.log | grep -v -i warn | tail -12 | cut -c1-200; save
timeout 120 python3 scripts/gpu_prefill_parts.py --shapes 8192x28672,4096x14336 --m 4096 --K 3 --codebook mul1 --out $RES/70_parts_k3_mul1.json > $RES/70_parts_k3_mul1.log 2>&1
t "parts K3 mul1 rc=$?"; grep '^{' $RES/70_parts_k3_mul1.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['k'],r['n'],r['m'],r['part'],r['us'],(r['error'] or '')[:80])"
save
t done
