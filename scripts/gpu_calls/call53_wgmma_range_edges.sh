# Call 53 (~4 min, any H100 / H200): the wgmma range's edges call 50 left unmeasured. A/B of
# EXL3_JAX_PLAN wgmma | prefill (twice each, one process per shape group): (1) 8192x8192 (67 M
# weights, Llama-70B's q / o projections, just above WGMMA_WIDE_MAX_WEIGHTS = 60 Mi, so wgmma
# stops at 128 rows) at m = 160 / 192 / 256; (2) the 59 M-weight shapes with K3 mcg and K4 mul1
# at m = 192 / 256 (call 50 timed K4 mcg only); (3) 8192x28672 K4 mcg at m = 96 / 128, the
# narrow range's top for the largest weights (session 20 tied it on an H200).
# Predictions: 8192x8192 wgmma wins by 5-15% at 160-256 (its weights are nearer the mid-size
# shapes' than 8192x28672's, and its grid of 8192/128 n-tiles fills the SMs), which would
# move WGMMA_WIDE_MAX_WEIGHTS to ~128 Mi; K3 / mul1 win like K4 mcg (-10 to -25%);
# 8192x28672 at 96 / 128 within +-8%.
CALL=call53
ab_plan() {   # ab_plan TAG SHAPES K CODEBOOKS MS
  timeout 150 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'wgmma|prefill|wgmma|prefill' --shapes $2 --K $3 --codebooks $4 --m $5 --out $RES/53_$1.json > $RES/53_$1.log 2>&1
  t "ab plan $1 rc=$?"; ab_rows $RES/53_$1.log EXL3_JAX_PLAN; save
}
ab_plan sq8k 8192x8192 4 mcg 160,192,256
ab_plan mid_k3 4096x14336,14336x4096 3 mcg 192,256
ab_plan mid_mul1 4096x14336,14336x4096 4 mul1 192,256
ab_plan big_top 8192x28672 4 mcg 96,128
t done
