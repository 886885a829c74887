# Call 21 (~2.5 min): call 19's e2e A/B again (Llama-3-8B geometry, batch 1): off, ring, off.
CALL=call21
e2e() {   # TAG RING_ENV
    (cd scripts && EXL3_JAX_DECODE_RING=$2 timeout 55 python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mcg --repeats 3 --budget-s 50 --hard-limit-s 52 --out $RES/$1.json > $RES/$1.log 2>&1)
    t "e2e $1 ring='$2' rc=$?"; grep -E "^dense:" $RES/$1.log | cut -c1-120 | head -2; save
}
e2e 21_e2e_off off; e2e 21_e2e_ring ''; e2e 21_e2e_off2 off
t done
