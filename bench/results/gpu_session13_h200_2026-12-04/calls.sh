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

# ---- call 1: one custom call per MoE layer, PDL chain, first weight chunk before the wait
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 70 --out $OUT/1_moe_validate.json > $L/1_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/1_moe_validate.log | tail -1 | cut -c1-700; grep -i "error" $L/1_moe_validate.log | head -5 | cut -c1-400
python3 -c "
import sys, json; sys.path.insert(0, 'scripts')
import gpu_validate_moe as v
r = v.profile_decode(budget_s=25, ms=(1, 8))
json.dump(r, open('$OUT/1_profile_layer.json', 'w'), indent=1)
" > $L/1_profile_layer.log 2>&1
t "profile layer rc=$?"; grep '"m"' $L/1_profile_layer.log | cut -c1-400
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/1_e2e_moe_mcg.json > $L/1_e2e_moe_mcg.log 2>&1
t "e2e moe pdl rc=$?"; tail -3 $L/1_e2e_moe_mcg.log
EXL3_JAX_MOE_PDL=0 python3 gpu_e2e_decode.py --cases moe:1:512 --codebook mcg --out $OUT/1_e2e_moe_mcg_nopdl.json > $L/1_e2e_moe_mcg_nopdl.log 2>&1
t "e2e moe no-pdl rc=$?"; tail -2 $L/1_e2e_moe_mcg_nopdl.log
cd $ROOT
timeout 150 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 110 --out $OUT/1_bench_moe.json > $L/1_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/1_bench_moe.log | grep "m=" | cut -c1-200
EXL3_JAX_MOE_PDL=0 timeout 70 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2 --budget-s 45 --out $OUT/1_bench_moe_nopdl.json > $L/1_bench_moe_nopdl.log 2>&1
t "bench moe no-pdl rc=$?"; grep -v Warning $L/1_bench_moe_nopdl.log | grep "m=" | cut -c1-200
tar -czf $OUT/1_logs.tar.gz -C $L .

# ---- call 2: poison aliasing fixed; grouped GEMM k loop software-pipelined (next chunk's loads before this chunk's decode)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 70 --out $OUT/2_moe_validate.json > $L/2_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/2_moe_validate.log | tail -1 | cut -c1-700; grep -i "error" $L/2_moe_validate.log | head -5 | cut -c1-400
python3 -c "
import sys, json; sys.path.insert(0, 'scripts')
import gpu_validate_moe as v
r = v.profile_decode(budget_s=12, ms=(1, 8))
json.dump(r, open('$OUT/2_profile_layer.json', 'w'), indent=1)
" > $L/2_profile_layer.log 2>&1
t "profile layer rc=$?"; grep '"m"' $L/2_profile_layer.log | cut -c1-400
timeout 150 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 110 --out $OUT/2_bench_moe.json > $L/2_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/2_bench_moe.log | grep "m=" | cut -c1-200
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/2_e2e_moe_mcg.json > $L/2_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -3 $L/2_e2e_moe_mcg.log
cd $ROOT
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/2_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/2_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/2_memcheck_moe_summary.txt
t "memcheck done"
tar -czf $OUT/2_logs.tar.gz -C $L .

# ---- call 3: per-route plans: FC1 rotates its route row itself (no rotate_in launch)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 70 --out $OUT/3_moe_validate.json > $L/3_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/3_moe_validate.log | tail -1 | cut -c1-700; grep -i "error" $L/3_moe_validate.log | head -5 | cut -c1-400
python3 -c "
import sys, json; sys.path.insert(0, 'scripts')
import gpu_validate_moe as v
r = v.profile_decode(budget_s=12, ms=(1, 8))
json.dump(r, open('$OUT/3_profile_layer.json', 'w'), indent=1)
" > $L/3_profile_layer.log 2>&1
t "profile layer rc=$?"; grep '"m"' $L/3_profile_layer.log | cut -c1-400
timeout 150 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 110 --out $OUT/3_bench_moe.json > $L/3_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/3_bench_moe.log | grep "m=" | cut -c1-200
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/3_e2e_moe_mcg.json > $L/3_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -3 $L/3_e2e_moe_mcg.log
cd $ROOT
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/3_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/3_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/3_memcheck_moe_summary.txt
t "memcheck done"
tar -czf $OUT/3_logs.tar.gz -C $L .

# ---- call 4: per-route plans: FC2 computes its route row's activation itself (no activation launch)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 60 --out $OUT/4_moe_validate.json > $L/4_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/4_moe_validate.log | tail -1 | cut -c1-420; grep -i "error" $L/4_moe_validate.log | head -3 | cut -c1-300
timeout 60 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2 --budget-s 40 --out $OUT/4_bench_moe.json > $L/4_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/4_bench_moe.log | grep "m=" | cut -c1-200
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/4_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/4_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/4_memcheck_moe_summary.txt
tar -czf $OUT/4_logs.tar.gz -C $L .
(cd scripts && timeout 70 python3 gpu_e2e_decode.py --cases moe:1:512 --codebook mcg --out $OUT/4_e2e_moe_mcg.json > $L/4_e2e_moe_mcg.log 2>&1; echo "e2e rc=$?"; tail -2 $L/4_e2e_moe_mcg.log)
t done
