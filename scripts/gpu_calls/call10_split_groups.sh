# Call 10 (~5.5 min): 3inst / mcg split pairs over 2-3 token groups (MmaConfig.split_groups,
# EXL3_JAX_SPLIT_GROUPS) against packed pairs at m = 12, 16 (2 groups) and 24 (3 groups).
# CPU-compiled, K4 mcg 8192x28672 m = 16, per 4 tiles: ALU ops 92 -> 60, FMA-pipe 64 -> 48,
# HMMA 8 -> 16, registers 60 -> 72 (4 -> 3 CTAs of 256 threads per SM). Session 11 measured
# split at m = 16 +20% slower, before the leaner decodes of sessions 17-19.
CALL=call10
EXL3_JAX_SPLIT_GROUPS=3 EXL3_JAX_PLAN=decode timeout 80 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm,group --group --m 9,16,24,32 --budget-s 60 --out $RES/10_validate_split.json > $RES/10_validate_split.log 2>&1
t "validate split groups rc=$?"; grep SUMMARY $RES/10_validate_split.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/10_validate_split.log | head -4 | cut -c1-300; save
for m in 16 12 24; do ab_split_groups 10_ab_split_$m $m; done
t done
