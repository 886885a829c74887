# Call 3 (~9 min, in order of value; the limit may cut the tail): change 7 of session 17 (byte
# windows) against the tree before it, the wgmma kernel's weight-ring depth at m = 64..256 and
# its fused epilogue at m = 1024, the "pairs" layout for the packed kernels (validation, then
# A/B), memcheck of the row linear, tiles and wgmma plans. (Session 18's plan and cp.async A/Bs
# ran in session 20: bench/results/gpu_session20_h200_2026-12-05/.)
CALL=call3
for round in 1 2; do
  for name in prewin here; do
    tree $name
    timeout 60 python3 -m exl3_jax.cli bench linear --shapes 8192x28672 --K 3,6 --codebooks mcg --m 1,4 --out $RES/3_windows_${name}_r$round.json > $RES/3_windows_${name}_r$round.log 2>&1
    t "windows $name round $round rc=$?"; grep -v -i warn $RES/3_windows_${name}_r$round.log | grep -E "^ *8192" | cut -c1-110; save
  done
done
tree here
timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA --values '64,2,4,0,3|64,2,4,0,4|64,2,4,0,8|64,2,4,0,4' --shapes 14336x4096,8192x28672 --K 4 --codebooks mcg --m 64 --out $RES/3_ab_ring_64.json > $RES/3_ab_ring_64.log 2>&1
t "ab ring m=64 rc=$?"; grep '^{' $RES/3_ab_ring_64.log | cut -c1-200; save
timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA --values '128,2,1,1|128,2,1,0|128,2,1,1,6|256,2,1,1|128,2,1,1' --shapes 14336x4096,4096x14336 --K 4 --codebooks mcg --m 1024 --out $RES/3_ab_wgmma_1024.json > $RES/3_ab_wgmma_1024.log 2>&1
t "ab wgmma m=1024 rc=$?"; grep '^{' $RES/3_ab_wgmma_1024.log | cut -c1-200; grep -i "Traceback" -A5 $RES/3_ab_wgmma_1024.log | head; save
EXL3_JAX_PAIR_FRAGMENTS=1 timeout 100 python3 scripts/gpu_validate.py --quick --group --no-bench --sections gemm,group --m 9,16,31,32 --budget-s 80 --out $RES/3_validate_pairs.json > $RES/3_validate_pairs.log 2>&1
t "validate pairs rc=$?"; grep SUMMARY $RES/3_validate_pairs.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/3_validate_pairs.log | head -5 | cut -c1-300; save
timeout 90 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PAIR_FRAGMENTS --values '0|1|0|1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 16,24 --out $RES/3_ab_pairs.json > $RES/3_ab_pairs.log 2>&1
t "ab pairs rc=$?"; grep '^{' $RES/3_ab_pairs.log | cut -c1-200; grep -i "Traceback" -A3 $RES/3_ab_pairs.log | head; save
for plan in tiles row wgmma; do
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck $plan > $RES/3_memcheck_$plan.log 2>&1
t "memcheck $plan rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/3_memcheck_$plan.log | tr '\n' ' ')"; save
done
t done
