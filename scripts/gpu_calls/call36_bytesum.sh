# Call 36 (~8 min): mul1 through the byte-sum MMA (MmaConfig.mul1_bytesum, EXL3_JAX_MUL1_BYTESUM)
# and K4's two-pipe extraction (LaneGeometry.nibble_plan), session 28.
# SASS (CPU, sm_90a, 8192x28672 K4 m = 1 ring 3x8, loop per chunk of 128 weights per lane):
#   mul1 split pairs 581 (IMAD 134 + IDP 128 = FMA ~524 cycles, ALU ~420) -> byte-sum 524
#   (IMAD 196, PRMT 128, IMMA 32, HMMA 20: FMA ~392, ALU ~370; 21 padding UIADD3);
#   mcg 563 (ALU ~514, FMA ~418) -> 544 (IMAD 225, LOP3 131, PRMT 64, SHF 16: ~450 / ~450).
# Prediction: mul1 m = 1 -8 to -15% (issue slots -10%, both pipes under the issue bound), m = 16
# (packed pairs now: 2 IMAD + 2 IDP + PRMT + HFMA2 per 2 weights) -20 to -30%; mcg K4 -3 to -6%
# (-3.4% slots, the ALU pipe no longer at 94% of them); K3 mcg unchanged (control).
CALL=call36
timeout 120 env EXL3_JAX_MUL1_BYTESUM=1 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds decode --m 1,2,3,8,16,31,32 --budget-s 90 --out $RES/36_validate.json > $RES/36_validate.log 2>&1
t "validate rc=$?"; grep "SUMMARY\|decode_exact\] mul1\|decode_exact\] mcg   K=4" $RES/36_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/36_validate.log | head -4 | cut -c1-300; save
EXL3_JAX_PLAN=decode timeout 250 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_MUL1_BYTESUM --values '0|1|0' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mul1 --m 1,16,4 --out $RES/36_bytesum.json > $RES/36_bytesum.log 2>&1
t "ab bytesum rc=$?"; ab_rows $RES/36_bytesum.log EXL3_JAX_MUL1_BYTESUM; save
for tr in s27 here; do
  tree $tr
  EXL3_JAX_PLAN=decode timeout 60 python3 $ROOT/scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_ONE_TOKEN --values '1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 1,16 --out $RES/36_mcg_$tr.json > $RES/36_mcg_$tr.log 2>&1
  t "mcg K4 tree $tr rc=$?"; ab_rows $RES/36_mcg_$tr.log EXL3_JAX_ONE_TOKEN
  cat $RES/36_mcg_$tr.log >> $RES/36_mcg.log; rm $RES/36_mcg_$tr.log; save
done
t done
