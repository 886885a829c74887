# Call 59 (~3 min, an H100 / H200; session 32): mixed-bitrate (tiered) MoE layers on the wgmma
# plan (one grouped wgmma launch per tier slab inside the layer's one custom call; auto keeps
# tiered layers on the mma.sync prefill plan until this call: moe_plans.WGMMA_TIERS_AUTO).
# (1) compute-sanitizer memcheck with the usual flags (three tiers with wgmma forced at 40
# tokens). (2) gpu_validate_moe.py's tiers section (K3 / K4 mcg, and mcg K3 + mul1 K3.5 + 3inst
# K2, one expert in no tier, 1 / 8 / 100 tokens auto, 100 with wgmma forced: 64-row blocks).
# (3) `bench moe --K 3+4` (Qwen3-30B-A3B, experts dealt round-robin to a K3 and a K4 slab) at
# m 1024 / 4096, wgmma forced against the mma.sync prefill plan forced. If both hold, turn
# WGMMA_TIERS_AUTO on.
# Prediction: (3) the tiered layer within 10% of the one-slab K4 layer on each plan (call 57:
# wgmma 806 / 1995 us, mma.sync 1629 / 4408), so wgmma 1.9-2.3x faster than mma.sync.
CALL=call59
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $RES/59_memcheck.log 2>&1
t "memcheck rc=$?"; grep -E "memcheck run moe tiers|ERROR SUMMARY" $RES/59_memcheck.log | head -4; save
timeout 60 python3 scripts/gpu_validate_moe.py --no-bench --sections tiers --out $RES/59_validate.json > $RES/59_validate.log 2>&1
t "validate tiers rc=$?"; grep -E '"T": 100|SUMMARY' $RES/59_validate.log | cut -c1-200; save
EXL3_JAX_MOE_PLAN=wgmma timeout 50 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --K 3+4 --m 1024,4096 --no-baseline --out $RES/59_moe_tiers_wgmma.json > $RES/59_moe_tiers_wgmma.log 2>&1
t "bench tiers wgmma rc=$?"; grep " us " $RES/59_moe_tiers_wgmma.log | cut -c1-100; save
EXL3_JAX_MOE_PLAN=prefill timeout 50 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --K 3+4 --m 1024,4096 --no-baseline --out $RES/59_moe_tiers_mma.json > $RES/59_moe_tiers_mma.log 2>&1
t "bench tiers mma rc=$?"; grep " us " $RES/59_moe_tiers_mma.log | cut -c1-100; save
t done
