# Call 25 (~4 min): the ring in the linear-group kernel, standalone. Session 25's decode-step
# profile put the gate/up group kernel at 998 us per step with the ring and 970 without (+3%),
# while the one-linear A/B at 4096x28672 gained 7%. Groups as the model runs them
# (trellis_matmul_group_gpu), ring (default) vs EXL3_JAX_DECODE_RING=off, m = 1, L2-cold,
# twice each: Llama-3-8B gate/up (4096x14336+14336) and a 70B-like gate/up (8192x28672+28672).
# Decision rule: groups keep the ring where it is not slower than off at 4096x14336+14336 K4
# (both codebooks); else the group plan takes direct loads (decode_plan(..., ring=False)).
CALL=call25
EXL3_JAX_PLAN=decode timeout 150 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|off||off' --shapes 4096x14336+14336,8192x28672+28672 --K 4,3 --codebooks mcg,mul1 --m 1 --out $RES/25_group_ring.json > $RES/25_group_ring.log 2>&1
t "ab group ring rc=$?"; ab_rows $RES/25_group_ring.log EXL3_JAX_DECODE_RING; save
# mul1 split pairs over 2 token groups (m = 16; EXL3_JAX_SPLIT_GROUPS=2, new in session 25: the
# affine epilogue sums each group's x) against packed pairs (the default). mcg K4 gained 9-12%
# from split pairs at m = 16 (session 23); mul1 drops a PRMT and an HFMA2 per weight pair for
# one MMA per k16 step and group. CPU-compiled SASS at 8192x28672 (8-step chunks): instructions
# per chunk 800 -> 752 (K4) and 896 -> 848 (K3), registers 61 -> 78 (K4: 4 -> 3 CTAs per SM)
# and 68 -> 78. Prediction: 0 to -8%, or slower at K4 if the lost CTA binds. Rule: mul1 takes
# split pairs up to 2 groups where it wins at both shapes (trellis_gemm._split_groups).
EXL3_JAX_PLAN=decode timeout 120 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_SPLIT_GROUPS --values '|2||2' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mul1 --m 16 --out $RES/25_mul1_split.json > $RES/25_mul1_split.log 2>&1
t "ab mul1 split rc=$?"; grep '^{' $RES/25_mul1_split.log | cut -c1-220; save
t done
