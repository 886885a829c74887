# Call 87 (~3 min, an H200 preferred; queued in session 39): issue #6's Qwen3-30B-A3B layer at
# m = 1 / 2 / 4 / 8 with bench's timing-loop barrier (session 39) against main before it (tree
# s38 = e16e6fc: no barrier), alternating, so later m = 1 numbers compare with the 24.7-25.4 us
# of sessions 34-35 on an honest footing. Needs .device/s38.tar.xz (make_device_dir.sh).
# Main's `bench moe` also passes its ids straight to the layer (s38 tied them to x through
# routes_of_call: one select per call that a model does not run), so the A/B measures both.
# Prediction: within +-1 us per row (the layer's custom calls read x; the barrier hoists nothing
# there, and call 86 put its own cost at 0-2 us per call on ~25 us dense ops).
CALL=call87
I=0
for T in s38 here s38 here; do
  I=$((I + 1)); tree $T
  timeout 70 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/87_moe_${I}_$T.json > $RES/87_moe_${I}_$T.log 2>&1
  t "bench moe $I $T rc=$?"; grep -v -i warn $RES/87_moe_${I}_$T.log | tail -5 | cut -c1-140; save
done
tree here
t done
