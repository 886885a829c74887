# Call 33 (~3 min; after call 32 on the same machine): where the m = 1 decode kernel's warps
# stall since the cp.async ring (session 24) replaced its global weight loads (call 9, before
# the ring: 65% of samples long-scoreboard at the first funnel of each step's words, 1.7 of 15
# warps eligible). SASS counts of the ring kernels (CPU, 8192x28672 K4): mcg 563 / mul1 581
# instructions per chunk of 128 weights per lane, ~50% of the issue bound at 63 us. Same
# sections as call 9, default plans (ring, 3 slots), K4 mcg and mul1.
CALL=call33
for cb in mcg mul1; do
    timeout 120 ncu --clock-control none -k regex:"trellis" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --import-source no -f -o $RES/33_m1_$cb python3 scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 4 --codebook $cb --m 1 --calls 3 > $RES/33_ncu_$cb.log 2>&1
    t "ncu source $cb rc=$?"; tail -3 $RES/33_ncu_$cb.log | cut -c1-200
    ncu -i $RES/33_m1_$cb.ncu-rep --page source --csv --print-source sass > $RES/33_m1_${cb}_sass.csv 2> $RES/33_m1_${cb}_sass.err
    ncu -i $RES/33_m1_$cb.ncu-rep --page details > $RES/33_m1_${cb}_details.txt 2>&1
    grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Eligible Warps|Active Warps|Block Limit|Achieved Occ|Shared Memory Config|Dynamic Shared" $RES/33_m1_${cb}_details.txt | cut -c1-120 | head -16
    python3 scripts/ncu_source_summary.py $RES/33_m1_${cb}_sass.csv --top 30 > $RES/33_m1_${cb}_summary.txt 2>&1
    head -c 4500 $RES/33_m1_${cb}_summary.txt; rm -f $RES/33_m1_${cb}_sass.csv; save
done
t done
