# Call 32 (~5 min): packed kernels of 2+ token groups read "pairs" by default since call 31
# (m = 16: mul1 K4 -12 / -15%, K3 -5 / -6%, mcg K3 -1 / 0%). The default on the hardware:
# gpu_validate gemm decode rows (4096x4096, m 9 / 16 / 24 / 32; its decode_ring rows now run
# packed pairs through the ring too, new in session 26) and the group section (k 4096: members
# (4096, 1024, 1024) and (4096, 4096), m 1 / 3 / 16 / 32), then m = 24 (three token groups,
# 2-step chunks), pairs (default) against rows (EXL3_JAX_PAIR_FRAGMENTS=0); prediction: as
# m = 16, mul1 K4 -10 to -15%. Last, packed pairs through the cp.async ring at m = 16 past 2^26
# weights (EXL3_JAX_DECODE_RING=3,8,1: 3 slots, chunks halved to 4 steps by the 16 tokens' B
# words, 1 split, 74 KB and 62 registers at K4; 3,2,4: 2-step chunks, 4 splits, 37 KB), the
# way mul1 gained 1-15% from it at m = 4 / 8 with one token group. Prediction: 0 to -10% for
# mul1 (K3 most), mcg K3 (packed) 0 to +5%. If mul1 gains at both shapes, decode_plan gives
# mul1's two token groups the ring past 2^26 weights as it does for one.
CALL=call32
timeout 90 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 9,16,24,32 --k 4096 --n 4096 --budget-s 70 --out $RES/32_validate.json > $RES/32_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/32_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/32_validate.log | head -4 | cut -c1-300; save
timeout 80 python3 scripts/gpu_validate.py --quick --no-bench --group --sections group --k 4096 --n 4096 --budget-s 60 --out $RES/32_group.json > $RES/32_group.log 2>&1
t "validate group rc=$?"; grep -E "SUMMARY|\[group\]" $RES/32_group.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/32_group.log | head -4 | cut -c1-300; save
EXL3_JAX_PLAN=decode timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PAIR_FRAGMENTS --values '|0||0' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mul1,mcg --m 24 --out $RES/32_pairs_m24.json > $RES/32_pairs_m24.log 2>&1
t "ab pairs m24 rc=$?"; ab_rows $RES/32_pairs_m24.log EXL3_JAX_PAIR_FRAGMENTS; save
ab_ring 32_ring_m16 16 8192x28672,4096x28672 '|3,8,1|3,2,4|'
t done
