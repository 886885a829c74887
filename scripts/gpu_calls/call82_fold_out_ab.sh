# Ran in session 39 with `here` = main + scripts/gpu_calls/fold_out.patch (the output-side fold,
# rejected by call 84: main keeps the both-sides fold everywhere). To rerun, replace `tree here`
# by `tree_patched foldout scripts/gpu_calls/fold_out.patch` (and `tree $T` likewise for here).
# Call 82 (~5 min, an H100 / H200): call 81 found the output-side fold slower than main (8192x28672
# m = 256 +40%, m = 1024 +11%; 4096x14336 +1 to +10%). The CPU SASS showed why: ptxas sank the
# 16 svh loads of each warp next to their MMAs, a memory round trip each (~5 us per CTA, ~135 us
# over the 27 waves of 8192x28672). Now the block's svh pairs and the scale are staged through
# shared memory behind the weight loads (one load per thread and one CTA barrier, as the folding
# kernel did); SASS: 800 instructions per thread (768 before, 992 for the folding kernel), 60
# registers.
# 1. gpu_validate decode_exact + the prefill GEMM rows again (the kernel changed): all ok.
# 2. memcheck: the decode plan first (the control: call 81's prefill run crashed
#    compute-sanitizer before its first launch), then the prefill plan with XLA's GEMM
#    autotuning off (the crash's suspect).
# 3. bench linear alternating here, s38, here, s38 (call 81's grid).
#    Predictions (H100, against s38 in this call): 8192x28672 m = 256 -3 to -8%, m = 1024 -7 to
#    -12%, m = 4096 0 to -3%; 4096x14336 m = 1024 -5 to -12%, m = 4096 -2 to -4%; the wgmma
#    control rows within +-3%.
CALL=call82
timeout 130 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds prefill --m 33,1000,4096 --budget-s 110 --out $RES/82_validate.json > $RES/82_validate.log 2>&1
t "validate rc=$?"; grep -E "SUMMARY" $RES/82_validate.log | cut -c1-300 | head -4; save
for MC in decode prefill; do
  XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck $MC > $RES/82_memcheck_$MC.log 2>&1
  t "memcheck $MC rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/82_memcheck_$MC.log | tr '\n' ' ' | cut -c1-400)"; tail -3 $RES/82_memcheck_$MC.log | cut -c1-200; save
done
I=0
for T in here s38 here s38; do
  I=$((I + 1)); tree $T
  timeout 150 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg --m 256,1024,4096 --rounds 3 --out $RES/82_ab_${I}_$T.json > $RES/82_ab_${I}_$T.log 2>&1
  t "bench linear $I $T rc=$?"; grep -v -i warn $RES/82_ab_${I}_$T.log | grep -E "K=" | cut -c1-80; save
done
tree here
t done
