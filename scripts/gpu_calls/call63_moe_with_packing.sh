# Call 63 (~8 min, an H100 / H200; session 33): the MoE layer timed with its route packing
# (bench moe's routes_of_call; up to session 32 XLA hoisted the packing out of the timing loop)
# and session 33's counting-sort packing (call 62: 14-23 us at 64-4096 tokens, from 53-77).
# (1) `bench moe` at the issue's m (1..8, 16, 32, 128, 1024, 4096) on the three geometries,
# with the ragged baseline up to 128 (its argsort now inside the loop too; at 4096 it does not
# fit). (2) A K3 + K4 tiered layer, auto (now wgmma past 8 routes per expert). (3) e2e
# Qwen3-30B-A3B decode b1 / b8 and prefill of 512-token prompts with the new packing.
# Predictions: (1) m = 1..4 (per-route packing: no packing ops) unchanged within +-5% of call
# 47 (26.3 us at m = 1); m = 8..128 (compare-method packing before, 14-16 us, hoisted) +10-16
# us; m = 1024 / 4096 +15-20 us over call 57 (806 / 1995 us). (2) within 5% of call 59 (899 /
# 2146 us) plus the packing. (3) prefill 512 tokens 10.8k -> 11.3-11.8k tok/s (48 layers x
# ~30 us of packing saved of ~47 ms); decode unchanged (per-route packing).
CALL=call63
# Session 34: call 64 made the packing kernel the default up to 4096 routes (moe_plans.
# PACK_KERNEL_MAX_ROUTES), so this call times main's default; its step (3) is dropped (call 64's
# e2e ran with the kernel). Prediction for m = 8..128 now: +6-10 us over session 32's rows.
timeout 200 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8,16,32,128 --out $RES/63_moe.json > $RES/63_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/63_moe.log | grep " us " | cut -c1-150; save
timeout 120 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1024,4096 --no-baseline --out $RES/63_moe_prefill.json > $RES/63_moe_prefill.log 2>&1
t "bench moe prefill rc=$?"; grep -v -i warn $RES/63_moe_prefill.log | grep " us " | cut -c1-150; save
timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --K 3+4 --m 1024,4096 --no-baseline --out $RES/63_moe_tiers.json > $RES/63_moe_tiers.log 2>&1
t "bench moe tiers rc=$?"; grep " us " $RES/63_moe_tiers.log | cut -c1-110; save
t done
