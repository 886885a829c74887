#!/usr/bin/env bash
# session 12 on the H200: every call ran the preamble first (repository root, OUT = the returned folder)
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

# ---- call 1: combine with one warp per route slot: MoE validation, e2e Qwen3 b1/b8, profile with HLO scopes
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 70 --out $OUT/1_moe_validate.json > $L/1_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/1_moe_validate.log | tail -1 | cut -c1-700; grep -i "combine_us" $L/1_moe_validate.log | head -5 | cut -c1-300
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/1_e2e_moe_mcg.json > $L/1_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -4 $L/1_e2e_moe_mcg.log
python3 gpu_profile_decode.py --models moe --hlo --out $OUT/1_profile_moe_mcg.json > $L/1_profile_moe.log 2>&1
t "profile moe rc=$?"; tail -45 $L/1_profile_moe.log | cut -c1-250
cd $ROOT; tar -czf $OUT/1_logs.tar.gz -C $L .

# ---- call 2: router as a bf16 GEMM with fp32 accumulation (+ combine): e2e Qwen3 b1/b8, profile
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/2_e2e_moe_mcg.json > $L/2_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -4 $L/2_e2e_moe_mcg.log
python3 gpu_profile_decode.py --models moe --hlo --out $OUT/2_profile_moe_mcg.json > $L/2_profile_moe.log 2>&1
t "profile moe rc=$?"; python3 -c "
import json; d=json.load(open('$OUT/2_profile_moe_mcg.json'))['models'][0]
print({k: d[k] for k in ('kernel_us_per_step','idle_us_per_step')}, d['kernel_us_per_step_by_category'])
for k, v in list(d['top_kernels_us_per_step'].items())[:24]: print(round(v,1), k[:90], d.get('top_kernels_scopes',{}).get(k,{}).get('scopes','')[:3])
"
cd $ROOT; tar -czf $OUT/2_logs.tar.gz -C $L .

# ---- call 3: router variants
cd scripts && python3 gpu_router_probe.py --out $OUT/3_router_probe.json

# ---- call 4: Router [E, H] bf16: e2e Qwen3 b1/b8; MoE memcheck (new combine); bench moe m <= 8
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/4_e2e_moe_mcg.json > $L/4_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -4 $L/4_e2e_moe_mcg.log
cd $ROOT
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/4_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/4_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/4_memcheck_moe_summary.txt
t "memcheck done"
exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 130 --out $OUT/4_bench_moe.json > $L/4_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/4_bench_moe.log | tail -16 | cut -c1-200
tar -czf $OUT/4_logs.tar.gz -C $L .

# ---- call 5: tiers in one set of launches: MoE validation (all sections), memcheck incl. tiers, mixed-K model test, e2e Qwen3 b1
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 80 --out $OUT/5_moe_validate.json > $L/5_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/5_moe_validate.log | tail -1 | cut -c1-500; grep -A3 '== tiers' $L/5_moe_validate.log | cut -c1-300
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/5_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/5_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/5_memcheck_moe_summary.txt
t "memcheck done"
(python3 -m pytest --version >/dev/null 2>&1 && EXL3_JAX_SKIP_DEFAULT_MODEL=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_mixed_k.py -k gpu > $L/5_mixed_k_gpu.log 2>&1; echo "mixed-k gpu test rc=$?"; tail -3 $L/5_mixed_k_gpu.log) | tee $OUT/5_mixed_k_gpu.txt
t "mixed-k test done"
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512 --codebook mcg --out $OUT/5_e2e_moe_mcg.json > $L/5_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -3 $L/5_e2e_moe_mcg.log
cd $ROOT; tar -czf $OUT/5_logs.tar.gz -C $L .

# ---- call 6: attention softmax variants with a runtime mask
cd scripts && python3 gpu_attention_probe.py --mask-variants --out $OUT/6_attention_mask_probe.json

# ---- call 7: per-route plans derive rows in the kernels: MoE validation, memcheck, e2e Qwen3 b1, bench moe qwen3 m=1,2
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 60 --out $OUT/7_moe_validate.json > $L/7_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/7_moe_validate.log | tail -1 | cut -c1-420
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/7_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/7_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/7_memcheck_moe_summary.txt
t "memcheck done"
(cd scripts && python3 gpu_e2e_decode.py --cases moe:1:512 --codebook mcg --out $OUT/7_e2e_moe_mcg.json > $L/7_e2e_moe_mcg.log 2>&1; echo "e2e rc=$?"; tail -2 $L/7_e2e_moe_mcg.log)
t "e2e done"
timeout 60 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2 --budget-s 40 --out $OUT/7_bench_moe.json > $L/7_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/7_bench_moe.log | grep "m=" | cut -c1-200
tar -czf $OUT/7_logs.tar.gz -C $L .
