# Ran in session 30 (bench/results/gpu_session30_2026-12-06): the warp-specialised form it
# validates and times was removed after it (slower everywhere), so its first three steps no
# longer run on main; the probe steps do (wgmma_probes.patch).
# Call 46 (~8 min, queued; any H100 / H200): (1) the warp-specialised wgmma form (session 29:
# producer warpgroups decode into shared A stages by stmatrix, consumer warpgroups issue wgmmas
# from descriptors; emulated bit for bit against the fp32 reference, compiled without spills)
# validated on the hardware and timed against the register-A kernel. Prediction (8192x28672 K4
# mcg, H100): 2 producer warpgroups / 128-token tiles at m = 128 -20 to -40% (decode at its own
# ~70% issue rate beside the tensor work) if the wgmmas in flight do not slow the decode as they
# do in warps that do both, else 0 to -10%; 4 producers / 64-token tiles: twice the decode per
# token, 16 decoding warps per SM: -10 to +20% at m = 128. (2) why the kernel's decode and wgmmas overlap so
# little (session 29, calls 43 / 45: alone 630 / 762 us at 8192x28672 K4 mcg m = 1024, together
# 1120-1250, the decode's dispatch stalls 6.8% -> 23.1% and its ALU 67.6% -> 49.2% of cycles).
# The probes of calls 43 / 45 plus "indep" (scripts/gpu_calls/wgmma_probes.patch, applied to a
# copy of this tree by `tree_patched`; main keeps no probe): every tile decoded as in the kernel
# (its A values folded into one register) and the same wgmmas issued on constant A registers, so
# the two share the SM but not a dependency chain. Decides the next kernel form: if "indep" runs
# as slow as the kernel (~1.2 ms), wgmmas in flight slow the decode wherever it runs (register
# file traffic of the accumulators; a warp-specialised form would not help as such); if it runs
# near the slower half (~800 us), the per-warp chain decode -> wgmma -> wait is what serialises
# them, and decoding in producer warps (bench/NOTES.md, session 29, "Next") should pay.
CALL=call46
timeout 150 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds wgmma_ws --m 64,128,1000 --budget-s 120 --out $RES/46_validate_ws.json > $RES/46_validate_ws.log 2>&1
t "validate wgmma_ws rc=$?"; tail -3 $RES/46_validate_ws.log | cut -c1-200; save
timeout 200 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values '128,2,1|128,2,1,1,4,2|64,2,1,1,4,4|128,2,1|128,2,1,1,4,2|64,2,1,1,4,4' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 128 --out $RES/46_ws.json > $RES/46_ws.log 2>&1
t "ab ws m=128 rc=$?"; ab_rows $RES/46_ws.log EXL3_JAX_WGMMA; save
timeout 150 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA --values '128,2,1|128,2,1,1,4,2|128,2,1|128,2,1,1,4,2' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672 --K 4 --codebooks mcg --m 64,1024 --out $RES/46_ws_m.json > $RES/46_ws_m.log 2>&1
t "ab ws m=64,1024 rc=$?"; ab_rows $RES/46_ws_m.log EXL3_JAX_WGMMA; save
tree_patched probe scripts/gpu_calls/wgmma_probes.patch
timeout 200 python3 $ROOT/scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA_PROBE --values '|indep|no_mma|no_decode||indep' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 128,1024 --out $RES/46_probe.json > $RES/46_probe.log 2>&1
t "ab probe rc=$?"; ab_rows $RES/46_probe.log EXL3_JAX_WGMMA_PROBE; save
cd $ROOT    # ncu_kernel runs scripts/gpu_probe_linear.py from the repo root; PYTHONPATH stays on the probe tree
EXL3_JAX_PLAN=wgmma EXL3_JAX_WGMMA_PROBE=indep NCU_TOP=12 ncu_kernel 46_indep wgmma --k 8192 --n 28672 --K 4 --codebook mcg --m 1024 --calls 3
tree here
t done
