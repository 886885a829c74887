# Call 29 (~8 min, on an H200: the issues' targets are H200 numbers; call 28 found no H100):
# (1) `bench linear`, the issue #5 table with session 26's defaults (as call 27 on the H100);
# (2) `bench moe`, Qwen3-30B-A3B m 1..8; (3) call 28's e2e A/B: the Llama-3-8B geometry at
# 4 bpw mul1, batch 8, ring (default) vs EXL3_JAX_DECODE_RING=off (prediction: +1 to +3%
# tok/s with the ring: the gate/up group and the lm_head take it at m = 8).
CALL=call29
timeout 220 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/29_linear.json > $RES/29_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/29_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
timeout 90 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/29_moe.json > $RES/29_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/29_moe.log | tail -8 | cut -c1-160; save
e2e() {   # TAG CASES RING_ENV
    (cd scripts && EXL3_JAX_DECODE_RING=$3 timeout 110 python3 gpu_e2e_decode.py --cases $2 --codebook mul1 --repeats 3 --budget-s 95 --hard-limit-s 100 --out $RES/$1.json > $RES/$1.log 2>&1)
    t "e2e $1 $2 ring='$3' rc=$?"; grep -E "^dense|tok/s" $RES/$1.log | cut -c1-200 | head -4; save
}
e2e 29_b8_ring dense:8:64 ''; e2e 29_b8_off dense:8:64 off
t done
