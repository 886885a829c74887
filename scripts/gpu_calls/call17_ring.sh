# Call 17 (~7 min): the decode kernel's loads through a per-warp cp.async ring (session 24,
# MmaConfig.ring; EXL3_JAX_DECODE_RING="slots,unroll,splits,min_ctas"), and the prefill plan
# with the transform kernels around W_hat below 2048 rows (EXL3_JAX_PREFILL_FOLD 0 | 1).
# Direct loads (the value '') against ring settings in one process, the row linear off so m = 1
# runs trellis_mma in every row; outputs compared with the first value's (rel_l2).
CALL=call17
ab_ring() {   # TAG SHAPES K CODEBOOKS M VALUES SECONDS
    EXL3_JAX_PLAN=decode timeout $7 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values "$6" --env2 EXL3_JAX_ROW_LINEAR=0 --shapes $2 --K $3 --codebooks $4 --m $5 --out $RES/$1.json > $RES/$1.log 2>&1
    t "ab ring $1 rc=$?"; grep '^{' $RES/$1.log | cut -c1-230; grep -i "Traceback\|Error" $RES/$1.log | head -3; save
}
ab_ring 17_ring_m1 8192x28672,4096x14336 4 mcg,mul1 1 '|3,4,2,6|3,2,4,6|4,2,2,6|3,4,1,6|3,4,2,0|' 200
ab_ring 17_ring_k3 8192x28672 3 mcg,mul1 1 '|3,4,2,6|3,2,4,6|' 70
ab_ring 17_ring_m4 8192x28672 4 mcg 4,16 '|3,2,4,6|3,1,4,6|' 80
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode,prefill --m 1,3,8,16,32,1000 --budget-s 95 --out $RES/17_validate.json > $RES/17_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/17_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/17_validate.log | head -4 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 70 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck decode > $RES/17_memcheck.log 2>&1
t "memcheck decode rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/17_memcheck.log | tr '\n' ' ' | cut -c1-500)"; save
EXL3_JAX_PLAN=prefill timeout 90 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PREFILL_FOLD --values '0|1|0|1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 1024,2048,4096 --out $RES/17_fold.json > $RES/17_fold.log 2>&1
t "ab fold rc=$?"; grep '^{' $RES/17_fold.log | cut -c1-200; save
t done
