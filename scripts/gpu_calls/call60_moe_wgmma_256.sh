# Call 60 (~4 min, an H100 / H200; session 32): 256-row wgmma blocks for the MoE past 128 routes
# per expert (moe_wgmma_256.patch: WGMMA_BLOCK_M_CHOICES gains 256; the dense kernel's 256-token
# tile passed call 51's hardware check). Unlike the dense GEMM (call 51: halving the tile count
# halved a grid that one CTA per SM already filled), Qwen3 at m = 4096 keeps 1536 FC1 CTAs with
# 256-row blocks, and each expert's weights are decoded once instead of twice.
# (1) In the patched tree: gpu_validate_moe.py's geometry section (GLM-4.5-Air's H / I with 16
# experts at 512 tokens: 256 routes per expert, 256-row blocks; Qwen3 m 1..1024 unchanged).
# (2) `bench moe` Qwen3-30B-A3B and GLM-4.5-Air at m 2048 / 4096 (128 / 256 routes per expert),
# patched, then this tree (128-row blocks) in the same call.
# Prediction: m = 4096 Qwen3 1995 -> 1500-1750 us, GLM-4.5-Air 5080 -> 3800-4500 (the decode
# share halves; the glue and the 256-row staging stay); m = 2048 unchanged (128 routes: 128 rows).
# Ran in session 33 (H100): 256-row blocks slower (Qwen3 m = 4096 2063 -> 2336 us, GLM-4.5-Air
# 5114 -> 5561); rejected, and its patch (moe_wgmma_256.patch) removed, so this script is a
# record that no longer runs.
CALL=call60
tree_patched b256 scripts/gpu_calls/moe_wgmma_256.patch
timeout 120 python3 $ROOT/scripts/gpu_validate_moe.py --no-bench --sections geometry --budget-s 100 --out $RES/60_geometry.json > $RES/60_geometry.log 2>&1
t "geometry (256 rows) rc=$?"; grep -E '"T": (512|1024)|SUMMARY' $RES/60_geometry.log | cut -c1-220; save
timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air --m 2048,4096 --no-baseline --out $RES/60_moe_256.json > $RES/60_moe_256.log 2>&1
t "bench moe 256 rc=$?"; grep " us " $RES/60_moe_256.log | cut -c1-100; save
tree here
timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air --m 2048,4096 --no-baseline --out $RES/60_moe_128.json > $RES/60_moe_128.log 2>&1
t "bench moe 128 rc=$?"; grep " us " $RES/60_moe_128.log | cut -c1-100; save
t done
