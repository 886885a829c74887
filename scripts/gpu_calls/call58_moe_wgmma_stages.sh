# Call 58 (~4 min, an H100 / H200; session 32): where the MoE wgmma layer's time goes, and the
# lowered switch (moe_plans.WGMMA_MIN_BLOCK_M 32 -> 16: wgmma from 8+ routes per expert).
# (1) gpu_validate_moe.py's profile section at Qwen3-30B-A3B m 512 / 1024 / 4096 (auto: wgmma
# with 32- / 64- / 128-row blocks): route packing, FC1 and FC2 alone, the layer with and
# without PDL, unfused. (2) `bench moe` at the new switch's low side, auto (wgmma) against the
# mma.sync prefill plan forced: Qwen3 m 160 (10 routes per expert), GLM-4.5-Air m 256 and
# GLM-5.2 TP4 m 512 (16 routes; call 57's mma.sync 1426 / 1877 us).
# Predictions: (1) at m = 4096 FC1 + FC2 ~60-70% of the layer's 1995 us (the dense wgmma
# kernel's ~1.7 T decodes/s on 805 M + 403 M decodes: ~700 us; the rest the glue: packing
# 85 us, rotate-in / activation / combine over 32 k routed rows); (2) wgmma 10-25% faster in
# all three rows.
CALL=call58
timeout 150 python3 scripts/gpu_validate_moe.py --sections profile --profile-m 512,1024,4096 --profile-s 120 --out $RES/58_profile.json > $RES/58_profile.log 2>&1
t "profile rc=$?"; grep -E '"m":' $RES/58_profile.log | cut -c1-330; save
timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 160,256,512 --no-baseline --out $RES/58_moe_auto.json > $RES/58_moe_auto.log 2>&1
t "bench moe auto rc=$?"; grep " us " $RES/58_moe_auto.log | cut -c1-110; save
EXL3_JAX_MOE_PLAN=prefill timeout 70 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 160 --no-baseline --out $RES/58_moe_mma.json > $RES/58_moe_mma.log 2>&1
t "bench moe mma rc=$?"; grep " us " $RES/58_moe_mma.log | cut -c1-110; save
t done
