# Call 6 (~9.5 min): the wgmma kernel in its one remaining form (activations and weights by
# cp.async, the weight ring) on the hardware, with 1 or 2 wgmmas in flight; where it beats the
# decode plan (m = 16..32) and the prefill plan (m = 64..256) on the shapes; its depth
# and K-splits (CTAs per SM) at m = 32 and 128 (auto takes wgmma for 25 <= m <= 128 on Hopper
# since session 21; m = 16 was decode 31.5 vs wgmma 36.0 us in session 20).
CALL=call6
timeout 90 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_tight,wgmma_fused --budget-s 70 --out $RES/6_validate_wgmma.json > $RES/6_validate_wgmma.log 2>&1
t "validate wgmma rc=$?"; grep SUMMARY $RES/6_validate_wgmma.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/6_validate_wgmma.log | head -4 | cut -c1-300; save
timeout 80 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'decode|wgmma' --shapes 4096x14336,14336x4096,8192x28672 --K 4,3 --codebooks mcg,mul1 --m 20,24,32 --out $RES/6_ab_decode_wgmma.json > $RES/6_ab_decode_wgmma.log 2>&1
t "ab decode/wgmma rc=$?"; grep '^{' $RES/6_ab_decode_wgmma.log | cut -c1-190; save
timeout 90 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'prefill|wgmma' --shapes 4096x14336,14336x4096,8192x28672 --K 4,3 --codebooks mcg,mul1 --m 64,128,256 --out $RES/6_ab_prefill_wgmma.json > $RES/6_ab_prefill_wgmma.log 2>&1
t "ab prefill/wgmma rc=$?"; grep '^{' $RES/6_ab_prefill_wgmma.log | cut -c1-190; save
for sh in 4096x14336 14336x4096 8192x28672; do
    k=${sh%x*}; n=${sh#*x}
    for m in 32 128; do
        A=$(wgmma_tiling $m $k $n 2 0 1); B=$(wgmma_tiling $m $k $n 2 0 2)
        EXL3_JAX_PLAN=wgmma timeout 30 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values "$A|$B|$A|$B" --shapes $sh --K 4,3 --codebooks mcg,mul1 --m $m --out $RES/6_depth_${sh}_$m.json > $RES/6_depth_${sh}_$m.log 2>&1
        t "depth $sh m=$m ($A vs $B) rc=$?"; grep '^{' $RES/6_depth_${sh}_$m.log | cut -c1-190; save
    done
    V=$(for s in 1 2 4 8; do wgmma_tiling 128 $k $n 2 0 1 $s; done | paste -sd'|')
    EXL3_JAX_PLAN=wgmma timeout 30 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4 --codebooks mcg --m 128 --out $RES/6_splits_$sh.json > $RES/6_splits_$sh.log 2>&1
    t "splits $sh m=128 ($V) rc=$?"; grep '^{' $RES/6_splits_$sh.log | cut -c1-190; save
done
t done
