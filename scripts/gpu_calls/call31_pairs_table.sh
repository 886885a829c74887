# Call 31 (~6 min; calls 28-30 found no machine): call 30's pair-fragment A/B at m = 16 only and
# its validation, then call 29's table (the issue #5 table with session 26's defaults; on an
# H200 if one is given, the issues' targets being H200 numbers).
CALL=call31
EXL3_JAX_PLAN=decode timeout 150 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PAIR_FRAGMENTS --values '|1||1' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mul1,mcg --m 16 --out $RES/31_pairs.json > $RES/31_pairs.log 2>&1
t "ab pairs rc=$?"; ab_rows $RES/31_pairs.log EXL3_JAX_PAIR_FRAGMENTS; save
EXL3_JAX_PAIR_FRAGMENTS=1 timeout 80 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 9,16,24 --k 4096 --n 4096 --budget-s 60 --out $RES/31_validate_pairs.json > $RES/31_validate_pairs.log 2>&1
t "validate pairs rc=$?"; grep SUMMARY $RES/31_validate_pairs.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/31_validate_pairs.log | head -4 | cut -c1-300; save
timeout 220 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/31_linear.json > $RES/31_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/31_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
t done
