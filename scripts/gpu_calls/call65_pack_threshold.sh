# Call 65 (~8 min, an H100 / H200; queued in session 34): what call 64 could not finish.
# (1) The packing kernel against XLA's counting sort past 4096 routes (m 1024 / 2048 / 4096 at
# top-8: tables, packing times, the Qwen3 layer at 1024), which decides
# moe_plans.PACK_KERNEL_MAX_ROUTES. (2) e2e Qwen3-30B-A3B b8 decode with each packing in one
# call (EXL3_JAX_MOE_PACK forces either). (3) gpu_validate_moe's accuracy section under the
# default (the kernel up to 4096 routes).
# Predictions: (1) the kernel ~28 / ~50 / ~95 us at 8192 / 16384 / 32768 routes (call 64's ~2.7
# us per 1000 routes) against XLA's 15-20: the threshold stays at 4096 (if the kernel still wins
# at 8192, raise it to the last size it wins); (2) b8 with the kernel +3-6% over XLA (48 layers
# x ~8 us of a ~7.5 ms step); (3) every row within tolerance.
CALL=call65
timeout 250 python3 scripts/gpu_calls/call64_pack_kernel.py --m 1024,2048,4096 --layer-m 1024 > $RES/65_pack.log 2>&1
t "pack kernel rc=$?"; grep '^{' $RES/65_pack.log | cut -c1-260; save
for P in kernel xla; do
  (cd scripts && EXL3_JAX_MOE_PACK=$P timeout 90 python3 gpu_e2e_decode.py --cases moe:8:512 --codebook mcg --repeats 3 --budget-s 75 --hard-limit-s 85 --out $RES/65_e2e_$P.json > $RES/65_e2e_$P.log 2>&1)
  t "e2e $P rc=$?"; grep -E "^moe" $RES/65_e2e_$P.log | cut -c1-200 | head -3; save
done
timeout 200 python3 scripts/gpu_validate_moe.py --quick --no-bench --sections accuracy --budget-s 180 --out $RES/65_validate.json > $RES/65_validate.log 2>&1
t "validate rc=$?"; grep -E 'SUMMARY' $RES/65_validate.log | cut -c1-250; save
t done
