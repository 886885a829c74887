# Call 86 (~2 min, warm after call 85): does bench's new optimization barrier cost the decode rows
# anything? Call 85 read m = 1 / 16 1-7% above session 38's call 74 (another H100, another day).
# Alternating s38 (no barrier) and main, K4 mcg / mul1, m 1 / 16, both shapes.
# Prediction: within +-2% (the decode plans' XLA work on the weights is bitcasts; nothing to hoist).
CALL=call86
I=0
for T in s38 here s38 here; do
  I=$((I + 1)); tree $T
  timeout 60 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 1,16 --rounds 3 --out $RES/86_ab_${I}_$T.json > $RES/86_ab_${I}_$T.log 2>&1
  t "bench linear $I $T rc=$?"; grep -v -i warn $RES/86_ab_${I}_$T.log | grep -E "K=" | cut -c1-80; save
done
tree here
t done
