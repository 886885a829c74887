# Call 67 (~4 min, an H100 / H200; session 35): where the Qwen3 m = 1 layer's GEMMs stall.
# Call 66 (H100, ncu durations, launches serialised): FC1 12.0-13.1 us, activation 4.1-4.4,
# FC2 7.2-7.4, combine 3.1-3.3 (sum ~27 us; the chained layer 24.0 us with 2.5 us of loop).
# FC1's k loop is 268 instructions per 64 weights and lane (4.19 per weight, CPU SASS): its
# 25.2 M weights are ~3.3 M warp instructions, ~3.2 us at one instruction per scheduler and
# clock, and its 12.6 MB of trellis ~3.8 us at HBM speed, so at 12-13 us FC1 issues on ~25-30% of
# its cycles. (1) ncu of FC1 and FC2 (one launch each, the sections of pre.sh's ncu_kernel),
# the details' key lines and the source summary's top lines. (2) gpu_validate_moe's profile at
# m = 1: the stages and the FC1 / FC2 plan neighbours.
# Prediction: FC1 long-scoreboard (weights) and barrier (rotate-in prologue, fold) stalls over
# half of its samples, issue < 35% of active cycles; the plan neighbours within +-1 us.
CALL=call67
timeout 150 ncu --clock-control none -k regex:"grouped_mma" --launch-skip 8 --launch-count 2 --section SourceCounters --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --import-source no -f -o $RES/67_m1 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1 --no-baseline > $RES/67_ncu.log 2>&1
t "ncu rc=$?"; grep -v "^==PROF==" $RES/67_ncu.log | tail -2 | cut -c1-200
ncu -i $RES/67_m1.ncu-rep --page details > $RES/67_details.txt 2>&1
grep -E "grouped_mma|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Eligible Warps|Active Warps|Block Limit|Achieved Occ|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Dynamic Shared|Grid Size|Waves" $RES/67_details.txt | cut -c1-130 | head -60
ncu -i $RES/67_m1.ncu-rep --page source --csv --print-source sass > $RES/67_sass.csv 2>/dev/null
python3 scripts/ncu_source_summary.py $RES/67_sass.csv --top 25 > $RES/67_summary.txt 2>&1
head -c 6000 $RES/67_summary.txt; rm -f $RES/67_sass.csv; save
timeout 100 python3 scripts/gpu_validate_moe.py --sections profile --profile-m 1 --profile-s 80 --out $RES/67_profile.json > $RES/67_profile.log 2>&1
t "profile rc=$?"; grep -E '"m": 1' $RES/67_profile.log | cut -c1-200; save
t done
