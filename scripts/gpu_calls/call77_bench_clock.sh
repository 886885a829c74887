# Call 77 (~3 min): `bench linear` with each row's SM clock and power (ffi.bench.ClockSampler,
# new in session 38) on the two large shapes, K4 mcg / mul1, m = 1 and 4096.
# Predictions: every m = 4096 row (op and bf16) power-capped (share 1.0) at 1.35-1.55 GHz on an
# H100, the op's clock within 3% of bf16's (its dequantize and x pass run cooler, its fp16 dot
# hotter); m = 1 rows not capped (well under 700 W), at 1.7-1.98 GHz.
CALL=call77
timeout 200 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 1,4096 --out $RES/77_linear.json > $RES/77_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/77_linear.log | grep -E "^ *(8192|4096)" | cut -c1-40,60-90,120-200 | head -20; save
