# Call 13 (~10 min, cut off by the limit if need be; every step saves): session 22 in one call
# for when only one comes, in order of what decides most: the MoE one-token rows against the
# tree before them (prev) on Qwen3-30B-A3B m = 1..8, the MoE validation of the new path
# (decode_bitwise, edge, accuracy, Qwen3 geometry), split pairs over 3 token groups at m = 16,
# A from shared memory at 8192x28672 m = 128 and 1024, the MoE bench again, then call 9's ncu.
CALL=call13
bench_moe here 13_moe_here 70; bench_moe prev 13_moe_prev 70
tree here
timeout 130 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 110 --sections decode_bitwise,edge,accuracy,geometry --out $RES/13_validate_moe.json > $RES/13_validate_moe.log 2>&1
t "validate moe rc=$?"; grep -i "summary\|FAIL\|Traceback" $RES/13_validate_moe.log | head -8 | cut -c1-300; save
ab_split_groups 13_ab_split_16 16
for m in 128 1024; do ab_a_smem 13_smem_$m $m; done
bench_moe here 13_moe_here2 70
tree here
source scripts/gpu_calls/call9_ncu_source.sh
