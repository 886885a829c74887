# Call 3 (~10 min, in order of value; the limit may cut the tail): the token-tile plans against
# the prefill plan (wgmma and tiles, m = 64..4096) and wgmma against decode (m = 16, 32), change
# 7 (byte windows)
# against the tree before it, the wgmma token tile, cp.async staging and the fused output
# transform at m = 1024 (cp.async at 128), the "pairs" layout for the packed
# kernels (validation, then A/B), memcheck of the row linear and tiles plans.
CALL=call3
timeout 200 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PLAN --values 'prefill|wgmma|tiles|prefill|wgmma|tiles' --shapes 14336x4096,4096x14336,8192x28672 --K 4 --codebooks mcg --m 64,128,1024,4096 --out $RES/3_ab_plans.json > $RES/3_ab_plans.log 2>&1
t "ab plans rc=$?"; grep '^{' $RES/3_ab_plans.log | cut -c1-200; grep -i "Traceback" -A5 $RES/3_ab_plans.log | head; save
timeout 120 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PLAN --values 'decode|wgmma|decode|wgmma' --shapes 14336x4096,4096x14336,8192x28672 --K 4 --codebooks mcg,mul1 --m 16,32 --out $RES/3_ab_small.json > $RES/3_ab_small.log 2>&1
t "ab decode/wgmma m=16,32 rc=$?"; grep '^{' $RES/3_ab_small.log | cut -c1-200; grep -i "Traceback" -A5 $RES/3_ab_small.log | head; save
for round in 1 2; do
  for name in prewin here; do
    tree $name
    timeout 60 python3 -m exl3_jax.cli bench linear --shapes 8192x28672 --K 3,6 --codebooks mcg --m 1,4 --out $RES/3_windows_${name}_r$round.json > $RES/3_windows_${name}_r$round.log 2>&1
    t "windows $name round $round rc=$?"; grep -v -i warn $RES/3_windows_${name}_r$round.log | grep -E "^ *8192" | cut -c1-110; save
  done
done
tree here
timeout 150 python3 scripts/gpu_linear_ab.py --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA --values '128,2,1|128,2,1,0,0|128,2,1,1|256,2,1|256,2,1,1|128,2,1|128,2,1,0,0|128,2,1,1|256,2,1|256,2,1,1' --shapes 14336x4096,4096x14336 --K 4 --codebooks mcg --m 1024 --out $RES/3_ab_wgmma_1024.json > $RES/3_ab_wgmma_1024.log 2>&1
t "ab wgmma m=1024 rc=$?"; grep '^{' $RES/3_ab_wgmma_1024.log | cut -c1-200; grep -i "Traceback" -A5 $RES/3_ab_wgmma_1024.log | head; save
timeout 60 python3 scripts/gpu_linear_ab.py --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA --values '128,2,7|128,2,7,1|128,2,7|128,2,7,1' --shapes 14336x4096 --K 4 --codebooks mcg --m 128 --out $RES/3_ab_wgmma_128.json > $RES/3_ab_wgmma_128.log 2>&1
t "ab wgmma m=128 rc=$?"; grep '^{' $RES/3_ab_wgmma_128.log | cut -c1-200; save
EXL3_JAX_PAIR_FRAGMENTS=1 timeout 100 python3 scripts/gpu_validate.py --quick --group --no-bench --sections gemm,group --m 9,16,31,32 --budget-s 80 --out $RES/3_validate_pairs.json > $RES/3_validate_pairs.log 2>&1
t "validate pairs rc=$?"; grep SUMMARY $RES/3_validate_pairs.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/3_validate_pairs.log | head -5 | cut -c1-300; save
timeout 90 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PAIR_FRAGMENTS --values '0|1|0|1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 16,32 --out $RES/3_ab_pairs.json > $RES/3_ab_pairs.log 2>&1
t "ab pairs rc=$?"; grep '^{' $RES/3_ab_pairs.log | cut -c1-200; grep -i "Traceback" -A3 $RES/3_ab_pairs.log | head; save
for plan in tiles row; do
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck $plan > $RES/3_memcheck_$plan.log 2>&1
t "memcheck $plan rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/3_memcheck_$plan.log | tr '\n' ' ')"; save
done
t done
