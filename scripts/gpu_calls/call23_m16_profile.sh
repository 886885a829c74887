# Call 23 (~6 min): (1) where the ring's per-layer gain goes end to end: the decode step's
# per-kernel GPU time (JAX profiler trace, gpu_profile_decode.py) of the dense Llama-3-8B
# geometry at batch 1 with the ring (default) and EXL3_JAX_DECODE_RING=off; (2) the m = 16
# decode plan's chunk (unroll 2, the plan's, against 4 and 8: CPU-compiled SASS holds 70-78
# registers for mcg, 52-61 for mul1, so no occupancy is lost) and K-splits (4 / 8), L2-cold,
# EXL3_JAX_DECODE_RING=0,unroll,splits (0 slots: direct loads).
CALL=call23
for r in on off; do
  v=$r; [ $r = on ] && v=
  (cd scripts && EXL3_JAX_DECODE_RING=$v timeout 150 python3 gpu_profile_decode.py --models dense --batch 1 --out $RES/23_prof_$r.json > $RES/23_prof_$r.log 2>&1)
  t "profile ring=$r rc=$?"; grep '^{' $RES/23_prof_$r.log | cut -c1-600; save
done
EXL3_JAX_PLAN=decode timeout 240 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values '|0,4,0|0,8,0|0,4,8|0,8,8|' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mcg,mul1 --m 16 --out $RES/23_m16.json > $RES/23_m16.log 2>&1
t "ab m16 rc=$?"; grep '^{' $RES/23_m16.log | cut -c1-200; save
t done
