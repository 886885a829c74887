# Call 69 (~5 min, an H100 / H200; session 36): what is left of call 65 (queued in session 34).
# (1) e2e Qwen3-30B-A3B-geometry b8 decode with each route packing, one process each, in the
# order xla, kernel, xla, kernel (EXL3_JAX_MOE_PACK forces either; main's default is the kernel
# up to 4096 routes). (2) gpu_validate_moe's accuracy section under main's default packing (call
# 64 ran it with the kernel forced).
# Predictions: (1) b8 with the kernel +3-6% over XLA (48 layers x ~8 us of a ~7.5 ms step);
# (2) every row within the tolerance (relative error <= 2e-3, cosine >= 0.9999).
CALL=call69
I=0
for P in xla kernel xla kernel; do
  I=$((I + 1)); L=$RES/69_e2e_${I}_${P}
  (cd scripts && EXL3_JAX_MOE_PACK=$P timeout 80 python3 gpu_e2e_decode.py --cases moe:8:512 --codebook mcg --repeats 3 --budget-s 65 --hard-limit-s 75 --out $L.json > $L.log 2>&1)
  t "e2e $I $P rc=$?"; grep -E "^moe" $L.log | cut -c1-200 | head -3; save
done
timeout 200 python3 scripts/gpu_validate_moe.py --quick --no-bench --sections accuracy --budget-s 180 --out $RES/69_validate.json > $RES/69_validate.log 2>&1
t "validate rc=$?"; grep -E 'SUMMARY' $RES/69_validate.log | cut -c1-250; save
t done
