# Ran in session 39 with `here` = main + scripts/gpu_calls/fold_out.patch (the output-side fold,
# rejected by call 84: main keeps the both-sides fold everywhere). To rerun, replace `tree here`
# by `tree_patched foldout scripts/gpu_calls/fold_out.patch` (and `tree $T` likewise for here).
# Call 81's kernel still loaded svh next to each MMA; the patch has call 82's staged form.
# Call 81 (~8 min, an H100 / H200): the prefill plan that folds only the output side (session 39:
# x rotated by the input transform with one batch scale, the dequantize kernel writing
# W_hat had128 diag(svh) * s through movmatrix, no CTA barrier; replaces both the folding
# dequantize and the transform kernels around a W_hat dot) on the hardware, then timed against
# main before it (tree s38 = e16e6fc), alternating processes.
# 1. gpu_validate decode_exact (the W_hat form now moves each tile through movmatrix: bit for bit
#    on the hardware, or the ISA's layout differs from the interpreter's) and the prefill plan's
#    GEMM rows (NaN-poisoned, m 33 / 128 / 1000 / 4096, every codebook and rate of --quick).
#    Predictions: W_hat bit-exact 8/8, rotated rel. L2 ~4.4e-4 (emulated), every row ok.
# 2. compute-sanitizer memcheck of the prefill plan: 0 errors.
# 3. bench linear, s38 then here (call 82 runs here then s38): 8192x28672 and 4096x14336, K 3 / 4
#    mcg, m 256 / 1024 / 4096 (4096x14336 m = 256 is the wgmma plan: the control row, whose
#    input transform's load batching is the only change).
#    Predictions (H100): 8192x28672 m = 1024 (transforms before) -7 to -12% (no output
#    transform; the W_hat dequantize's copy-rate time), m = 256 -3 to -8%, m = 4096 (folded
#    before) 0 to -3%; 4096x14336 m = 1024 / 4096 (folded before) -5 to -12% / -2 to -4%;
#    the control row within +-3%.
CALL=call81
timeout 130 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds prefill --m 33,128,1000,4096 --budget-s 110 --out $RES/81_validate.json > $RES/81_validate.log 2>&1
t "validate rc=$?"; grep -E "SUMMARY|dequant_bit_exact" $RES/81_validate.log | cut -c1-300 | head -12; save
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck prefill > $RES/81_memcheck.log 2>&1
t "memcheck prefill rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/81_memcheck.log | tr '\n' ' ' | cut -c1-400)"; save
for T in s38 here; do
  tree $T
  timeout 150 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg --m 256,1024,4096 --rounds 3 --out $RES/81_ab_$T.json > $RES/81_ab_$T.log 2>&1
  t "bench linear $T rc=$?"; grep -v -i warn $RES/81_ab_$T.log | grep -E "K=" | cut -c1-100; save
done
tree here
t done
