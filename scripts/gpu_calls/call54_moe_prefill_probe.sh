# Call 54 (~7 min, any H100 / H200): where the MoE prefill stands and what a dequantize + grouped
# tensor-core GEMM plan could give (issue #6; the prefill plan has run the decode-style grouped
# kernel since session 2, 4189 us at Qwen3-30B-A3B m = 4096 on the H200 then, 13x its tensor
# floor, and was not timed again). (1) `bench moe` Qwen3-30B-A3B at m 128 / 512 / 1024 / 4096
# (no ragged baseline: it takes ~60 ms a call at 4096). (2) scripts/gpu_moe_prefill_probe.py:
# every expert dequantized (W_hat, one launch per stack, 604 M weights), Mosaic GPU's ragged
# dot on the packed rows at four tilings against lax.ragged_dot, a cuBLAS batched dot at the
# mean route count for scale.
# Predictions: the fused layer at m = 4096 3-4.5 ms (the grouped kernel's code changed little for
# prefill since session 2); the dequantize of all experts 350-500 us (1.2 GB of fp16 written
# at ~3 TB/s, the decode at ~3.5 T weights/s under it); the Mosaic ragged dot at m = 4096 within
# 1.5x of the batched dot: FC1 per plane (2 x 32768 x 2048 x 768, 103 GFLOP) 200-300 us,
# FC2 the same FLOPs; so dequantize + 3 GEMMs + glue ~1.3-1.6 ms at m = 4096, ~2.5-3x faster, and
# a break-even with the fused kernel near m = 512-1024.
CALL=call54
timeout 200 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 128,512,1024,4096 --no-baseline --out $RES/54_moe.json > $RES/54_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/54_moe.log | tail -5 | cut -c1-170; save
timeout 330 python3 scripts/gpu_moe_prefill_probe.py --m 512,1024,4096 --out $RES/54_probe.json > $RES/54_probe.log 2>&1
t "probe rc=$?"; grep -v -i warn $RES/54_probe.log | cut -c1-300 | tail -24; save
t done
