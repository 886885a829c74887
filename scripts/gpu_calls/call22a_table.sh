# Call 22 (~10 min, run as 22a: the table and the ring A/B, and 22b: MoE, e2e, group check: split it where the limit is 600 s; meant for an H200, whose numbers the
# issue's targets are): the issue #5 table with the session-24 defaults (one-token ring plan past
# 2^26 weights, prefill transforms below 2048 rows) and the new L2-cold timing (`--l2 cold`,
# the default: weight copies cycled past the L2); the ring against EXL3_JAX_DECODE_RING=off at
# m = 1, L2-cold and -warm (calls 17-20 timed warm: 4096x28672 K4's 59 MB mostly fit the 50 MB
# L2, which may be why the e2e decode did not show the ring's gain there); the MoE m = 1..8
# (cold: routes to other experts per call); the e2e decode; the ring in the group kernel.
# Decision rule: the ring stays the default past 2^26 weights where it is not slower than off
# L2-cold at 8192x28672 and 4096x28672 K4 (both codebooks); else it goes (one loading path).
CALL=call22a
timeout 220 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,128,1024,4096 --out $RES/22_linear.json > $RES/22_linear.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $RES/22_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -60; save
for l2 in cold warm; do
EXL3_JAX_PLAN=decode timeout 90 python3 scripts/gpu_linear_ab.py --bf16 --l2 $l2 --env EXL3_JAX_DECODE_RING --values '|off||off' --shapes 8192x28672,4096x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $RES/22_ring_ab_$l2.json > $RES/22_ring_ab_$l2.log 2>&1
t "ab ring l2=$l2 rc=$?"; grep '^{' $RES/22_ring_ab_$l2.log | cut -c1-200; save
done
t done
