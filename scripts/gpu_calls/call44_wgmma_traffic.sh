# (Record of a session-29 call: it ran on a working tree with temporary switches of the wgmma
# kernel that lost their A/Bs and were removed; bench/results/gpu_session29_2026-12-06/README.md.)
# Call 44 (~4 min): the wgmma kernel's activation traffic. Call 43's probes (H100, 8192x28672 K4
# mcg): m = 1024 kernel 1209-1251 us, decode without wgmmas 691-695, wgmmas without decode
# 798-803; with 256-token tiles the decode-only time stays 675 although its decode halves: both
# probes track the activation copies, (n / 128) x m x k x 2 bytes = 3.76 GB from the L2 at
# m = 1024 (~680 us at ~5.5 TB/s), whatever the token tile. Two ways to fewer L2 bytes:
# (1) EXL3_JAX_WGMMA_L1=1: the activation copies cp.async.ca (L1-allocating) instead of .cg, so
# the second CTA of an SM (same token tile, same chunk at about the same time) may hit in L1.
# Prediction: m = 128 -5 to -20%, m = 1024 -10 to -30% if it hits, else 0. (2) 4 warpgroups
# (256 columns per CTA; 119 registers, 96 KB, one CTA per SM; no fused epilogue, so the output
# transform runs as its own kernel): half the activation bytes. Prediction: m = 128 -10 to -20%,
# m = 1024 -15 to -30%.
CALL=call44
timeout 120 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA_L1 --values '0|1|0|1' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 32,128,1024 --out $RES/44_l1.json > $RES/44_l1.log 2>&1
t "ab l1 rc=$?"; ab_rows $RES/44_l1.log EXL3_JAX_WGMMA_L1; save
timeout 100 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values '128,2,1|128,4,1,0|128,2,1|128,4,1,0' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 128,1024 --out $RES/44_wg4.json > $RES/44_wg4.log 2>&1
t "ab 4 warpgroups rc=$?"; ab_rows $RES/44_wg4.log EXL3_JAX_WGMMA; save
timeout 60 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values '128,2,1|128,4,1,0' --env2 EXL3_JAX_PLAN=wgmma --env2 EXL3_JAX_WGMMA_L1=1 --shapes 8192x28672 --K 4 --codebooks mcg --m 128,1024 --out $RES/44_wg4_l1.json > $RES/44_wg4_l1.log 2>&1
t "ab 4 warpgroups + l1 rc=$?"; ab_rows $RES/44_wg4_l1.log EXL3_JAX_WGMMA; save
t done
