# Call 1 (~9 min): correctness of wip/next's kernels (session 17's changes 1-7, session 18's
# wgmma kernel): decode bit-exact (with the unrounded split-pair check), GEMM at every plan incl.
# the tiles and wgmma rows at m = 33, 128, 1000, linear groups, row linear, row scale, dispatch;
# memcheck of the decode and wgmma plans; the MoE layer (mul1 and tiered included); the mixed-K
# MoE test.
CALL=call1
python3 scripts/gpu_validate.py --quick --group --no-bench --sections decode_exact,gemm,group,row_linear,row_scale,dispatch --m 1,2,3,8,16,33,128,1000 --kinds decode,prefill,tiles --budget-s 250 --out $RES/1_validate.json > $RES/1_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/1_validate.log | cut -c1-400; grep -i "FAIL\|Traceback" $RES/1_validate.log | head -8 | cut -c1-300; save
timeout 200 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --m 16,33,128,1000 --kinds wgmma,wgmma_async,wgmma_fused --budget-s 150 --out $RES/1_validate_wgmma.json > $RES/1_validate_wgmma.log 2>&1
t "validate wgmma rc=$?"; grep SUMMARY $RES/1_validate_wgmma.log | cut -c1-400; grep -i "FAIL\|Traceback" $RES/1_validate_wgmma.log | head -8 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck decode > $RES/1_memcheck_decode.log 2>&1
t "memcheck decode rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/1_memcheck_decode.log | tr '\n' ' ')"; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck wgmma > $RES/1_memcheck_wgmma.log 2>&1
t "memcheck wgmma rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/1_memcheck_wgmma.log | tr '\n' ' ')"; save
timeout 170 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 150 --out $RES/1_validate_moe.json > $RES/1_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/1_validate_moe.log | head -8 | cut -c1-300; save
timeout 90 python3 -m pytest -q -x tests/test_moe_mixed_k.py -k gpu > $RES/1_pytest_mixed_k.log 2>&1
t "pytest mixed-K rc=$?"; tail -3 $RES/1_pytest_mixed_k.log; save
t done
