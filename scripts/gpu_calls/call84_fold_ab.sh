# Ran in session 39 with `here` = main + scripts/gpu_calls/fold_out.patch (the output-side fold,
# rejected by call 84: main keeps the both-sides fold everywhere). To rerun, replace `tree here`
# by `tree_patched foldout scripts/gpu_calls/fold_out.patch` (and `tree $T` likewise for here).
# Call 84 (~5 min, an H100 / H200): the fair A/B of the prefill plan's two folded forms. Call 83
# (ncu, per kernel) found the new output-side dequantize at the W_hat kernel's 203 us and the
# op's x pass at ~17 us (m = 256), yet call 82's loop put the op 140 us above main at m = 256:
# main's transforms form dequantizes W_hat from the weight alone, so XLA hoists that launch out
# of bench's timing loop (loop-invariant), and its rows never paid the ~203 us. The folding
# forms depend on x (the batch scale) and stay in the loop. So: main with every prefill folded
# (tree s38, EXL3_JAX_PREFILL_FOLD=1: both sides folded, x converted to fp16 with its bf16 bits)
# against this tree (the output side folded, x rotated), alternating, at m = 256 / 1024 / 4096
# on both shapes, K 3 / 4 mcg (4096x14336 m = 256 is the wgmma plan: the control rows).
# Predictions (H100): within +-3% at m = 256 and 1024 (dequantize 217 vs 203 us, x pass ~6 vs
# ~17 us at 256, the rotated x's full mantissa +1-3% on the dot through the power cap); the
# both-sides form ahead by 1-3% at m = 4096 (call 82).
CALL=call84
I=0
for T in s38 here s38 here; do
  I=$((I + 1)); tree $T
  EXL3_JAX_PREFILL_FOLD=1 timeout 150 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg --m 256,1024,4096 --rounds 3 --out $RES/84_ab_${I}_$T.json > $RES/84_ab_${I}_$T.log 2>&1
  t "bench linear $I $T rc=$?"; grep -v -i warn $RES/84_ab_${I}_$T.log | grep -E "K=" | cut -c1-80; save
done
tree here
t done
