# Call 6 (~7 min): the wgmma kernel in its one remaining form (activations and weights by
# cp.async, the weight ring) on the hardware, then where it beats the decode plan (m = 16..32)
# and the prefill plan (m = 64..256) on the issue's shapes, then `bench linear` with the wgmma
# plan forced at m = 32 and 128 (what the auto switch of bench/NOTES.md, session 20, item 3,
# would choose there).
CALL=call6
timeout 90 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_ring3,wgmma_fused --budget-s 70 --out $RES/6_validate_wgmma.json > $RES/6_validate_wgmma.log 2>&1
t "validate wgmma rc=$?"; grep SUMMARY $RES/6_validate_wgmma.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/6_validate_wgmma.log | head -4 | cut -c1-300; save
timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'decode|wgmma' --shapes 4096x14336,14336x4096,8192x28672 --K 4,3 --codebooks mcg,mul1 --m 16,20,24,32 --out $RES/6_ab_decode_wgmma.json > $RES/6_ab_decode_wgmma.log 2>&1
t "ab decode/wgmma rc=$?"; grep '^{' $RES/6_ab_decode_wgmma.log | cut -c1-190; save
timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'prefill|wgmma' --shapes 4096x14336,14336x4096,8192x28672 --K 4,3 --codebooks mcg,mul1 --m 64,128,256 --out $RES/6_ab_prefill_wgmma.json > $RES/6_ab_prefill_wgmma.log 2>&1
t "ab prefill/wgmma rc=$?"; grep '^{' $RES/6_ab_prefill_wgmma.log | cut -c1-190; save
EXL3_JAX_PLAN=wgmma timeout 80 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 32,128 --out $RES/6_bench_linear.json > $RES/6_bench_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/6_bench_linear.log | grep -E "^ *(8192|4096)" | cut -c1-120 | head -24; save
t done
