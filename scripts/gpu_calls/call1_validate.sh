# Call 1 (~6 min, in order of value; the call's limit may cut the tail): the hardware's word on
# what CI already checks on the emulated kernels (EXL3_JAX_EMULATE, bench/NOTES.md session 19:
# every plan bit-exact / within 1e-3 at small shapes, races and ordering). First what the
# interpreter cannot confirm, its reading of wgmma (descriptor, 128-byte swizzle, fragments)
# shared with the kernel's: the token-tile kernels in their own process (a hang or fault
# there cannot cost the rest) on one-hot rows (bitwise, layout diagnosis of any mismatch)
# and their GEMM rows at m = 33, 128, 1000; then the dense and MoE validations at
# production-like sizes (k 2048, n 1024; the MoE's Qwen3 geometry); memcheck of wgmma.
CALL=call1
timeout 180 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds tiles,wgmma,wgmma_tight,wgmma_fused --budget-s 120 --out $RES/1_validate_tiles.json > $RES/1_validate_tiles.log 2>&1
t "validate token tiles rc=$?"; grep SUMMARY $RES/1_validate_tiles.log | cut -c1-400; grep -i "FAIL\|Traceback\|first_bad\|layout" $RES/1_validate_tiles.log | head -8 | cut -c1-300; save
timeout 150 python3 scripts/gpu_validate.py --quick --group --no-bench --sections decode_exact,gemm,group,row_linear --m 1,16,1000 --kinds decode,prefill --budget-s 110 --out $RES/1_validate.json > $RES/1_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/1_validate.log | cut -c1-400; grep -i "FAIL\|Traceback\|first_bad" $RES/1_validate.log | head -8 | cut -c1-300; save
timeout 120 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 90 --sections decode_bitwise,tiers,geometry,accuracy --out $RES/1_validate_moe.json > $RES/1_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/1_validate_moe.log | head -8 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck wgmma > $RES/1_memcheck_wgmma.log 2>&1
t "memcheck wgmma rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/1_memcheck_wgmma.log | tr '\n' ' ')"; save
t done
