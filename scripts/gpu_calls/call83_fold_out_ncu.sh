# Ran in session 39 with `here` = main + scripts/gpu_calls/fold_out.patch (the output-side fold,
# rejected by call 84: main keeps the both-sides fold everywhere). To rerun, replace `tree here`
# by `tree_patched foldout scripts/gpu_calls/fold_out.patch` (and `tree $T` likewise for here).
# Call 83 (~4 min, an H100 / H200): why the output-side fold is slower (call 82: 8192x28672
# m = 256 +45%, m = 1024 +8%, m = 4096 +2-3% against main; 4096x14336 within +-4%): per-kernel
# durations of the prefill op under ncu (every launch's gpu__time_duration; the last op call's
# launches printed) in this tree and in s38, then the new dequantize kernel's own profile.
# Predictions: the new dequantize kernel takes ~300+ us at 8192x28672 (the W_hat kernel ~204,
# call 72); the x pass (reduction + input transform) under 30 us at m = 256.
CALL=call83   # ncu_op: pre.sh (this call's own copy printed nothing: the same header bug)
for T in here s38; do
  tree $T
  XLA_FLAGS=--xla_gpu_autotune_level=0 ncu_op 83_${T}_8192_256 8192 28672 256
  XLA_FLAGS=--xla_gpu_autotune_level=0 ncu_op 83_${T}_4096_1024 4096 14336 1024
done
tree here
EXL3_JAX_PLAN=prefill NCU_TOP=25 ncu_kernel 83_dequant dequant --k 8192 --n 28672 --K 4 --codebook mcg --m 256 --calls 3
t done
