# Call 85 (~3 min, an H100 / H200): main after session 39 (every prefill folds both sides; bench's
# timing loop keeps weight-only work inside through an optimization barrier): issue #5's rows
# at K4, mcg / mul1, m 1 / 16 / 128 / 1024 / 4096 on 8192x28672 and 4096x14336, alternating.
# Predictions: on an H100, m = 1 and 16 within +-3% of session 38's call 74 (8192x28672 m = 1
# 64.6 / 64.1 us, m = 16 90.4 / 82.4; 4096x14336 m = 1 25.2 / 24.4, m = 16 30.2 / 28.2: the
# decode kernels read x, so the barrier hoists nothing there), m = 1024 / 4096 as call 84's s38
# columns (0.73-0.74x / 0.89-0.93x at 8192x28672); on an H200, m <= 16 within 3% of session 34.
CALL=call85
timeout 200 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 1,16,128,1024,4096 --rounds 3 --out $RES/85_linear.json > $RES/85_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/85_linear.log | grep -E "K=" | cut -c1-100; save
t done
