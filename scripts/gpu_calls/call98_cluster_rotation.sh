# Call 98 (session 43, ~9 min, any card): the hardware check and first timing of FC1's rotation
# shared by a thread-block cluster (issue #6: Qwen3-30B-A3B m = 1, target 20.4 us; main
# 25.0-25.9 on session 41's H100), together with call 96's two cuts (queued since session 42:
# the Hadamard's shuffle stages as one fma, the per-route glue on live rows only).
# The cluster form: per-route FC1 launched with clusters of 8 CTAs along its n-tile axis
# (Qwen3: 24 n-tile CTAs per plane and route, 3 clusters; GLM-5.2 TP4: 16, 2 clusters); each
# CTA rotates 2 of the row's 16 (GLM: 6 of 48) 128-blocks with 2 (6) of its 8 warps and stores
# them into all 8 CTAs' shared memory (mapa + st.shared::cluster.v4), between a kernel-start
# relaxed arrive / wait and a release / acquire cluster barrier. Emulated: bitwise the per-CTA
# rotation (tests/test_emulated_kernels.py::test_fc1_cluster_rotation_is_bitwise_...).
# 1. gpu_validate_moe decode_bitwise, edge, tiers, accuracy with the clusters on (auto; main
#    defaults to EXL3_JAX_MOE_CLUSTER=1 until this call times them):
#    the launch itself (cluster + PDL attributes through cutlass_call) is new on hardware.
# 2. bench moe Qwen3-30B-A3B and GLM-5.2 TP4, m 1, 2, 4, no baseline, alternating processes:
#    s42 (4bd7dc8: before call 96's cuts), here with EXL3_JAX_MOE_CLUSTER=1 (call 96's cuts
#    alone), here (cuts + clusters).
# Prediction: every section ok. Cuts vs s42 as call 96 said: Qwen3 m = 1 -0.2 to -0.8 us,
# m = 2 / 4 -0.3 to -1.0, GLM -0.3 to -1.0. Clusters vs cuts: Qwen3 m = 1 -0.4 to -1.0 us
# (call 94 bounded the whole rotate-in at 2.2 us; the clusters remove FC1's Hadamards and
# stores but not the row's loads and max, -7.8% of FC1's PTX warp-instructions by
# scripts/emulated_issue_counts.py, and add two cluster barriers' latency), m = 2 / 4 -0.5 to
# -2 (call 94: 3.2 / 5.2 us there); GLM-5.2 TP4 (6 blocks per warp today) -0.5 to -2. Keep clusters if Qwen3 m = 1 gains >= 0.3 us and no row loses beyond its spread;
# then CLUSTER_DEFAULT (ffi/trellis_moe.py) becomes "auto"; else it stays "1" and NOTES say why.
CALL=call98
export EXL3_JAX_MOE_CLUSTER=auto
timeout 170 python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 150 --sections decode_bitwise,edge,tiers,accuracy --out $RES/98_validate.json > $RES/98_validate.log 2>&1
t "validate rc=$?"; grep -E '"ok": false|error|Error|Traceback' $RES/98_validate.log | cut -c1-200 | head -8; tail -1 $RES/98_validate.log | cut -c1-300; save
moe_cluster_ab 98_r1 s42 cuts here
t done
