# Call 4 (~9.5 min): which plan serves 8 <= m <= 4096 on the H200 (issue #5 item 7: m = 128
# >= 1.0x bf16, m >= 1024 >= 0.9x). The token-tile kernels' GEMM rows first (bit-exact on
# one-hot rows in session 19; their GEMM rows were cut by that call's budget), then the plans
# against each other and against bf16 in one process per step: prefill / wgmma / tiles at
# m = 64..4096, decode / wgmma at m = 8..32, wgmma's variants at m = 1024.
CALL=call4
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --m 33,128,1000 --kinds tiles,wgmma,wgmma_async,wgmma_fused --budget-s 90 --out $RES/4_validate_tiles.json > $RES/4_validate_tiles.log 2>&1
t "validate token tiles rc=$?"; grep SUMMARY $RES/4_validate_tiles.log | cut -c1-400; grep -i "FAIL\|Traceback" $RES/4_validate_tiles.log | head -5 | cut -c1-300; save
timeout 230 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'prefill|wgmma|tiles|wgmma' --shapes 4096x14336,8192x28672,14336x4096 --K 4 --codebooks mcg --m 64,128,1024,4096 --out $RES/4_ab_plans.json > $RES/4_ab_plans.log 2>&1
t "ab plans rc=$?"; grep '^{' $RES/4_ab_plans.log | cut -c1-220; grep -i "Traceback" -A5 $RES/4_ab_plans.log | head; save
timeout 140 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'decode|wgmma|decode|wgmma' --shapes 4096x14336,8192x28672 --K 4 --codebooks mcg,mul1 --m 8,16,32 --out $RES/4_ab_small.json > $RES/4_ab_small.log 2>&1
t "ab decode/wgmma rc=$?"; grep '^{' $RES/4_ab_small.log | cut -c1-220; grep -i "Traceback" -A5 $RES/4_ab_small.log | head; save
timeout 90 python3 scripts/gpu_linear_ab.py --env2 EXL3_JAX_PLAN=wgmma --env EXL3_JAX_WGMMA --values '128,2,1|128,2,1,0,0|128,2,1,1|256,2,1|128,2,1' --shapes 4096x14336 --K 4 --codebooks mcg --m 1024 --out $RES/4_ab_wgmma_1024.json > $RES/4_ab_wgmma_1024.log 2>&1
t "ab wgmma m=1024 rc=$?"; grep '^{' $RES/4_ab_wgmma_1024.log | cut -c1-200; grep -i "Traceback" -A5 $RES/4_ab_wgmma_1024.log | head; save
t done
