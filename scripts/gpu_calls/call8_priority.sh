# Call 8 (~6 min): session 21's essentials: the wgmma kernel on the hardware (auto takes it for
# 25 <= m <= 128 since session 21; depth 1 / 2), depth at m = 128, `bench linear` with auto at
# m = 16..128, and where the prefill plan's time goes (gpu_profile_linear.py). Call 6 has the
# wider sweeps.
CALL=call8
timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_tight,wgmma_fused --budget-s 90 --out $RES/8_validate_wgmma.json > $RES/8_validate_wgmma.log 2>&1
t "validate wgmma rc=$?"; grep SUMMARY $RES/8_validate_wgmma.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/8_validate_wgmma.log | head -4 | cut -c1-300; save
for sh in 8192x28672 4096x14336; do
    k=${sh%x*}; n=${sh#*x}
    for m in 128; do
        A=$(wgmma_tiling $m $k $n 2 0 1); B=$(wgmma_tiling $m $k $n 2 0 2); V="$A|$B|$A|$B"
        EXL3_JAX_PLAN=wgmma timeout 35 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4 --codebooks mcg,mul1 --m $m --out $RES/8_ab_${sh}_$m.json > $RES/8_ab_${sh}_$m.log 2>&1
        t "ab $sh m=$m ($V) rc=$?"; grep '^{' $RES/8_ab_${sh}_$m.log | cut -c1-200; save
    done
done
timeout 70 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 16,32,64,128 --out $RES/8_bench_linear.json > $RES/8_bench_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/8_bench_linear.log | grep -E "^ *(8192|4096)" | cut -c1-130 | head -20; save
(cd scripts && timeout 80 python3 gpu_profile_linear.py --shapes 8192x28672,4096x14336 --m 1024,4096 --plans prefill,wgmma --out $RES/8_profile_linear.json > $RES/8_profile_linear.log 2>&1)
t "profile linear rc=$?"; grep '^{' $RES/8_profile_linear.log | cut -c1-400; save
t done
