# Call 46 (~5 min, queued; any H100 / H200): why the wgmma kernel's decode and wgmmas overlap so
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
tree_patched probe scripts/gpu_calls/wgmma_probes.patch
timeout 200 python3 $ROOT/scripts/gpu_linear_ab.py --env EXL3_JAX_WGMMA_PROBE --values '|indep|no_mma|no_decode||indep' --env2 EXL3_JAX_PLAN=wgmma --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 128,1024 --out $RES/46_probe.json > $RES/46_probe.log 2>&1
t "ab probe rc=$?"; ab_rows $RES/46_probe.log EXL3_JAX_WGMMA_PROBE; save
cd $ROOT    # ncu_kernel runs scripts/gpu_probe_linear.py from the repo root; PYTHONPATH stays on the probe tree
EXL3_JAX_PLAN=wgmma EXL3_JAX_WGMMA_PROBE=indep NCU_TOP=12 ncu_kernel 46_indep wgmma --k 8192 --n 28672 --K 4 --codebook mcg --m 1024 --calls 3
tree here
t done
