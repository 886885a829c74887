# Call 96 (session 42, ~7 min, any card; queued: session 42 got no machine): two small cuts of
# the MoE decode layer's fixed cost (issue #6: Qwen3-30B-A3B m = 1, target 20.4 us; main
# 25.0-25.9 on session 41's H100).
# 1. hadamard128_lane's shuffle stages as one fma per element (other + sign * v, sign = -1 in
#    the upper lane) instead of a select and an add: bitwise the same (sign * v is exact; the
#    emulated kernels' outputs are bit-equal to 4bd7dc8's), ~35 fewer ALU-pipe selects per FC1
#    warp (CPU SASS: FC1 + FC2 FSEL 42 -> 7, activation 61 -> 6, combine 21 -> 6). Every
#    Hadamard kernel (dense transforms too) gets it.
# 2. Per-route plans launch rotate_in / the activation on each route's live row only (8 CTAs at
#    Qwen3 m = 1, was 64: 56 worked on padding rows nobody reads).
# The check: gpu_validate_moe's decode_bitwise, edge, tiers and accuracy sections on this tree.
# The A/B: alternating processes, 4bd7dc8 (tree s42, main before both cuts) and this tree,
# `bench moe` Qwen3-30B-A3B and GLM-5.2 TP4, m 1, 2, 4, no baseline.
# Prediction: every section ok. Qwen3 m = 1 -0.2 to -0.8 us (FC1's ALU-bound issue loses ~4%
# of its ALU ops; the activation's padding CTAs stop holding SM slots FC2's CTAs wait for),
# m = 2 / 4 -0.3 to -1.0; GLM-5.2 TP4 (6 rotated blocks per FC1 warp) -0.3 to -1.0 at m = 1..4.
# Keep if Qwen3 m = 1's mean is not slower by more than 0.3 us and no row is slower beyond its
# runs' spread; otherwise revert the cut that the rows point to.
CALL=call96
timeout 190 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 170 --sections decode_bitwise,edge,tiers,accuracy --out $RES/96_validate.json > $RES/96_validate.log 2>&1
t "validate rc=$?"; grep -E '"ok": false|error|Traceback' $RES/96_validate.log | cut -c1-160 | head -8; tail -1 $RES/96_validate.log | cut -c1-300; save
for r in 1 2; do
  for tr in s42 here; do
    tree $tr
    timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2,4 --no-baseline --out $RES/96_${tr}_$r.json > $RES/96_${tr}_$r.log 2>&1
    t "bench moe $tr run $r rc=$?"; grep -v -i warn $RES/96_${tr}_$r.log | grep -E "m=" | cut -c1-60 | head -6; save
  done
done
tree here
t done
