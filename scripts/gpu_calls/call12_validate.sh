# Call 12 (~9 min): correctness on the hardware for what call 11 timed, then the m = 1 stall
# samples. The MoE layer with FC1 / FC2 reading one-token rows (per-route plans: decode_bitwise,
# edge, accuracy, the Qwen3 geometry; compute-sanitizer memcheck, whose per-route case runs the
# new FC1 and FC2), split pairs over 3 token groups (gemm and group rows at m = 9..32), the four
# wgmma kinds; then call 9 (ncu warp-stall samples of the m = 1 decode kernel by SASS line).
CALL=call12
timeout 130 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 110 --sections decode_bitwise,edge,accuracy,geometry --out $RES/12_validate_moe.json > $RES/12_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/12_validate_moe.log | head -8 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 70 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $RES/12_memcheck_moe.log 2>&1
t "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/12_memcheck_moe.log | tr '\n' ' ' | cut -c1-400)"; save
EXL3_JAX_SPLIT_GROUPS=3 EXL3_JAX_PLAN=decode timeout 70 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm,group --group --m 9,16,24,32 --budget-s 55 --out $RES/12_validate_split.json > $RES/12_validate_split.log 2>&1
t "validate split groups rc=$?"; grep SUMMARY $RES/12_validate_split.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/12_validate_split.log | head -4 | cut -c1-300; save
timeout 100 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_tight,wgmma_fused --budget-s 85 --out $RES/12_validate_wgmma.json > $RES/12_validate_wgmma.log 2>&1
t "validate wgmma rc=$?"; grep SUMMARY $RES/12_validate_wgmma.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/12_validate_wgmma.log | head -4 | cut -c1-300; save
source scripts/gpu_calls/call9_ncu_source.sh
