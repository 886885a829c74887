# Call 48 (~5 min, any H100 / H200): the prefill plan's rotation folding by K and m. Auto folds
# the rotations into the dequantized weight from PREFILL_FOLD_MIN_M = 2048 rows (session 24, K4
# only: -4 to -11% at m = 4096, +9% at m = 1024). Session 30's table had K3 at m = 4096 ~100 us
# slower than K4 over the same bf16 dot (0.87x against 0.90-0.94x). A/B of EXL3_JAX_PREFILL_FOLD
# 0 | 1 (twice each, one process) at m = 2048 / 4096, K3 and K4, both codebooks, 8192x28672; mcg
# at 4096x14336. Prediction: folding wins at m = 4096 for every K by 4-11% (its extra work on
# the weight does not depend on K; the transforms' grows with m), within +-3% at m = 2048; if K3
# folds worse than K4, the plan's threshold takes K.
CALL=call48
timeout 300 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PREFILL_FOLD --values '0|1|0|1' --env2 EXL3_JAX_PLAN=prefill --shapes 8192x28672 --K 3,4 --codebooks mcg,mul1 --m 2048,4096 --out $RES/48_fold.json > $RES/48_fold.log 2>&1
t "ab fold 8192 rc=$?"; ab_rows $RES/48_fold.log EXL3_JAX_PREFILL_FOLD; save
timeout 150 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PREFILL_FOLD --values '0|1|0|1' --env2 EXL3_JAX_PLAN=prefill --shapes 4096x14336 --K 3,4 --codebooks mcg --m 2048,4096 --out $RES/48_fold_4096.json > $RES/48_fold_4096.log 2>&1
t "ab fold 4096 rc=$?"; ab_rows $RES/48_fold_4096.log EXL3_JAX_PREFILL_FOLD; save
t done
# Run after it on the same machine as calls 48b and 48c (`source scripts/gpu_calls/pre.sh`
# first), the same A/B at smaller m on more shapes:
#   CALL=call48b; timeout 200 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PREFILL_FOLD --values '0|1|0|1' --env2 EXL3_JAX_PLAN=prefill --shapes 4096x14336,8192x28672,14336x4096 --K 4 --codebooks mcg,mul1 --m 512,1024 --out $RES/48b_fold.json
#   CALL=call48c; timeout 200 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PREFILL_FOLD --values '0|1|0|1' --env2 EXL3_JAX_PLAN=prefill --shapes 4096x4096,4096x14336,14336x4096,8192x28672,2048x768 --K 4 --codebooks mcg --m 256,512,1536 --out $RES/48c_fold.json
