# (Record of a session-29 call: it ran on a working tree with temporary switches of the wgmma
# kernel that lost their A/Bs and were removed; bench/results/gpu_session29_2026-12-06/README.md.)
# Call 41 (~8 min): (1) the wgmma kernel decoding two k16 steps before their two wgmmas
# (EXL3_JAX_WGMMA_BATCH=2, WgmmaGemmConfig.step_batch; 123 vs 118 registers at m_tile 128, still
# 2 CTAs per SM, no spills) against one step per wgmma, alternated twice. Call 40's ncu: the
# kernel issues in 39% (m = 128) / 46% (m = 1024) of cycles with 3.3-3.9 warps per scheduler
# and 0.9-1.1 eligible, stalls spread over dispatch / fixed-latency wait / math / short
# scoreboard, barrier 2%, HGMMA 6-7% of samples: latency-bound decode chains. Two independent
# tiles per batch give ptxas two chains to interleave. Prediction: m = 128 -5 to -15%, m = 32
# 0 to -10%. (2) Call 39 (queued since session 28): the MoE two-pipe extraction against the
# session-27 tree in three alternating pairs, then e2e with session 28's defaults.
CALL=call41
timeout 200 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_WGMMA_BATCH --values '1|2|1|2' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 32,128 --out $RES/41_batch.json > $RES/41_batch.log 2>&1
t "ab batch rc=$?"; ab_rows $RES/41_batch.log EXL3_JAX_WGMMA_BATCH; save
source scripts/gpu_calls/call39_moe_nibble_e2e.sh
