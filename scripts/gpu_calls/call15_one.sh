# Call 15 (~10 min, cut off by the limit if need be; every step saves): session 23 in one call.
# (1) The prefill plan with both rotations, suh and svh folded into the dequantized weight (one
# dequantize launch + one XLA dot, no transform kernels): correctness (the dequantize kernel's
# W_hat bit-exact and its rotated weight within 8e-4; GEMM rows with NaN-poisoned outputs, and
# compute-sanitizer memcheck), then here vs prev (the transforms-around-W_hat prefill) at
# m = 1024 and 4096 on the two large shapes. (2) Call 14 (the MoE one-token rows here vs
# prev). (3) Call 13's rest: MoE validation, split groups, A from shared memory, ncu.
CALL=call15
tree here
timeout 120 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds prefill --m 33,128,1000,4096 --budget-s 100 --out $RES/15_validate_prefill.json > $RES/15_validate_prefill.log 2>&1
t "validate prefill rc=$?"; grep SUMMARY $RES/15_validate_prefill.log | cut -c1-300; grep -i "FAIL\|Traceback\|Error" $RES/15_validate_prefill.log | head -4 | cut -c1-300; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck prefill > $RES/15_memcheck_prefill.log 2>&1
t "memcheck prefill rc=$? $(grep -E 'ERROR SUMMARY' $RES/15_memcheck_prefill.log | tr '\n' ' ' | cut -c1-200)"; save
bench_prefill() {
    tree $1
    EXL3_JAX_PLAN=prefill timeout $3 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mcg,mul1 --m 1024,4096 --out $RES/$2.json > $RES/$2.log 2>&1
    t "bench prefill $2 rc=$?"; grep -v -i warn $RES/$2.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -20; save
}
bench_prefill here 15_prefill_here 80; bench_prefill prev 15_prefill_prev 80
bench_moe here 15_moe_here 60; bench_moe prev 15_moe_prev 60
tree here
timeout 120 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 100 --sections decode_bitwise,edge,accuracy --out $RES/15_validate_moe.json > $RES/15_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/15_validate_moe.log | head -8 | cut -c1-300; save
# Is the m = 1 decode kernel bound by its DRAM traffic? The same kernel on weights that stay in
# the 50 MB L2 across the timing loop (8192x4096 and 4096x4096 K4: 16.8 and 8.4 MB) against
# 8192x28672 (117 MB): per-weight rates far above the large shape's say DRAM; equal rates say
# issue or latency inside the SM.
timeout 60 python3 -m exl3_jax.cli bench linear --shapes 8192x4096,4096x4096,8192x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $RES/15_l2_resident.json > $RES/15_l2_resident.log 2>&1
t "l2 resident rc=$?"; grep -v -i warn $RES/15_l2_resident.log | grep -E "^ *(8192|4096)" | cut -c1-110; save
ab_split_groups 15_ab_split_16 16
for m in 128 1024; do ab_a_smem 15_smem_$m $m; done
source scripts/gpu_calls/call9_ncu_source.sh
