# Call 28 (~5 min): session 26's mul1 ring for 2-8 tokens end to end: the Llama-3-8B geometry
# at 4 bpw mul1, batch 8 (the gate/up group 4096x28672 and the lm_head take the ring at m = 8;
# q/k/v, o and down stay below 2^26 weights), default vs EXL3_JAX_DECODE_RING=off (which also
# turns the one-token ring off: batch 8 runs no one-token linear), default again; then batch 1
# once (mul1's first e2e row). Prediction: batch 8 +1 to +3% tok/s (the group and lm_head are
# ~35% of the step's linear time and gained 2-7% standalone at K4).
CALL=call28
e2e() {   # TAG CASES RING_ENV
    (cd scripts && EXL3_JAX_DECODE_RING=$3 timeout 110 python3 gpu_e2e_decode.py --cases $2 --codebook mul1 --repeats 3 --budget-s 95 --hard-limit-s 100 --out $RES/$1.json > $RES/$1.log 2>&1)
    t "e2e $1 $2 ring='$3' rc=$?"; grep -E "^dense|tok/s" $RES/$1.log | cut -c1-200 | head -4; save
}
e2e 28_b8_ring dense:8:64 ''; e2e 28_b8_off dense:8:64 off; e2e 28_b8_ring2 dense:8:64 ''
e2e 28_b1 dense:1:512 ''
t done
