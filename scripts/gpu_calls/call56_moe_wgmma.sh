# Call 56 (~8 min, an H100 / H200; queued in session 31, which built the plan and had no device
# time left): the MoE "wgmma" plan (the grouped form of the dense wgmma kernel for prefill
# blocks of 32 / 64 / 128 rows on Hopper; selected by EXL3_JAX_MOE_PLAN=wgmma until
# moe_plans.WGMMA_AUTO is turned on). (1) gpu_validate_moe.py --quick: every section, the wgmma
# plan forced at 40 tokens (accuracy, edge, overflow), poisoned outputs. (2) compute-sanitizer
# memcheck of a decode, a prefill and a wgmma layer. (3) `bench moe` Qwen3-30B-A3B m 128-4096
# with EXL3_JAX_MOE_PLAN=wgmma and =prefill (the mma.sync kernel, call 54: 319 / 891 / 1646 /
# 4525 us at 128 / 512 / 1024 / 4096). (4) e2e Qwen3-30B-A3B b1 with a 512-token prompt, wgmma
# forced (its prefill tok/s; the decode steps then run wgmma too: ignore them; call 47's
# default: 7846 tok/s).
# Predictions (Qwen3, H100): the layer at m = 512 891 -> 450-600 us, 1024 1646 -> 700-900,
# 4096 4525 -> 1.2-1.8 ms (each CTA decodes its expert's 128 columns once per block of 32-128
# rows instead of once per warp-pair of n-tiles with activations re-read from global; the
# decode, not the tensor core, bounds it: ~1.5 G weight decodes at 4096 with 128-row blocks at
# the dense wgmma's ~1.15 T/s at 128-token tiles); m = 128 (forced: 32-row blocks for 8 routes per expert) slower than the
# mma.sync kernel; e2e prefill 7.8k -> 11-14k tok/s. If (3) holds, turn WGMMA_AUTO on.
CALL=call56
timeout 240 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 200 --out $RES/56_validate.json > $RES/56_validate.log 2>&1
t "validate moe rc=$?"; grep -E '"ok"|SUMMARY|wgmma|geometry' $RES/56_validate.log | cut -c1-220 | tail -12; save
timeout 120 compute-sanitizer --tool memcheck python3 scripts/gpu_validate_moe.py --memcheck > $RES/56_memcheck.log 2>&1
t "memcheck rc=$?"; grep -E "memcheck run|ERROR SUMMARY" $RES/56_memcheck.log | head -8; save
EXL3_JAX_MOE_PLAN=wgmma timeout 110 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 128,512,1024,2048,4096 --no-baseline --out $RES/56_moe_wgmma.json > $RES/56_moe_wgmma.log 2>&1
t "bench moe wgmma rc=$?"; grep -v -i warn $RES/56_moe_wgmma.log | tail -5 | cut -c1-150; save
EXL3_JAX_MOE_PLAN=prefill timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 512,1024,4096 --no-baseline --out $RES/56_moe_mma.json > $RES/56_moe_mma.log 2>&1
t "bench moe mma rc=$?"; grep -v -i warn $RES/56_moe_mma.log | tail -3 | cut -c1-150; save
(cd scripts && EXL3_JAX_MOE_PLAN=wgmma timeout 100 python3 gpu_e2e_decode.py --cases moe:1:512 --codebook mcg --repeats 3 --budget-s 80 --hard-limit-s 95 --out $RES/56_e2e.json > $RES/56_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "tok/s" $RES/56_e2e.log | cut -c1-200 | head -3; save
t done
