# Call 62 (~3 min, an H100 / H200; session 33): the route packing with fewer XLA kernels (no
# searchsorted while loop, row_token gathered from the sort instead of scattered, per-row
# expert by a broadcast instead of jnp.repeat's scatter-add + cumsum, one cumsum for both prefix
# sums) against session 32's, in one process (scripts/gpu_calls/call62_pack_ab.py): tables
# equal, packing alone and the Qwen3-30B-A3B layer at m 128 / 512 / 1024 / 4096.
# Prediction: packing 49 / 59 / 78 us (call 58 / 61, route_row only; the whole packing more)
# -> 20-35 us at every m; the layer -30 to -60 us at each m (-5 to -10% at 512-1024).
CALL=call62
git show 10e054d:exl3_jax/ops/moe_routing.py > /tmp/old_routing.py
timeout 300 python3 scripts/gpu_calls/call62_pack_ab.py --old /tmp/old_routing.py > $RES/62_pack_ab.log 2>&1
t "pack ab rc=$?"; grep '^{' $RES/62_pack_ab.log | cut -c1-300; tail -3 $RES/62_pack_ab.log | grep -v '^{' | cut -c1-300; save
t done
