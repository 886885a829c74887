# Call 7 (~9 min): the wgmma kernel with A from shared memory (a_smem: each chunk decoded one
# chunk ahead into an A stage while the previous chunk's 4 wgmmas run; session 21) on the
# hardware, then against register A (the auto form) on the shapes at m = 32..1024 with
# 2 and 4 warpgroups (128 / 256 columns per CTA) and 128- / 256-token tiles, and
# its K-splits at m = 128. Validation first: one-hot decode and GEMM rows of wgmma_smem. Last,
# where the prefill plan's time goes at m = 1024 and 4096 (kernel time per call by kernel).
CALL=call7
timeout 100 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_smem --budget-s 80 --out $RES/7_validate_smem.json > $RES/7_validate_smem.log 2>&1
t "validate wgmma_smem rc=$?"; grep SUMMARY $RES/7_validate_smem.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/7_validate_smem.log | head -4 | cut -c1-300; save
for sh in 4096x14336 14336x4096 8192x28672; do
    k=${sh%x*}; n=${sh#*x}
    for m in 32 128 1024; do
        # register A (the auto form) | A from shared memory | the same, 4 warpgroups
        A=$(wgmma_tiling $m $k $n 0); B=$(wgmma_tiling $m $k $n 1); C=$(wgmma_tiling $m $k $n 1 4); V="$A|$B|$C|$A|$B|$C"
        # m = 1024: also 256-token tiles (decode once per 256 tokens; 128 accumulators)
        [ $m = 1024 ] && V="$V|$(wgmma_tiling $m $k $n 1 2 256)"
        EXL3_JAX_PLAN=wgmma timeout 30 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4 --codebooks mcg,mul1 --m $m --out $RES/7_smem_${sh}_$m.json > $RES/7_smem_${sh}_$m.log 2>&1
        t "a_smem $sh m=$m ($V) rc=$?"; grep '^{' $RES/7_smem_${sh}_$m.log | cut -c1-190; save
    done
    V=$(for s in 1 2 4; do wgmma_tiling 128 $k $n 1 2 128 1 $s; done | paste -sd'|')
    EXL3_JAX_PLAN=wgmma timeout 25 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4 --codebooks mcg --m 128 --out $RES/7_smem_splits_$sh.json > $RES/7_smem_splits_$sh.log 2>&1
    t "a_smem splits $sh m=128 ($V) rc=$?"; grep '^{' $RES/7_smem_splits_$sh.log | cut -c1-190; save
done
(cd scripts && timeout 90 python3 gpu_profile_linear.py --shapes 8192x28672,4096x14336 --m 1024,4096 --plans prefill,wgmma --out $RES/7_profile_linear.json > $RES/7_profile_linear.log 2>&1)
t "profile linear rc=$?"; grep '^{' $RES/7_profile_linear.log | cut -c1-400; save
t done
