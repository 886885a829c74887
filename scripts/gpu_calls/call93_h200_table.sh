# Call 93 (session 41; for an H200 only, asked with needs_h200): issue #5's and #6's tables on
# the H200 by the method of sessions 38-40 (alternating rounds, the barrier after the chain's
# add), which no H200 has run yet: every call of sessions 38-40 got an H100. Two commands,
# issued back to back (the machine leaves after 30 s idle): PART=1, call 80's two steps
# (scripts/gpu_calls/call80_h200_method.sh, its predictions in its header); PART=2, `bench moe`
# on the three geometries at m 1..8 and the e2e decode of the Qwen3-30B-A3B geometry (b1, b8)
# and of the Llama-3-8B geometry (b1, against bf16).
# Predictions for PART=2 (H200): Qwen3-30B-A3B m = 1 21.5-23.5 us (sessions 34-35 gave
# 24.7-25.4 with the old loop, whose per-call cost was 2.2-3.8 us; the H100 gives 22.7-24.0
# now and the layer is decode- and latency-bound, so the card's faster HBM buys ~0-1 us),
# so issue #6's 20.4 us stays unmet by 1-3 us; m = 2..8 within 2x in every geometry (as on the
# H100: x1.17-1.74); e2e Qwen3 b1 305-320 tok/s, b8 1040-1100 (sessions 34-36: 306-308,
# 1061), Llama-3-8B b1 1.85-2.0x bf16 (session 34: 1.93x).
CALL=call93
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    t "not an H200: nothing run"; exit 0
fi
if [ "${PART:-1}" = 1 ]; then
    source scripts/gpu_calls/call80_h200_method.sh
else
    timeout 200 python3 -m exl3_jax.cli bench moe --m 1,2,4,8 --out $RES/93_moe.json > $RES/93_moe.log 2>&1
    t "bench moe rc=$?"; grep -v -i warn $RES/93_moe.log | grep -E "m=" | cut -c1-160 | head -20; save
    (cd scripts && timeout 260 python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64,dense:1:512,dense_bf16:1:512 --codebook mcg --repeats 3 --budget-s 240 --hard-limit-s 255 --out $RES/93_e2e.json > $RES/93_e2e.log 2>&1)
    t "e2e rc=$?"; grep -E "tok/s" $RES/93_e2e.log | cut -c1-200 | head -8; save
fi
t done
