# Call 1 (~9-10 min, in order of value; the call's limit may cut the tail): correctness of
# wip/next's kernels. Dense: decode bit-exact (with the unrounded split-pair check), GEMM at
# the decode and prefill plans, linear groups, row linear, row scale, dispatch; the MoE layer
# (mul1 and tiered layers included); then, in their own process (never run before: a hang or
# fault there cannot cost the rest), the token-tile kernels: tiles and wgmma on one-hot rows
# (bitwise, with a layout diagnosis of any mismatch) and their GEMM rows (tiles, wgmma,
# wgmma_async, wgmma_fused at m = 33, 128, 1000); memcheck of the decode and wgmma plans.
CALL=call1
timeout 300 python3 scripts/gpu_validate.py --quick --group --no-bench --sections decode_exact,gemm,group,row_linear,row_scale,dispatch --m 1,2,3,8,16,33,128,1000 --kinds decode,prefill --budget-s 220 --out $RES/1_validate.json > $RES/1_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/1_validate.log | cut -c1-400; grep -i "FAIL\|Traceback\|first_bad" $RES/1_validate.log | head -8 | cut -c1-300; save
timeout 150 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 120 --out $RES/1_validate_moe.json > $RES/1_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/1_validate_moe.log | head -8 | cut -c1-300; save
timeout 180 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds tiles,wgmma,wgmma_async,wgmma_fused --budget-s 120 --out $RES/1_validate_tiles.json > $RES/1_validate_tiles.log 2>&1
t "validate token tiles rc=$?"; grep SUMMARY $RES/1_validate_tiles.log | cut -c1-400; grep -i "FAIL\|Traceback\|first_bad\|layout" $RES/1_validate_tiles.log | head -8 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck decode > $RES/1_memcheck_decode.log 2>&1
t "memcheck decode rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/1_memcheck_decode.log | tr '\n' ' ')"; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck wgmma > $RES/1_memcheck_wgmma.log 2>&1
t "memcheck wgmma rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/1_memcheck_wgmma.log | tr '\n' ' ')"; save
t done
