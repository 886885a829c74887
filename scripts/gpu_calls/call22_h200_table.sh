# Call 22 (~8 min; for an H200: the issue's targets are the H200's): the issue #5 table with the
# session-24 defaults (one-token ring plan past 2^26 weights, prefill transforms below 2048
# rows), the ring against EXL3_JAX_DECODE_RING=off at m = 1 in one process, the MoE m = 1..8,
# and the e2e decode (dense b1 / b8, Qwen3 MoE b1 / b8). Decision rule: the ring stays the
# default if it is not slower than off at 8192x28672 K4 (both codebooks) on the H200.
CALL=call22
timeout 220 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,128,1024,4096 --out $RES/22_linear.json > $RES/22_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/22_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -60; save
EXL3_JAX_PLAN=decode timeout 90 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|off||off' --shapes 8192x28672,4096x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $RES/22_ring_ab.json > $RES/22_ring_ab.log 2>&1
t "ab ring rc=$?"; grep '^{' $RES/22_ring_ab.log | cut -c1-200; save
bench_moe here 22_moe 60
(cd scripts && timeout 170 python3 gpu_e2e_decode.py --cases dense:1:512,dense:8:64,moe:1:512,moe:8:64 --codebook mcg --repeats 3 --budget-s 160 --hard-limit-s 165 --out $RES/22_e2e.json > $RES/22_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "^dense:|^moe:" $RES/22_e2e.log | cut -c1-120 | head -6; save
t done
