# Call 80 (~6 min; queued in session 38 for the next H200: every call of session 38 got an H100):
# issue #5's table on the H200 by the alternating method (`bench linear --rounds 3`), and the dot
# power study there.
# 1. m = 1, 4, 16, 128, 1024, 4096 on 8192x28672 and 4096x14336, K 3 / 4, mcg / mul1 (~3 min).
#    Predictions: m <= 16 within 3% of session 34's H200 rows (decode-bound, far from the cap;
#    the timing loop's barrier sits after the chain's add since session 40, call 88, and costs
#    these rows nothing measurable); m = 4096 a few % above call 70's 0.873-0.896x, as on the
#    H100 where alternation raised 4096x14336 m = 4096 from 0.84-0.87x to 0.87-0.92x (less
#    up to ~1.5% now that the op pays the chain's add as the bf16 dot does, session 40's call
#    92); m = 1024 below the 0.78-0.80x of session 34 at
#    8192x28672 (those rows left the W_hat dequantize out of the loop, session 39): ~0.70-0.76x
#    on both shapes, as on the H100 (call 85: 0.73-0.75x / 0.66-0.76x).
# 2. scripts/gpu_dot_power.py on the H200 (~1 min): is its fp16 dot's gap to bf16 larger than
#    the H100's? (Call 70, H200: 6-8% alone; call 73, H100: -1..+9% sustained, 4.3% unthrottled.)
CALL=call80
timeout 260 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,128,1024,4096 --rounds 3 --out $RES/80_linear.json > $RES/80_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/80_linear.log | grep -E "K=" | cut -c1-100; save
timeout 170 python3 scripts/gpu_dot_power.py --sustain-s 1.5 --out $RES/80_power.json > $RES/80_power.log 2>&1
t "dot power rc=$?"; grep '^{' $RES/80_power.log | cut -c1-200; save
t done
