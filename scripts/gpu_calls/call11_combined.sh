# Call 11 (~9.5 min): session 22's three levers in one call, timed only (validation follows in
# a later call for whatever wins):
#  1. the MoE FC1 / FC2 one-token rows against the tree before them (prev): Qwen3-30B-A3B
#     m = 1..8, here / prev / here. Prediction: the layer at m = 1 24.8 -> 22.5-23.5 us.
#  2. split pairs over 3 token groups (EXL3_JAX_SPLIT_GROUPS) at m = 16 and 24, mcg K3 / K4.
#     Prediction: m = 16 8192x28672 K4 94-105 -> 70-85 us if the ALU binds (-35% ALU ops).
#  3. the wgmma kernel with A from shared memory (2 / 4 warpgroups) against register A at
#     8192x28672 m = 128 and 1024, K4 mcg. Prediction (session 21): m = 128 209 -> 120-160 us,
#     m = 1024 1214 -> 650-800 us with 4 warpgroups.
CALL=call11
bench_moe here 11_moe_here 70; bench_moe prev 11_moe_prev 70; bench_moe here 11_moe_here2 70
tree here
for m in 16 24; do ab_split_groups 11_ab_split_$m $m; done
for m in 128 1024; do ab_a_smem 11_smem_$m $m; done
t done
