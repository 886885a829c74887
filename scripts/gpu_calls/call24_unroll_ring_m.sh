# Call 24 (~6 min): the decode plan's chunk by token groups, after call 23 moved m_tile 16 (two
# groups) to 8-step chunks: (1) the new default against the old 2-step chunks
# (EXL3_JAX_DECODE_RING=0,2,0) at the other issue shapes and again at 8192x28672; (2) m = 24
# (three groups, 1-step chunks) against 2 / 4 / 8; (3) the uncapped ring at m = 4 / 8 (one
# group of B fragments; call 17 timed it capped only); (4) the decode rows of the hardware
# validation at a shape whose m = 16 plan takes 8-step chunks (4096x4096: 2 splits, 16 steps
# per warp), m = 9 / 16 / 24.
CALL=call24
ab_ring 24_m16 16 8192x28672,14336x4096,4096x4096,2048x768 '|0,2,0|'
ab_ring 24_m24 24 8192x28672,4096x14336 '|0,2,0|0,4,0|0,8,0|'
ab_ring 24_ring4 4,8 8192x28672,4096x28672 '|3,8,0|'
timeout 120 python3 scripts/gpu_validate.py --quick --no-bench --sections gemm --kinds decode --m 9,16,24 --k 4096 --n 4096 --budget-s 100 --out $RES/24_validate.json > $RES/24_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/24_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/24_validate.log | head -4 | cut -c1-300; save
t done
