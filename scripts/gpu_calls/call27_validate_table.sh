# Call 27 (~7 min): session 26's plan changes on the hardware, then the issue #5 table with them.
# (1) gpu_validate gemm, decode plans, at 4096x16512 (68 M weights, past 2^26): m = 2 / 5 / 8
# (mul1 now streams through the ring there: 3 slots, 4-step chunks with 8 tokens' B fragments)
# and m = 24 (2-step chunks), every quick config, NaN-poisoned and production paths; the group
# section with two 4096x16512 members (m 1 / 3 / 16 / 32).
# (2) `bench linear` at the issue's shapes and m list (8192x28672, 4096x14336; K 3 / 4; mcg /
# mul1; m 1, 4, 16, 32, 128, 1024, 4096), L2-cold. Predictions against session 25's table:
# m = 4 mul1 -2 to -7% (K4) and -12 to -15% (K3); m = 16 as call 24b / 26 (8-step chunks);
# everything else within the noise (+-3%).
CALL=call27
timeout 130 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 2,5,8,24 --k 4096 --n 16512 --budget-s 100 --out $RES/27_validate.json > $RES/27_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/27_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/27_validate.log | head -4 | cut -c1-300; save
# the group kernel past 2^26 weights (two 4096x16512 members: mul1 K4 at m = 3 takes the ring)
timeout 90 python3 scripts/gpu_validate.py --quick --no-bench --group --sections group --k 4096 --n 16512 --budget-s 70 --out $RES/27_group.json > $RES/27_group.log 2>&1
t "validate group rc=$?"; grep -E "SUMMARY|\[group\]" $RES/27_group.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/27_group.log | head -4 | cut -c1-300; save
timeout 220 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/27_linear.json > $RES/27_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/27_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
t done
