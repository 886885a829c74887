# Call 35 (~4 min, what the session's last device minutes allow): `bench moe` for Qwen3-30B-A3B
# at m 1..8 on whatever card comes (issue #6's m = 1 row: 25.1 us on the H100 in session 25),
# then the hardware check of the packed kernels' "pairs" default (call 32's first step:
# gpu_validate gemm decode rows at 4096x4096, m 9 / 16 / 24 / 32, poisoned outputs).
CALL=call35
bench_moe here 35_moe 100
timeout 90 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 9,16,24,32 --k 4096 --n 4096 --budget-s 70 --out $RES/35_validate.json > $RES/35_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/35_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/35_validate.log | head -4 | cut -c1-300; save
t done
