# Call 22b: the second half of call 22 (see call22a_table.sh).
CALL=call22b
bench_moe here 22_moe 60
(cd scripts && timeout 170 python3 gpu_e2e_decode.py --cases dense:1:512,dense:8:64,moe:1:512,moe:8:64 --codebook mcg --repeats 3 --budget-s 160 --hard-limit-s 165 --out $RES/22_e2e.json > $RES/22_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "^dense:|^moe:" $RES/22_e2e.log | cut -c1-120 | head -6; save
# The ring in the group kernel on the hardware (emulated only so far; the e2e calls ran it
# unchecked): gate/up-like (14336, 14336) and q/k/v-like (14336, 3584, 3584) groups at k 4096,
# m = 1 past 2^26 weights (ring), 3 / 16 / 32 (direct), poisoned and production paths.
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --group --sections group --k 4096 --n 14336 --budget-s 95 --out $RES/22_group.json > $RES/22_group.log 2>&1
t "validate group rc=$?"; grep SUMMARY $RES/22_group.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/22_group.log | head -4 | cut -c1-300; save
t done
