# Call 20 (~1.5 min): the ring plan against direct loads (EXL3_JAX_DECODE_RING=off) at the
# Llama-3-8B geometry's one-token shapes past ROW_LINEAR_MAX_WEIGHTS (call 19: its decode was
# 281-286 tok/s with the ring, 288 without): gate/up as one 4096x28672 linear (K4) and the
# lm_head 4096x128256 (K6), with 8192x28672 K4 mcg as the control; '' = the ring plan.
CALL=call20
EXL3_JAX_PLAN=decode timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|off||off' --shapes 4096x28672,8192x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $RES/20_ab.json > $RES/20_ab.log 2>&1
t "ab rc=$?"; grep '^{' $RES/20_ab.log | cut -c1-200; save
EXL3_JAX_PLAN=decode timeout 80 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|off||off' --shapes 4096x128256 --K 6 --codebooks mcg --m 1 --out $RES/20_ab_head.json > $RES/20_ab_head.log 2>&1
t "ab head rc=$?"; grep '^{' $RES/20_ab_head.log | cut -c1-200; save
t done
