# Call 74 (~6 min, an H100 / H200): the 16-byte output transform (call 71's patch, now main's
# ffi/hadamard.py through cute_ops.ld_global_v4 / st_global_v4) on the hardware: the decode and
# prefill plans' GEMM rows (NaN-poisoned outputs, relative L2 <= 1e-3), linear groups with
# biases (three members, the per-member svh / bias loads), the row-scale boundary cases, the
# dispatch; compute-sanitizer memcheck of the decode plan and of a group; then `bench linear`
# at m = 1 / 4 / 16 (the decode plans, whose output transform this is).
# Predictions: every row ok, memcheck 0 errors (the 16-byte accesses are aligned: whole
# 128-column blocks, 4 columns per lane); m <= 16 rows within +-3% of session 34's H200 table
# (H200) — the transform is a few us of a 25-90 us linear there.
CALL=call74
timeout 150 python3 scripts/gpu_validate.py --quick --no-bench --group --sections gemm,group,row_scale,dispatch --kinds decode,prefill --m 1,3,8,16,32,33,1000 --budget-s 130 --out $RES/74_validate.json > $RES/74_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/74_validate.log | cut -c1-300; save
for MC in decode group; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck $MC > $RES/74_memcheck_$MC.log 2>&1
  t "memcheck $MC rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $RES/74_memcheck_$MC.log | tr '\n' ' ' | cut -c1-400)"; save
done
bench_linear here 74_linear 150
t done
