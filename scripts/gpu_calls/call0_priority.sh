# Call 0 (~9.5 min), for a session with time for one call: what main's users depend on first.
# The merged default kernels at production size on the hardware (decode plan, m = 1 and 16;
# the MoE layer), then one timing round of main against base (55c788a) for the linears and
# the Qwen3 MoE layer, then the token-tile kernels' hardware check (wgmma's ISA reading).
CALL=call0
timeout 100 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 1,16 --kinds decode --budget-s 80 --out $RES/0_validate.json > $RES/0_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $RES/0_validate.log | cut -c1-300; grep -i "FAIL\|Traceback" $RES/0_validate.log | head -5 | cut -c1-300; save
timeout 80 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 60 --sections decode_bitwise,geometry --out $RES/0_validate_moe.json > $RES/0_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/0_validate_moe.log | head -5 | cut -c1-300; save
for name in base here; do bench_linear $name 0_linear_$name 110; done
for name in base here; do bench_moe $name 0_moe_$name 90; done
tree here
timeout 120 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --m 128,1000 --kinds tiles,wgmma --budget-s 90 --out $RES/0_validate_tiles.json > $RES/0_validate_tiles.log 2>&1
t "validate token tiles rc=$?"; grep SUMMARY $RES/0_validate_tiles.log | cut -c1-300; grep -i "FAIL\|first_bad\|layout" $RES/0_validate_tiles.log | head -5 | cut -c1-300; save
t done
