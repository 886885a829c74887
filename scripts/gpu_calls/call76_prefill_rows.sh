# Call 76 (~4 min, an H200 wanted): issue #5's m = 1024 / 4096 rows with main's 16-byte output
# transform (session 38): `bench linear` 8192x28672 and 4096x14336, K 3 / 4, mcg / mul1.
# Predictions (H200): 8192x28672 m = 1024 (the transforms) 0.80-0.83x (call 70: 0.80x; call 71
# took ~28 us off on an H100), the folded rows unchanged within the spread: m = 4096
# 0.87-0.90x, 4096x14336 m = 1024 0.72-0.77x. On an H100 the ratios are that card's.
CALL=call76
timeout 280 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1024,4096 --out $RES/76_linear.json > $RES/76_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/76_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -30; save
