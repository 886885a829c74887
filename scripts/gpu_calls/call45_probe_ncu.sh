# (Record of a session-29 call: it ran on a working tree with temporary switches of the wgmma
# kernel that lost their A/Bs and were removed; bench/results/gpu_session29_2026-12-06/README.md.)
# Call 45 (~3 min): Nsight Compute of call 43's two timing probes of the wgmma kernel at
# 8192x28672 K4 mcg m = 1024 (forced wgmma, 128-token tiles): "no_decode" (the wgmmas on the raw
# words: 798-803 us against a ~510 us tensor floor) and "no_mma" (the decode alone: 691-695 us).
# Call 44 ruled out the activation bytes as the bound (half of them: -6%; L1-cached copies: 0).
# The pipes' utilisation (tensor among them), warp stalls by line and the L2 throughput say
# which resource each half waits on.
CALL=call45
for probe in no_decode no_mma default; do
    EXL3_JAX_PLAN=wgmma EXL3_JAX_WGMMA_PROBE=${probe#default} NCU_TOP=12 ncu_kernel 45_$probe wgmma --k 8192 --n 28672 --K 4 --codebook mcg --m 1024 --calls 3
    ncu -i $RES/45_$probe.ncu-rep --page raw --csv > $RES/45_${probe}_raw.csv 2>&1
    python3 -c "
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == 'ID')
for name, unit, value in zip(rows[head], rows[head + 1], rows[head + 2]):
    if re.search(r'pipe_.*(pct|active)|inst_executed_pipe|lts__t_bytes|tensor', name):
        print(name, unit, value)" $RES/45_${probe}_raw.csv 2>&1 | head -60; save
done
t done
