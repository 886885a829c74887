# Call 51 (~6 min, any H100 / H200; queued in session 30): 256-token tiles for the wgmma plan
# past 128 rows. Auto now takes wgmma up to 256 rows for weights up to 60 Mi (call 50), with
# 128-token tiles, so m = 129..256 decodes every weight twice; a 256-token tile decodes it once
# (128 fp32 accumulators per lane; compiled and SASS-checked in CI, bit-equal to 128-token
# tiles at m = 1024 on the H100 in calls 40 / 43, where it ran 10% faster). Per shape, the
# splits are what _token_tile_splits gives each tile (one CTA per SM). (1) A/B of
# EXL3_JAX_WGMMA 128-tiles | 256-tiles at m = 192 / 256 and at 384 / 512; (2) the 256-tile
# wgmma against the prefill plan at the same m (EXL3_JAX_PLAN wgmma | prefill).
# Prediction: 8192x28672 at m = 192 / 256 385 -> 260-300 us (beating prefill's ~315); the
# mid-size shapes -5 to -20% at 192 / 256 (the decode halves, the grid halves and K splits more),
# -15 to -25% at 384 / 512 (2 tiles instead of 3-4), so the wgmma range could reach 512 rows.
# Decides: wgmma_plan's m_tile above 128 rows, WGMMA_WIDE_MAX_M and whether 8192x28672-size
# weights join the wide range.
CALL=call51
EXL3_JAX_WGMMA=256,2,1 timeout 100 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds wgmma --m 200,256 --budget-s 80 --out $RES/51_validate_256.json > $RES/51_validate_256.log 2>&1
t "validate 256-token tiles rc=$?"; tail -2 $RES/51_validate_256.log | cut -c1-200; save
ab_tiles() {   # ab_tiles TAG SHAPE MS TILING128 TILING256
  timeout 150 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA --values "$4|$5|$4|$5" --env2 EXL3_JAX_PLAN=wgmma --shapes $2 --K 4 --codebooks mcg --m $3 --out $RES/51_$1.json > $RES/51_$1.log 2>&1
  t "ab tiles $1 rc=$?"; ab_rows $RES/51_$1.log EXL3_JAX_WGMMA; save
  timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'wgmma|prefill|wgmma|prefill' --env2 EXL3_JAX_WGMMA=$5 --shapes $2 --K 4 --codebooks mcg --m $3 --out $RES/51_$1_prefill.json > $RES/51_$1_prefill.log 2>&1
  t "ab 256 vs prefill $1 rc=$?"; ab_rows $RES/51_$1_prefill.log EXL3_JAX_PLAN; save
}
ab_tiles big_lo 8192x28672 192,256 128,2,1 256,2,1
ab_tiles big_hi 8192x28672 384,512 128,2,1 256,2,1
ab_tiles up_lo 4096x14336 192,256 128,2,1 256,2,2
ab_tiles up_hi 4096x14336 384,512 128,2,1 256,2,1
ab_tiles down_lo 14336x4096 192,256 128,2,4 256,2,7
ab_tiles down_hi 14336x4096 384,512 128,2,2 256,2,4
ab_tiles sq_lo 4096x4096 192,256 128,2,4 256,2,8
t done
