# Call 47 (~9.5 min; named nvidia-h200, since the issues' targets are H200 numbers; an H100 may
# come instead): the tree after the warp-specialised form's removal (session 30: the register-A
# wgmma kernel is again the file calls 41-42 validated and timed). (1) Hardware check of the
# wgmma kinds (one-hot decode, GEMM rows with poisoned outputs at m 33 / 128 / 1000). (2) `bench
# linear`, issue #5's table (8192x28672 and 4096x14336, K 3 / 4, mcg / mul1, m 1..4096).
# (3) `bench moe`, Qwen3-30B-A3B m 1..8. (4) e2e decode: Llama-3-8B geometry b1 / b8 against
# bf16, Qwen3-30B-A3B b1 / b8. Predictions: on an H200 the kernels' times within 5% of
# session 28's H200 (mcg K4 m = 1 ~64 us) and of call 42's H100 rows (decode-bound kernels run
# at the same clocks); bf16 ~25-40% faster than the H100's, so x bf16 at m = 1 1.65-1.75.
CALL=call47
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds wgmma,wgmma_tight,wgmma_fused --m 33,128,1000 --budget-s 85 --out $RES/47_validate.json > $RES/47_validate.log 2>&1
t "validate wgmma rc=$?"; tail -3 $RES/47_validate.log | cut -c1-200; save
timeout 170 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/47_linear.json > $RES/47_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/47_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/47_moe.json > $RES/47_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/47_moe.log | tail -8 | cut -c1-160; save
(cd scripts && timeout 190 python3 gpu_e2e_decode.py --cases dense:1:512,dense_bf16:1:512,dense:8:64,dense_bf16:8:64,moe:1:512,moe:8:64 --codebook mcg --repeats 3 --budget-s 170 --hard-limit-s 185 --out $RES/47_e2e.json > $RES/47_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "tok/s" $RES/47_e2e.log | cut -c1-200 | head -8; save
t done
