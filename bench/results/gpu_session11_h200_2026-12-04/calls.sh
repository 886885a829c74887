#!/usr/bin/env bash
# session 11 on the H200: the preamble every call ran first (repository root, OUT = the returned folder)
set -u
mkdir -p /tmp/site && tar -xJf .device/cutlass_dsl_cp312_cu13.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
L=/tmp/logs; mkdir -p $L     # calls 2-5 kept their logs here (tarred at the end)
t start

# ---- call 1: validation (MoE row scale, Hadamard loads), memcheck, attention probe, e2e
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 60 --out $OUT/1_moe_validate.json > $OUT/1_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $OUT/1_moe_validate.log | tail -1
python3 scripts/gpu_validate.py --quick --no-bench --group --budget-s 80 --out $OUT/1_validate.json > $OUT/1_validate.log 2>&1
t "validate rc=$?"; tail -3 $OUT/1_validate.log
python3 scripts/gpu_attention_probe.py --out $OUT/1_attention_probe.json > $OUT/1_attention_probe.log 2>&1
t "attention probe rc=$?"; cat $OUT/1_attention_probe.log | grep '^{' | python3 -c "import sys,json; [print(r['model'],r['B'],r['S'],r['variant'],r.get('us'),r.get('rel_max_err'),r.get('error','')[:100]) for r in map(json.loads,sys.stdin)]"
cd scripts
python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mul1 --out $OUT/1_e2e_dense_mul1.json > $OUT/1_e2e_dense_mul1.log 2>&1
t "e2e dense mul1 rc=$?"; tail -3 $OUT/1_e2e_dense_mul1.log
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/1_e2e_moe_mcg.json > $OUT/1_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -4 $OUT/1_e2e_moe_mcg.log

# ---- call 2: validation (MoE incl. overflow, GEMM/decode/group), memcheck (strong flags)
(
for kind in decode prefill group; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck $kind > $L/2_memcheck_$kind.log 2>&1
  echo "memcheck $kind rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/2_memcheck_$kind.log | tr '\n' ' ')" >> $OUT/2_memcheck_summary.txt
done
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/2_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/2_memcheck_moe.log | tr '\n' ' ')" >> $OUT/2_memcheck_summary.txt
) &
MC=$!
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 90 --out $OUT/2_moe_validate.json > $L/2_moe_validate.log 2>&1
t "moe validate rc=$?"; grep -A6 "== overflow" $L/2_moe_validate.log | cut -c1-300; grep SUMMARY $L/2_moe_validate.log | tail -1
python3 scripts/gpu_validate.py --quick --no-bench --group --budget-s 100 --out $OUT/2_validate.json > $L/2_validate.log 2>&1
t "validate rc=$?"; grep SUMMARY $L/2_validate.log | cut -c1-400
wait $MC
t "memcheck done"; cat $OUT/2_memcheck_summary.txt
tar -czf $OUT/2_logs.tar.gz -C $L .

# ---- call 3: MoE memcheck (CPU reference), e2e Llama mcg b1/b8, decode-step profiles
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/3_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/3_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/3_memcheck_moe_summary.txt
t "memcheck done"
cd scripts
python3 gpu_e2e_decode.py --cases dense:1:512,dense:8:64 --codebook mcg --out $OUT/3_e2e_dense_mcg.json > $L/3_e2e_dense_mcg.log 2>&1
t "e2e dense mcg rc=$?"; tail -4 $L/3_e2e_dense_mcg.log
python3 gpu_profile_decode.py --models moe --out $OUT/3_profile_moe_mcg.json > $L/3_profile_moe.log 2>&1
t "profile moe rc=$?"; tail -30 $L/3_profile_moe.log
python3 gpu_profile_decode.py --models dense --out $OUT/3_profile_dense_mcg.json > $L/3_profile_dense.log 2>&1
t "profile dense rc=$?"; tail -30 $L/3_profile_dense.log
tar -czf $OUT/3_logs.tar.gz -C $L .

# ---- call 4: combine kernel with batched loads: MoE validation, e2e Qwen3 b1/b8, Llama mul1 b8
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 60 --out $OUT/4_moe_validate.json > $L/4_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/4_moe_validate.log | tail -1 | cut -c1-600
cd scripts
python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:64 --codebook mcg --out $OUT/4_e2e_moe_mcg.json > $L/4_e2e_moe_mcg.log 2>&1
t "e2e moe rc=$?"; tail -4 $L/4_e2e_moe_mcg.log
python3 gpu_e2e_decode.py --cases dense:8:64 --codebook mul1 --out $OUT/4_e2e_dense_mul1_b8.json > $L/4_e2e_dense_mul1_b8.log 2>&1
t "e2e dense mul1 b8 rc=$?"; tail -3 $L/4_e2e_dense_mul1_b8.log
tar -czf $OUT/4_logs.tar.gz -C $L .

# ---- call 5: the bf16 baseline with the new attention; MoE validation incl. geometry
(cd scripts && python3 gpu_e2e_decode.py --cases dense_bf16:1:512,dense_bf16:8:64 --out $OUT/5_e2e_dense_bf16.json > $L/5_e2e_dense_bf16.log 2>&1)
t "e2e bf16 rc=$?"; tail -3 $L/5_e2e_dense_bf16.log
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 150 --out $OUT/5_moe_validate.json > $L/5_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/5_moe_validate.log | tail -1 | cut -c1-700
tar -czf $OUT/5_logs.tar.gz -C $L .
