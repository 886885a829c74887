# Call 19 (~5 min): the one-token ring plan as the default past ROW_LINEAR_MAX_WEIGHTS (session
# 24). Correctness on the hardware at a shape that takes it (4096x16512: 68 M weights; every
# quick config, K6 / K8 included: their wider slots, K8's 4-step chunks), NaN-poisoned and
# production paths, decode (the plan's ring) and decode_ring (2-step chunks); then the Llama-3-8B
# geometry decode at batch 1 (gate/up group and lm_head past the size: ring) with the ring and
# with EXL3_JAX_DECODE_RING=off (ring, off, ring).
CALL=call19
timeout 130 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 1 --k 4096 --n 16512 --budget-s 110 --out $RES/19_validate.json > $RES/19_validate.log 2>&1
t "validate ring rc=$?"; grep SUMMARY $RES/19_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/19_validate.log | head -4 | cut -c1-300; save
e2e() {   # TAG RING_ENV
    (cd scripts && EXL3_JAX_DECODE_RING=$2 timeout 100 python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mcg --repeats 3 --budget-s 90 --hard-limit-s 95 --out $RES/$1.json > $RES/$1.log 2>&1)
    t "e2e $1 ring='$2' rc=$?"; grep -E "^dense|tok/s" $RES/$1.log | cut -c1-200 | head -4; save
}
e2e 19_e2e_ring ''; e2e 19_e2e_off off; e2e 19_e2e_ring2 ''
t done
