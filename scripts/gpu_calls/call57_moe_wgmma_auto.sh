# Call 57 (~8 min, an H100 / H200; session 32): the MoE wgmma plan taken by auto
# (moe_plans.WGMMA_AUTO on after call 56: Qwen3-30B-A3B m = 512 884 -> 577 us, 1024
# 1629 -> 810, 4096 4408 -> 1965 on an H100). (1) compute-sanitizer memcheck of the decode,
# prefill and wgmma layers with the flags call 56 lacked (--report-api-errors no, and the
# platform allocator, so that out-of-bounds accesses inside XLA's pool show). (2) The geometry
# section (Qwen3 at m 1 / 8 / 128 / 1024; GLM-4.5-Air's and GLM-5.2 TP4's H and I at 16 experts,
# 128- and 64-row wgmma blocks) and the quick accuracy sweep, auto plans. (3) `bench moe` of
# the three geometries with auto plans, m 128-4096, against the mma.sync prefill plan forced,
# and the wgmma plan forced below auto's switch (Qwen3 m 192 / 256: 12 / 16 routes per expert,
# where auto keeps 16-row mma.sync blocks). (4) e2e Qwen3-30B-A3B b1 / b8, 512-token prompts,
# auto plans (call 56 with wgmma forced: 10.8k prefill tok/s at b1; decode must stay ~223).
# Predictions: GLM-4.5-Air at m >= 1024 and GLM-5.2 TP4 at m >= 1024 (32+ routes per expert)
# 1.8-2.3x faster on wgmma than on the mma.sync kernel (Qwen3's 1.5-2.2x); Qwen3 m = 256 forced
# wgmma within +-15% of the mma.sync 16-row blocks (m = 128, 8 routes: wgmma 24% slower).
CALL=call57
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $RES/57_memcheck.log 2>&1
t "memcheck rc=$?"; grep -E "memcheck run|ERROR SUMMARY" $RES/57_memcheck.log | head -8; save
timeout 170 python3 scripts/gpu_validate_moe.py --quick --no-bench --sections geometry,accuracy --budget-s 150 --out $RES/57_validate.json > $RES/57_validate.log 2>&1
t "validate rc=$?"; grep -E '"T": (512|128|1024)|SUMMARY' $RES/57_validate.log | cut -c1-250 | tail -8; save
timeout 120 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 128,256,512,1024,4096 --no-baseline --out $RES/57_moe_auto.json > $RES/57_moe_auto.log 2>&1
t "bench moe auto rc=$?"; grep -v -i warn $RES/57_moe_auto.log | grep " us " | cut -c1-110; save
EXL3_JAX_MOE_PLAN=prefill timeout 100 python3 -m exl3_jax.cli bench moe --geometries glm-4.5-air,glm-5.2-tp4 --m 512,1024,4096 --no-baseline --out $RES/57_moe_mma.json > $RES/57_moe_mma.log 2>&1
t "bench moe mma rc=$?"; grep -v -i warn $RES/57_moe_mma.log | grep " us " | cut -c1-110; save
EXL3_JAX_MOE_PLAN=wgmma timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 192,256 --no-baseline --out $RES/57_moe_wgmma_low.json > $RES/57_moe_wgmma_low.log 2>&1
t "bench moe wgmma low rc=$?"; grep -v -i warn $RES/57_moe_wgmma_low.log | grep " us " | cut -c1-110; save
EXL3_JAX_MOE_PLAN=prefill timeout 50 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 192 --no-baseline --out $RES/57_moe_mma_low.json > $RES/57_moe_mma_low.log 2>&1
t "bench moe mma low rc=$?"; grep -v -i warn $RES/57_moe_mma_low.log | grep " us " | cut -c1-110; save
(cd scripts && timeout 110 python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:512 --codebook mcg --repeats 3 --budget-s 90 --hard-limit-s 105 --out $RES/57_e2e.json > $RES/57_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "^moe" $RES/57_e2e.log | cut -c1-200 | head -3; save
t done
