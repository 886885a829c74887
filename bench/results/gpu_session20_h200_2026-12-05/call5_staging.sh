# Call 5 (~7 min): the two weight-staging paths of session 20 on the hardware. Both stage the
# trellis words by cp.async because ptxas sinks register-destined global loads next to their
# first use (SASS of sessions 16-20): the wgmma kernel's weight ring (EXL3_JAX_WGMMA_RING=R,
# R - 1 chunks ahead) and the decode kernel's per-warp chunk slot (EXL3_JAX_STAGE_WEIGHTS=1
# [,N CTAs per SM]). Validation first (both checked under emulation in CI), then A/B against
# bf16, then Nsight Compute on the m = 1 decode kernel, staged and not.
CALL=call5
timeout 60 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --m 128,1000 --kinds wgmma_ring --budget-s 45 --out $RES/5_validate_ring.json > $RES/5_validate_ring.log 2>&1
t "validate ring rc=$?"; grep SUMMARY $RES/5_validate_ring.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/5_validate_ring.log | head -4 | cut -c1-300; save
EXL3_JAX_STAGE_WEIGHTS=1 timeout 70 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --m 1,4,16 --kinds decode --budget-s 50 --out $RES/5_validate_staged.json > $RES/5_validate_staged.log 2>&1
t "validate staged rc=$?"; grep SUMMARY $RES/5_validate_staged.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/5_validate_staged.log | head -4 | cut -c1-300; save
timeout 80 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_STAGE_WEIGHTS --values '0|1|1,8|0|1|1,8' --shapes 8192x28672 --K 3,4 --codebooks mcg,mul1 --m 1 --out $RES/5_ab_staged_m1.json > $RES/5_ab_staged_m1.log 2>&1
t "ab staged m=1 rc=$?"; grep '^{' $RES/5_ab_staged_m1.log | cut -c1-200; grep -i "Traceback" -A5 $RES/5_ab_staged_m1.log | head; save
timeout 140 python3 scripts/gpu_linear_ab.py --bf16 --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA_RING --values '0|6|4|6' --shapes 14336x4096,4096x14336,8192x28672 --K 4 --codebooks mcg --m 32,128,1024 --out $RES/5_ab_ring.json > $RES/5_ab_ring.log 2>&1
t "ab ring rc=$?"; grep '^{' $RES/5_ab_ring.log | cut -c1-200; grep -i "Traceback" -A5 $RES/5_ab_ring.log | head; save
for v in 0 1,8; do
EXL3_JAX_STAGE_WEIGHTS=$v timeout 50 ncu --clock-control none --kernel-name regex:trellis_mma --launch-skip 2 --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis python3 scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 4 --codebook mcg --m 1 > $RES/5_ncu_staged_$v.txt 2>&1
t "ncu staged=$v rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|DRAM Throughput|Memory Throughput|Shared Memory Configuration Size|Dynamic Shared|Block Limit" $RES/5_ncu_staged_$v.txt | head -12; save
done
timeout 50 python3 scripts/gpu_linear_ab.py --bf16 --env2 EXL3_JAX_ROW_LINEAR=0 --env EXL3_JAX_STAGE_WEIGHTS --values '0|1|0|1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 4,16 --out $RES/5_ab_staged_m4.json > $RES/5_ab_staged_m4.log 2>&1
t "ab staged m=4,16 rc=$?"; grep '^{' $RES/5_ab_staged_m4.log | cut -c1-200; save
t done
