# Call 78 (~2.5 min): `bench linear` with each row's op and bf16 dot timed in alternation
# (--rounds 3, session 38), m = 4096, the two large shapes, K4 mcg / mul1, in two
# separate processes: does alternation shrink the 10% spread between calls 76 and 77?
# Prediction: each row's ratio within 3% between the two processes (call 76 vs 77: up to 9%),
# the rounds of one side within 5% of each other.
CALL=call78
for P in 1 2; do
  timeout 110 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 4096 --rounds 3 --out $RES/78_linear_$P.json > $RES/78_linear_$P.log 2>&1
  t "bench linear $P rc=$?"; grep -v -i warn $RES/78_linear_$P.log | grep -E "K=4" | cut -c1-100; save
  python3 -c "
import json; d=json.load(open('$RES/78_linear_$P.json'))
for r in d['rows']: print(r['k'], r['n'], r['codebook'], r['us_rounds'], r['bf16_us_rounds'])"
done
t done
