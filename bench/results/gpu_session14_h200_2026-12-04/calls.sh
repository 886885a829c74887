set -u
mkdir -p /tmp/site && tar -xJf .device/cutlass_dsl_cp312_cu13.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
L=/tmp/logs; mkdir -p $L
ROOT=$(pwd)
t start

# ---- session 14 call 1: decode-plan sweep, ncu of the Qwen3 m=1 layer, command buffers vs PDL
python3 scripts/gpu_moe_plan_sweep.py --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1 --budget-s 260 --out $OUT/1_plan_sweep.json > $L/1_sweep.log 2>&1
t "sweep rc=$?"; grep -v -i warn $L/1_sweep.log | sort -t' ' -k2 | head -100 | cut -c1-160
timeout 150 ncu --clock-control none -k regex:"grouped_mma|activation|combine" --launch-skip 4 --launch-count 4 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats python3 scripts/gpu_moe_plan_sweep.py --once qwen3-30b-a3b --m 1 > $OUT/1_ncu_qwen3_m1.txt 2>&1
t "ncu rc=$?"; grep -E "grouped_mma|activation_k|combine_k|Duration|Executed Ipc A|Issue Slots Busy|Achieved Occupancy|Registers Per|Theoretical Occ|No Eligible|Warp Cycles Per Issued" $OUT/1_ncu_qwen3_m1.txt | cut -c1-150 | head -60
for cb in on off; do for pdl in 1 0; do
  if [ $cb = off ]; then export XLA_FLAGS=--xla_gpu_enable_command_buffer=; else unset XLA_FLAGS; fi
  EXL3_JAX_MOE_PDL=$pdl timeout 100 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2 --no-baseline --out $OUT/1_bench_cb${cb}_pdl${pdl}.json > $L/1_bench_cb${cb}_pdl${pdl}.log 2>&1
  t "bench cmdbuf=$cb pdl=$pdl rc=$?"; grep "m=" $L/1_bench_cb${cb}_pdl${pdl}.log | cut -c1-110
done; done
unset XLA_FLAGS
tar -czf $OUT/1_logs.tar.gz -C $L .

# ---- session 14 call 2: FC2 predecode + plan rules (FC1 splits while CTAs < SMs; >= 8 k16 tiles per warp)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 80 --out $OUT/2_moe_validate.json > $L/2_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/2_moe_validate.log | tail -1 | cut -c1-900; grep -i "error\|FAIL" $L/2_moe_validate.log | head -8 | cut -c1-400
timeout 150 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 110 --out $OUT/2_bench_moe.json > $L/2_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/2_bench_moe.log | grep "m=" | cut -c1-200
python3 scripts/gpu_moe_plan_sweep.py --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,8 --budget-s 150 --overrides 'fc2=2,4,1,4,0|fc2=2,8,1,2,0|fc2=2,8,1,2,1|fc1=2,8,1,4;fc2=2,8,1,2,0|fc1=2,8,2,4;fc2=2,8,1,4,0|fc1=2,8,2,4' --out $OUT/2_ablation.json > $L/2_ablation.log 2>&1
t "ablation rc=$?"; grep -v -i warn $L/2_ablation.log | cut -c1-160
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/2_e2e_moe_mcg.json > $L/2_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -3 $L/2_e2e_moe_mcg.log
cd $ROOT
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/2_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/2_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/2_memcheck_moe_summary.txt
t "memcheck done"
tar -czf $OUT/2_logs.tar.gz -C $L .

# ---- session 14 call 3: predecode reverted; plan rules kept (FC1 splits while CTAs < SMs; >= 8 k16 tiles per warp)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 80 --out $OUT/3_moe_validate.json > $L/3_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/3_moe_validate.log | tail -1 | cut -c1-900; grep -i "error\|FAIL" $L/3_moe_validate.log | head -8 | cut -c1-400
timeout 200 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4,glm-4.5-air --m 1,2,4,8,16,32 --budget-s 170 --out $OUT/3_bench_moe.json > $L/3_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/3_bench_moe.log | grep "m=" | cut -c1-200
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/3_e2e_moe_mcg.json > $L/3_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -3 $L/3_e2e_moe_mcg.log
cd $ROOT
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/3_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/3_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/3_memcheck_moe_summary.txt
t "memcheck done"
timeout 100 ncu --clock-control none -k regex:"grouped_mma" --launch-count 1 --section WarpStateStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio python3 scripts/gpu_moe_plan_sweep.py --once qwen3-30b-a3b --m 1 > $OUT/3_ncu_fc1_stalls.txt 2>&1
t "ncu rc=$?"; grep -E "stalled|Warp Cycles" $OUT/3_ncu_fc1_stalls.txt | sort -k3 -n -r | head -12 | cut -c1-120
tar -czf $OUT/3_logs.tar.gz -C $L .

# ---- call 4: controlled A/B of the FC2 shape, Qwen3 m = 1, 2, 4
timeout 200 python3 scripts/gpu_moe_plan_sweep.py --geometries qwen3-30b-a3b --m 1,2,4 --budget-s 150 --overrides 'fc2=2,8,1,2|fc2=2,4,1,4' --out $OUT/4_ab_qwen3_fc2.json

# ---- call 5: dense Trellis GEMM validation (issue #5), after the loader split of session 13
timeout 220 python3 scripts/gpu_validate.py --quick --no-bench --group --budget-s 170 --out $OUT/5_validate_dense.json
