# Call 38 (~5 min, on an H200: the issues' targets are H200 numbers): session 28's defaults
# (the dense kernels as session 27's; K4's two-pipe extraction in the MoE kernels). (1) `bench
# linear`, issue #5's table (the shapes, K 3 / 4, mcg / mul1, m 1..4096); (2) `bench moe`,
# Qwen3-30B-A3B m 1..8 (call 37 on the H100: m = 1 23.8 us). (End to end left out: the
# session's device time went to failed starts.)
CALL=call38
timeout 170 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/38_linear.json > $RES/38_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/38_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/38_moe.json > $RES/38_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/38_moe.log | tail -8 | cut -c1-160; save
t done
