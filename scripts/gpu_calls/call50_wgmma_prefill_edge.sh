# Call 50 (~4 min, any H100 / H200): where the wgmma plan should hand over to the prefill plan.
# Auto takes wgmma up to WGMMA_MAX_M = 128 rows on Hopper (session 20, H200: tied or beat prefill
# at m = 64 / 128, lost 1.5x at m = 1024); m = 129..1023 was never timed, and the prefill plan
# now folds the rotations for weights up to ~50 M (session 30). A/B of EXL3_JAX_PLAN wgmma |
# prefill (twice each, one process) at m = 192 / 256 / 384 / 512, K4 mcg, four shapes.
# Prediction: wgmma wins at m = 256 for the 17-59 M-weight shapes by 10-25% and ties at
# 8192x28672; prefill wins everywhere at m = 512.
CALL=call50
timeout 230 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_PLAN --values 'wgmma|prefill|wgmma|prefill' --shapes 4096x4096,4096x14336,14336x4096,8192x28672 --K 4 --codebooks mcg --m 192,256,384,512 --out $RES/50_edge.json > $RES/50_edge.log 2>&1
t "ab wgmma/prefill rc=$?"; ab_rows $RES/50_edge.log EXL3_JAX_PLAN; save
t done
