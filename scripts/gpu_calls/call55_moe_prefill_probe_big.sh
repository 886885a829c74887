# Call 55 (~5 min, any H100 / H200): call 54's probe at m = 2048 / 4096 (call 54 ran out of time
# inside m = 1024) with the dequantize timed inside the loop (call 54's 87.8 us was the launches
# hoisted out of the loop: the weights are loop-invariant; the probe now feeds the loop's value
# into the kernel's unread scale operand), and `bench moe` at m = 2048 for the fused layer.
# Predictions: dequantize of all experts 350-500 us; Mosaic ragged dot per FC1 plane 200-300 us
# at m = 4096 (103 GFLOP), 120-180 us at 2048 (weight reads then compute); the fused layer at
# m = 2048 ~2.5-3 ms (between call 54's 1646 us at 1024 and 4525 us at 4096).
CALL=call55
timeout 100 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 2048 --no-baseline --out $RES/55_moe.json > $RES/55_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/55_moe.log | tail -2 | cut -c1-170; save
timeout 300 python3 scripts/gpu_moe_prefill_probe.py --m 4096,2048 --tilings '128,128,64,4,1|64,256,64,4,2|128,128,64,4,2' --out $RES/55_probe.json > $RES/55_probe.log 2>&1
t "probe rc=$?"; grep -v -i warn $RES/55_probe.log | cut -c1-300 | tail -12; save
t done
