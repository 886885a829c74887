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
issue_table 52
t done
