# Call 79 (~2.5 min): issue #5's m = 1024 / 4096 rows with the alternating method (`bench linear
# --rounds 3`, session 38): 8192x28672 and 4096x14336, K 3 / 4, mcg / mul1.
# Predictions (H100): m = 4096 0.87-0.95x (call 78: 0.88-0.94x for K4), m = 1024 0.74-0.80x
# (8192x28672, the transforms) and 0.68-0.76x (4096x14336, folded).
CALL=call79
timeout 200 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1024,4096 --rounds 3 --out $RES/79_linear.json > $RES/79_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/79_linear.log | grep -E "K=" | cut -c1-100; save
