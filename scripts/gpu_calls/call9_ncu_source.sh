# Call 9 (~3 min): where the m = 1 decode kernel's warps stall, by SASS line (session 21's open
# question: 4.6 instructions per weight, ~32 us of issue against ~60 us measured at 8192x28672).
# Nsight Compute's SourceCounters sampling for K4 mcg and K4 mul1, summarised by
# scripts/ncu_source_summary.py; the .ncu-rep files come back for a closer look.
CALL=call9
for cb in mcg mul1; do
    timeout 120 ncu --clock-control none -k regex:"trellis" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SchedulerStats --import-source no -f -o $RES/9_m1_$cb python3 scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 4 --codebook $cb --m 1 --calls 3 > $RES/9_ncu_$cb.log 2>&1
    t "ncu source $cb rc=$?"; tail -3 $RES/9_ncu_$cb.log | cut -c1-200
    ncu -i $RES/9_m1_$cb.ncu-rep --page source --csv --print-source sass > $RES/9_m1_${cb}_sass.csv 2> $RES/9_m1_${cb}_sass.err
    t "source page rc=$? $(wc -l < $RES/9_m1_${cb}_sass.csv) lines"; head -c 600 $RES/9_m1_${cb}_sass.err
    ncu -i $RES/9_m1_$cb.ncu-rep --page details > $RES/9_m1_${cb}_details.txt 2>&1
    grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per" $RES/9_m1_${cb}_details.txt | cut -c1-120 | head -8
    python3 scripts/ncu_source_summary.py $RES/9_m1_${cb}_sass.csv --top 30 > $RES/9_m1_${cb}_summary.txt 2>&1
    head -c 5000 $RES/9_m1_${cb}_summary.txt; save
done
t done
