# Call 16 (~2.5 min, for a nearly spent budget): the transform-free prefill plan's dequantize
# kernel, three forms against each other at 8192x28672 m = 1024 and 4096 (K4 mcg and mul1):
# here (fp16 butterflies in both phases, 62 registers: 4 CTAs per SM; svh through shared
# memory), cur (e6955a8: fp32 butterflies in phase 1, 78 registers: 3 CTAs per SM) and prev
# (3903503: the transform kernels around W_hat^T, the plan before session 23), here twice.
# (Correctness of here: emulated only; cur passed the hardware validation in call 15.)
CALL=call16
bench_prefill() {
    tree $1
    EXL3_JAX_PLAN=prefill timeout $3 python3 -m exl3_jax.cli bench linear --shapes 8192x28672 --K 4 --codebooks mcg,mul1 --m 1024,4096 --out $RES/$2.json > $RES/$2.log 2>&1
    t "bench prefill $2 rc=$?"; grep -v -i warn $RES/$2.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -8; save
}
bench_prefill here 16_here 40; bench_prefill cur 16_cur 40; bench_prefill prev 16_prev 40; bench_prefill here 16_here2 40
tree here
# here's dequantize kernel on the hardware: W_hat bit-exact and the rotated weight's error
# (decode_exact), the prefill GEMM rows (8 configs, the m).
timeout 120 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds prefill --budget-s 100 --out $RES/16_validate.json > $RES/16_validate.log 2>&1
t "validate prefill rc=$?"; grep SUMMARY $RES/16_validate.log | cut -c1-300; grep -i "FAIL\|Traceback\|rotated" $RES/16_validate.log | head -10 | cut -c1-300; save
t done
