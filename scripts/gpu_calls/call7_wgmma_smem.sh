# Call 7 (~8 min): the wgmma kernel with A from shared memory (a_smem: each chunk decoded one
# chunk ahead into an A stage while the previous chunk's 4 wgmmas run; session 21) on the
# hardware, then against register A (the auto form) on the shapes at m = 32..1024, and
# its K-splits at m = 128. Validation first: one-hot decode and GEMM rows of wgmma_smem.
CALL=call7
timeout 100 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 33,128,1000 --kinds wgmma,wgmma_smem --budget-s 80 --out $RES/7_validate_smem.json > $RES/7_validate_smem.log 2>&1
t "validate wgmma_smem rc=$?"; grep SUMMARY $RES/7_validate_smem.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/7_validate_smem.log | head -4 | cut -c1-300; save
# A wgmma tiling of (m, k, n): weight ring 4, depth 1, A from registers (0) or shared memory
# (1), m_tile T (default: auto's), S K-splits (default: auto's rule, the fewest giving a CTA
# per SM).
tiling() { python3 -c "
from exl3_jax.ops.plans import DEFAULT_SMS, _token_tile_splits, select_plan
p = select_plan($1, $2, $3, force='wgmma'); t = ${5:-p.m_tile}
s = ${6:-_token_tile_splits($1, $2 // 16, $3 // 16, t, 4, DEFAULT_SMS)}
print(f'{t},{p.warps // 4},{s},{int(s == 1)},4,1,$4')"; }
for sh in 4096x14336 14336x4096 8192x28672; do
    k=${sh%x*}; n=${sh#*x}
    for m in 32 128 1024; do
        A=$(tiling $m $k $n 0); B=$(tiling $m $k $n 1); V="$A|$B|$A|$B"
        # m = 1024: also 256-token tiles (decode once per 256 tokens; 128 accumulators)
        [ $m = 1024 ] && V="$V|$(tiling $m $k $n 1 256)|$(tiling $m $k $n 0 256)"
        EXL3_JAX_PLAN=wgmma timeout 35 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4,3 --codebooks mcg,mul1 --m $m --out $RES/7_smem_${sh}_$m.json > $RES/7_smem_${sh}_$m.log 2>&1
        t "a_smem $sh m=$m ($V) rc=$?"; grep '^{' $RES/7_smem_${sh}_$m.log | cut -c1-190; save
    done
    V=$(for s in 1 2 4; do tiling 128 $k $n 1 128 $s; done | paste -sd'|')
    EXL3_JAX_PLAN=wgmma timeout 25 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values "$V" --shapes $sh --K 4 --codebooks mcg --m 128 --out $RES/7_smem_splits_$sh.json > $RES/7_smem_splits_$sh.log 2>&1
    t "a_smem splits $sh m=128 ($V) rc=$?"; grep '^{' $RES/7_smem_splits_$sh.log | cut -c1-190; save
done
t done
