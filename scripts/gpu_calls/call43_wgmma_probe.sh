# (Record of a session-29 call: it ran on a working tree with temporary switches of the wgmma
# kernel that lost their A/Bs and were removed; bench/results/gpu_session29_2026-12-06/README.md.)
# Call 43 (~5 min): what the wgmma kernel's time is made of (call 40's ncu: latency-bound decode,
# 39-46% issue; call 41: two interleaved decode chains per warp gained nothing at m = 128, so
# ILP alone is not it). Timing probes (EXL3_JAX_WGMMA_PROBE, outputs meaningless): "no_mma" decodes
# every tile and skips the wgmmas (CPU SASS, 8192x28672 K4 mcg m_tile 128: 240 instructions per
# chunk vs 256, 38 registers, shared memory still 2 CTAs per SM), "no_decode" issues the wgmmas
# on the raw loaded words (115 instructions per chunk). Prediction, m = 128: no_mma ~75% of the
# kernel (the HGMMAs' register-file traffic and waits cost the decode ~25%), no_decode ~45%.
# If no_mma ~ the kernel, the decode alone is the bound (more decode warps or fewer
# instructions); if no_mma + no_decode ~ the kernel, the two do not overlap (warp specialisation).
CALL=call43
timeout 220 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA_PROBE --values '|no_mma|no_decode||no_mma|no_decode' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 128,1024 --out $RES/43_probe.json > $RES/43_probe.log 2>&1
t "ab probe rc=$?"; ab_rows $RES/43_probe.log EXL3_JAX_WGMMA_PROBE; save
timeout 100 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA_PROBE --values '|no_mma|no_decode||no_mma|no_decode' --env2 EXL3_JAX_PLAN=wgmma --env2 EXL3_JAX_WGMMA=256,2,1 --shapes 8192x28672 --K 4 --codebooks mcg --m 1024 --out $RES/43_probe256.json > $RES/43_probe256.log 2>&1
t "ab probe 256 rc=$?"; ab_rows $RES/43_probe256.log EXL3_JAX_WGMMA_PROBE; save
t done
