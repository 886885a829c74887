# session 16: the GPU calls, in order (each preceded by pre.sh; calls 1, 2, 4 timed experiments whose code is not on main: see README)
# ---- pre.sh
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

# ---- session 16 call 1: one-token activation layout (dense m=1), row-linear rotation skip, ncu
export EXL3_JAX_ROW_LINEAR=0
python3 scripts/gpu_validate.py --quick --group --no-bench --sections gemm,group,dispatch --m 1,2,8,33 --budget-s 200 --out $OUT/1_validate_token.json > $L/1_val.log 2>&1
t "validate token rc=$?"; grep SUMMARY $L/1_val.log | cut -c1-300; grep -i "FAIL\|Traceback" $L/1_val.log | head -5 | cut -c1-300
unset EXL3_JAX_ROW_LINEAR
python3 scripts/gpu_validate.py --quick --no-bench --sections row_linear --budget-s 90 --out $OUT/1_validate_row.json > $L/1_row.log 2>&1
t "validate row rc=$?"; grep SUMMARY $L/1_row.log | cut -c1-300; grep -i "FAIL\|Traceback" $L/1_row.log | head -5 | cut -c1-300
python3 scripts/gpu_linear_ab.py --env EXL3_JAX_ONE_TOKEN --values '0|1|0|1' --env2 EXL3_JAX_ROW_LINEAR=0 --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/1_ab_token.json > $L/1_ab_token.log 2>&1
t "ab token rc=$?"; grep '^{' $L/1_ab_token.log | cut -c1-200; grep -i "Traceback" -A3 $L/1_ab_token.log | head
python3 scripts/gpu_linear_ab.py --env EXL3_JAX_ROW_LINEAR --values '0|all|0|all' --shapes 8192x28672,14336x4096 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/1_ab_row.json > $L/1_ab_row.log 2>&1
t "ab row rc=$?"; grep '^{' $L/1_ab_row.log | cut -c1-200; grep -i "Traceback" -A3 $L/1_ab_row.log | head
for v in 0 1; do
EXL3_JAX_ONE_TOKEN=$v timeout 100 ncu --clock-control none -k regex:"trellis_mma" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio python3 scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 4 --codebook mcg --m 1 --calls 3 > $OUT/1_ncu_token$v.txt 2>&1
t "ncu token=$v rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|DRAM Throughput|Warp Cycles Per Issued" $OUT/1_ncu_token$v.txt | cut -c1-120 | head -20; grep -E "stalled" $OUT/1_ncu_token$v.txt | sort -k3 -n -r | head -8 | cut -c1-120
done
tar -czf $OUT/1_logs.tar.gz -C $L .
t done

# ---- session 16 call 2: dense decode kernel tilings with a software-pipelined k loop (m=1), pipe metrics
export EXL3_JAX_ROW_LINEAR=0
python3 scripts/gpu_linear_ab.py --env EXL3_JAX_DENSE_TILING --values '2,8,8,8,0|2,8,4,4,1|2,8,2,4,1|2,8,4,2,1|2,8,8,4,0|2,8,8,8,0|2,8,4,4,1' --shapes 8192x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/2_ab_tiling_8192.json > $L/2_ab8192.log 2>&1
t "ab 8192 rc=$?"; grep '^{' $L/2_ab8192.log | cut -c1-220; grep -i "Traceback" -A5 $L/2_ab8192.log | head
python3 scripts/gpu_linear_ab.py --env EXL3_JAX_DENSE_TILING --values '2,8,4,8,0|2,8,2,4,1|2,8,4,2,1|2,8,1,4,1|2,8,4,8,0|2,8,2,4,1' --shapes 4096x14336 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/2_ab_tiling_4096.json > $L/2_ab4096.log 2>&1
t "ab 4096 rc=$?"; grep '^{' $L/2_ab4096.log | cut -c1-220; grep -i "Traceback" -A5 $L/2_ab4096.log | head
timeout 100 ncu --clock-control none -k regex:"trellis_mma" --launch-skip 1 --launch-count 1 --metrics regex:"sm__(pipe_.*_cycles_active|inst_executed_pipe_.*).avg.pct_of_peak_sustained_active",sm__cycles_active.avg,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed python3 scripts/gpu_probe_linear.py run --k 8192 --n 28672 --K 4 --codebook mcg --m 1 --calls 3 > $OUT/2_ncu_pipes_mcg.txt 2>&1
t "ncu pipes rc=$?"; grep -E "pipe|inst_executed|cycles_active" $OUT/2_ncu_pipes_mcg.txt | awk '$NF+0 > 0.5' | cut -c1-120 | head -40
tar -czf $OUT/2_logs.tar.gz -C $L .
t done

# ---- session 16 call 3: validation of the one-token layout (row_linear / row_scale sections, memcheck), bench, e2e
python3 scripts/gpu_validate.py --quick --no-bench --sections row_linear,row_scale,decode_exact --budget-s 150 --out $OUT/3_validate.json > $L/3_val.log 2>&1
t "validate rc=$?"; grep SUMMARY $L/3_val.log | cut -c1-400; grep -i "FAIL\|Traceback" $L/3_val.log | head -5 | cut -c1-300
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck decode > $L/3_memcheck.log 2>&1
echo "memcheck decode rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/3_memcheck.log | tr '\n' ' ')" | tee $OUT/3_memcheck_decode_summary.txt
timeout 120 exl3-jax bench linear --shapes 4096x4096,4096x14336,14336x4096,8192x28672,2048x768 --K 3,4 --codebooks mcg,mul1 --m 1 --out $OUT/3_bench_linear_m1.json > $L/3_bench.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $L/3_bench.log | grep -E "decode|bf16" | cut -c1-120
cd scripts
for v in 1 0; do
EXL3_JAX_ONE_TOKEN=$v timeout 150 python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mcg --out $OUT/3_e2e_dense_token$v.json > $L/3_e2e_$v.log 2>&1
t "e2e dense b1 ONE_TOKEN=$v rc=$?"; grep -E "^dense|EXL3" $L/3_e2e_$v.log | cut -c1-200; tail -2 $L/3_e2e_$v.log | cut -c1-250
done
cd $ROOT
tar -czf $OUT/3_logs.tar.gz -C $L .
t done

# ---- session 16 call 4: L2 prefetch of each chunk's weight lines (dense, row linear, MoE), e2e
EXL3_JAX_ROW_LINEAR=0 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PREFETCH --values '1|0|1|0' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/4_ab_prefetch_dense.json > $L/4_ab_dense.log 2>&1
t "ab dense rc=$?"; grep '^{' $L/4_ab_dense.log | cut -c1-200; grep -i "Traceback" -A5 $L/4_ab_dense.log | head
EXL3_JAX_ROW_LINEAR=0 python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PREFETCH --values '1|0|1|0' --shapes 8192x28672 --K 3 --codebooks mcg --m 1,16 --out $OUT/4_ab_prefetch_dense_k3.json > $L/4_ab_dense3.log 2>&1
t "ab dense K3 rc=$?"; grep '^{' $L/4_ab_dense3.log | cut -c1-200
python3 scripts/gpu_linear_ab.py --env EXL3_JAX_PREFETCH --values '1|0|1|0' --shapes 4096x4096,14336x4096 --K 4 --codebooks mcg --m 1 --out $OUT/4_ab_prefetch_row.json > $L/4_ab_row.log 2>&1
t "ab row rc=$?"; grep '^{' $L/4_ab_row.log | cut -c1-200
python3 scripts/gpu_moe_plan_sweep.py --env EXL3_JAX_PREFETCH --overrides '1|0|1|0' --geometries qwen3-30b-a3b,glm-4.5-air --m 1,4 --budget-s 110 --out $OUT/4_ab_prefetch_moe.json > $L/4_ab_moe.log 2>&1
t "ab moe rc=$?"; grep -v -i warn $L/4_ab_moe.log | cut -c1-180 | tail -24
cd scripts
timeout 160 python3 gpu_e2e_decode.py --cases dense:1:512,moe:1:512,moe:8:512 --codebook mcg --out $OUT/4_e2e.json > $L/4_e2e.log 2>&1
t "e2e rc=$?"; grep -E "^dense|^moe" $L/4_e2e.log | cut -c1-200
cd $ROOT
tar -czf $OUT/4_logs.tar.gz -C $L .
t done
