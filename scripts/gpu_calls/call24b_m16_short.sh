# Call 24b (~2.5 min; call 24 was lost with its machine): the m = 16 plan's 8-step chunks
# against the old 2-step ones (EXL3_JAX_DECODE_RING=0,2,0) at the other issue shapes, and the
# decode rows of the hardware validation at 4096x4096 (m = 16: 8-step chunks), m 9 / 16 / 24.
CALL=call24b
EXL3_JAX_PLAN=decode timeout 100 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|0,2,0' --shapes 14336x4096,4096x4096,2048x768 --K 4,3 --codebooks mcg,mul1 --m 16 --out $RES/24_m16.json > $RES/24_m16.log 2>&1
t "ab m16 rc=$?"; ab_rows $RES/24_m16.log EXL3_JAX_DECODE_RING; save
timeout 80 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 9,16,24 --k 4096 --n 4096 --budget-s 60 --out $RES/24_validate.json > $RES/24_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/24_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/24_validate.log | head -4 | cut -c1-300; save
t done
