# Call 52 (~9.5 min; session 31, when `status` offered an H200 for the first time since session
# 28): issue #5's table, the Qwen3 MoE layer and the e2e decode on the H200 with main's defaults
# after sessions 29-30 (the warp-specialised form removed, the prefill fold by weight size, wgmma
# to 256 rows up to 60 Mi weights). (1) Hardware check of the wgmma kinds (one-hot decode, GEMM
# rows with poisoned outputs at m 33 / 128 / 1000). (2) `bench linear` (8192x28672 and
# 4096x14336, K 3 / 4, mcg / mul1, m 1..4096). (3) `bench moe`, Qwen3-30B-A3B m 1..8. (4) e2e
# decode: Llama-3-8B geometry b1 / b8 against bf16, Qwen3-30B-A3B b1 / b8.
# Predictions: the decode-bound rows (m <= 16) within 5% of session 28's H200 (mcg K4 m = 1
# 63-66 us, 1.67-1.71x bf16; mul1 1.73-1.76x); m = 128 0.75-0.9x (the H200's bf16 118-133 us
# against the kernel's ~200 us on the H100, whose m = 128 is partly decode-bound, partly wgmma);
# m = 1024 / 4096 0.75-0.85x (the prefill plan gains from the H200's HBM less than bf16 does);
# e2e Llama b1 ~300 tok/s against bf16 ~165 (1.8x), Qwen3 b1 300-320.
# On an H100 (call 47 timed this code's table there, but for the prefill fold rule) only the rows
# the new fold rule changes: 4096x14336 at m = 1024 / 4096 (call 47 0.66-0.67x at 1024, the fold
# now from m ~ 170; prediction 0.72-0.78x at 1024, 4096 unchanged).
CALL=call52
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
*H200*) ;;
*)  timeout 150 python3 -m exl3_jax.cli bench linear --shapes 4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1024,4096 --out $RES/52_linear_fold.json > $RES/52_linear_fold.log 2>&1
    t "bench linear (fold rows) rc=$?"; grep -v -i warn $RES/52_linear_fold.log | grep -E "^ *4096" | cut -c1-110; save
    t done; return 0 2>/dev/null || exit 0 ;;
esac
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds wgmma,wgmma_tight,wgmma_fused --m 33,128,1000 --budget-s 85 --out $RES/52_validate.json > $RES/52_validate.log 2>&1
t "validate wgmma rc=$?"; tail -3 $RES/52_validate.log | cut -c1-200; save
timeout 170 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/52_linear.json > $RES/52_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/52_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/52_moe.json > $RES/52_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/52_moe.log | tail -8 | cut -c1-160; save
(cd scripts && timeout 190 python3 gpu_e2e_decode.py --cases dense:1:512,dense_bf16:1:512,dense:8:64,dense_bf16:8:64,moe:1:512,moe:8:64 --codebook mcg --repeats 3 --budget-s 170 --hard-limit-s 185 --out $RES/52_e2e.json > $RES/52_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "tok/s" $RES/52_e2e.log | cut -c1-200 | head -8; save
t done
