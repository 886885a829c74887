# (Record of a session-29 call: it ran on a working tree with temporary switches of the wgmma
# kernel that lost their A/Bs and were removed; bench/results/gpu_session29_2026-12-06/README.md.)
# Call 40 (~8 min): where the wgmma kernel's time goes. Never profiled: at 8192x28672 K4 mcg it
# runs ~680 cycles per k16 step and SM at m = 128 (200 us on the H100) against 256 cycles of
# tensor work (4 warpgroups x one m64n128k16 of 64 cycles) and ~200 issue cycles of decode per
# scheduler, and ~2.4x the tensor floor at m = 1024 (1213 us). CPU SASS of the loop: per chunk
# of 4 k16 steps 4 x (decode, WARPGROUP.ARRIVE, HGMMA, WARPGROUP.DEPBAR.LE 1), then
# DEPBAR.LE SB0 1 (cp.async), MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (the proxy fence) and
# BAR.SYNC for the whole CTA. (1) ncu source counters, warp states, pipes at m = 128 (auto:
# wgmma 128,2,1 fused) and m = 1024 (forced wgmma, 128-token tiles). (2) The fence's cost
# (EXL3_JAX_WGMMA_FENCE=0, a timing aid) and depth 2 / 256-token tiles, twice each, with
# outputs compared to the first value's.
CALL=call40
for m in 128 1024; do
    EXL3_JAX_PLAN=wgmma ncu_kernel 40_m$m wgmma --k 8192 --n 28672 --K 4 --codebook mcg --m $m --calls 3
done
EXL3_JAX_PLAN=wgmma timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA_FENCE --values '1|0|1|0' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 128,1024 --out $RES/40_fence.json > $RES/40_fence.log 2>&1
t "ab fence rc=$?"; ab_rows $RES/40_fence.log EXL3_JAX_WGMMA_FENCE; save
timeout 150 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values '128,2,1,1,4,1|128,2,1,1,4,2|256,2,1,1,4,1|128,2,1,1,4,1|128,2,1,1,4,2|256,2,1,1,4,1' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672 --K 4 --codebooks mcg --m 1024 --out $RES/40_tiling.json > $RES/40_tiling.log 2>&1
t "ab tiling rc=$?"; ab_rows $RES/40_tiling.log EXL3_JAX_WGMMA; save
t done
