# Call 42 (~8 min, on an H200 if one starts: the issues' targets are H200 numbers): the wgmma
# kernel with two k16 steps per commit group (STEP_BATCH, session 29; call 41 timed it against
# one step on the H100 with bit-equal outputs at K4). (1) Hardware validation of the wgmma
# kinds (one-hot decode, GEMM rows with poisoned outputs at m 33 / 128 / 1000, 8 representative
# codebook x rate configs) and memcheck of the wgmma plan. (2) `bench linear`, issue #5's
# table with this session's defaults. (3) `bench moe`, Qwen3-30B-A3B m 1..8.
CALL=call42
timeout 150 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds wgmma,wgmma_tight,wgmma_fused --m 33,128,1000 --budget-s 120 --out $RES/42_validate.json > $RES/42_validate.log 2>&1
t "validate wgmma rc=$?"; tail -4 $RES/42_validate.log | cut -c1-200; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck wgmma > $RES/42_memcheck_wgmma.log 2>&1
t "memcheck wgmma rc=$?"; grep -E "ERROR SUMMARY|error" $RES/42_memcheck_wgmma.log | head -3; save
timeout 170 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/42_linear.json > $RES/42_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/42_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/42_moe.json > $RES/42_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/42_moe.log | tail -8 | cut -c1-160; save
t done
