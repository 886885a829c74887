# Call 18 (~6 min): the decode ring without a register cap (call 17's best setting, 3,4,2,0 at
# 8192x28672 K4 mcg: -7%, one sample) against direct loads, repeated, at K 3 and 4, both
# codebooks; no EXL3_JAX_ROW_LINEAR override, so '' at 4096x14336 m = 1 is the production row
# linear (a ring plan runs trellis_mma).
CALL=call18
ab_ring2() {   # TAG SHAPES K CODEBOOKS VALUES SECONDS
    EXL3_JAX_PLAN=decode timeout $6 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values "$5" --shapes $2 --K $3 --codebooks $4 --m 1 --out $RES/$1.json > $RES/$1.log 2>&1
    t "ab ring $1 rc=$?"; grep '^{' $RES/$1.log | cut -c1-200; grep -i "Traceback\|Error" $RES/$1.log | head -3; save
}
ab_ring2 18_ring 8192x28672 4 mcg,mul1 '|3,4,2,0|4,4,2,0|3,8,1,0||3,4,2,0|4,4,2,0|3,8,1,0' 150
ab_ring2 18_ring_k3 8192x28672 3 mcg,mul1 '|3,4,2,0|4,4,2,0||3,4,2,0' 90
ab_ring2 18_ring_4096 4096x14336 4 mcg,mul1 '|3,4,2,0|4,4,2,0|3,2,4,0||3,4,2,0' 90
ab_ring2 18_ring_down 14336x4096 4 mcg '|3,4,7,0|3,2,14,0||3,4,7,0|3,2,14,0' 60
t done
