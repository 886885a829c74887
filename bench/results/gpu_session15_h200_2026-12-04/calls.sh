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

# ---- session 15 call 1: activation / combine in the GEMMs' tails (per-route plans)
python3 scripts/gpu_validate_moe.py --quick --no-bench --budget-s 95 --out $OUT/1_moe_validate.json > $L/1_moe_validate.log 2>&1
t "moe validate rc=$?"; grep SUMMARY $L/1_moe_validate.log | tail -1 | cut -c1-900; grep -i "error\|FAIL\|Traceback" $L/1_moe_validate.log | head -8 | cut -c1-400; grep '"bitwise_equal_to_kernels"' $L/1_moe_validate.log | cut -c1-330
python3 scripts/gpu_moe_plan_sweep.py --env EXL3_JAX_MOE_TAILS --overrides '0|1|0|1' --geometries qwen3-30b-a3b,glm-5.2-tp4,glm-4.5-air --m 1,2,4 --budget-s 170 --out $OUT/1_tails_ab.json > $L/1_tails_ab.log 2>&1
t "tails A/B rc=$?"; grep -v -i warn $L/1_tails_ab.log | cut -c1-160
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $L/1_memcheck_moe.log 2>&1
echo "memcheck moe rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/1_memcheck_moe.log | tr '\n' ' ')" | tee $OUT/1_memcheck_moe_summary.txt
timeout 130 exl3-jax bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8 --budget-s 110 --out $OUT/1_bench_moe.json > $L/1_bench_moe.log 2>&1
t "bench moe rc=$?"; grep -v Warning $L/1_bench_moe.log | grep "m=" | cut -c1-220
tar -czf $OUT/1_logs.tar.gz -C $L .
t done

# ---- session 15 call 2: the row linear (one token: rotate-in decode kernel + chained output transform, one custom call)
python3 scripts/gpu_validate.py --quick --group --no-bench --budget-s 150 --out $OUT/2_validate_dense.json > $L/2_validate_dense.log 2>&1
t "dense validate rc=$?"; grep SUMMARY $L/2_validate_dense.log | cut -c1-600; grep -i "FAIL\|Traceback\|Error" $L/2_validate_dense.log | head -8 | cut -c1-400; grep "\[row_linear\]" $L/2_validate_dense.log | cut -c1-420
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck row > $L/2_memcheck_row.log 2>&1
echo "memcheck row rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/2_memcheck_row.log | tr '\n' ' ')" | tee $OUT/2_memcheck_row_summary.txt
for r in a1 b0 c1; do v=${r:1:1}
  EXL3_JAX_ROW_LINEAR=$v timeout 100 exl3-jax bench linear --shapes 4096x4096,4096x14336,14336x4096,8192x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/2_bench_linear_$r.json > $L/2_bench_linear_$r.log 2>&1
  t "bench linear ROW_LINEAR=$v ($r) rc=$?"; grep -v -i warn $L/2_bench_linear_$r.log | tail -9 | cut -c1-170
done
tar -czf $OUT/2_logs.tar.gz -C $L .
t done

# ---- session 15 call 3: the row linear, 128-column CTAs (warps 4 over n x 2 over k)
python3 scripts/gpu_validate.py --quick --group --no-bench --budget-s 120 --out $OUT/3_validate_dense.json > $L/3_validate_dense.log 2>&1
t "dense validate rc=$?"; grep SUMMARY $L/3_validate_dense.log | cut -c1-300; grep -i "FAIL\|Traceback" $L/3_validate_dense.log | head -8 | cut -c1-400; grep "\[row_linear\]" $L/3_validate_dense.log | cut -c1-330
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate.py --memcheck row > $L/3_memcheck_row.log 2>&1
echo "memcheck row rc=$? $(grep -E 'ERROR SUMMARY|memcheck run' $L/3_memcheck_row.log | tr '\n' ' ')" | tee $OUT/3_memcheck_row_summary.txt
for r in a1 b0; do v=${r:1:1}
  EXL3_JAX_ROW_LINEAR=$v timeout 100 exl3-jax bench linear --shapes 4096x4096,4096x14336,14336x4096,8192x28672 --K 4 --codebooks mcg,mul1 --m 1 --out $OUT/3_bench_linear_$r.json > $L/3_bench_linear_$r.log 2>&1
  t "bench linear ROW_LINEAR=$v ($r) rc=$?"; grep -v -i warn $L/3_bench_linear_$r.log | grep decode | cut -c1-120
done
cd scripts
for r in a1 b0; do v=${r:1:1}
  EXL3_JAX_ROW_LINEAR=$v timeout 150 python3 gpu_e2e_decode.py --cases dense:1:512$([ $v = 1 ] && echo ,dense_bf16:1:512) --codebook mcg --out $OUT/3_e2e_dense_$r.json > $L/3_e2e_dense_$r.log 2>&1
  t "e2e dense b1 ROW_LINEAR=$v rc=$?"; tail -3 $L/3_e2e_dense_$r.log | cut -c1-250
done
cd $ROOT
tar -czf $OUT/3_logs.tar.gz -C $L .
t done

# ---- session 15 call 4: row-linear K-splits chosen for a full last wave (8192x28672: 32 splits, 7168 CTAs)
python3 - > $L/4_row_check.log 2>&1 <<'PY'
import json, sys
sys.path.insert(0, "scripts")
import gpu_validate as v
for cb, K, k, n, mem in (("mcg", 4, 8192, 28672, None), ("mul1", 4, 4096, 14336, None), ("mcg", 3, 4096, 2048, None), ("mcg", 4, 2048, 5120, (4096, 512, 512))):
    print(json.dumps(v.check_row_linear(cb, K, k, n, mem)), flush=True)
PY
t "row check rc=$?"; cut -c1-330 $L/4_row_check.log | grep -v -i warn; cp $L/4_row_check.log $OUT/
EXL3_JAX_ROW_LINEAR=1 timeout 100 exl3-jax bench linear --shapes 4096x4096,4096x14336,14336x4096,8192x28672 --K 3,4 --codebooks mcg,mul1 --m 1 --out $OUT/4_bench_linear_row.json > $L/4_bench_linear_row.log 2>&1
t "bench linear rc=$?"; grep -v -i warn $L/4_bench_linear_row.log | grep -E "decode|bf16" | cut -c1-120
cd scripts
timeout 150 python3 gpu_e2e_decode.py --cases dense:1:512,moe:1:512 --codebook mcg --out $OUT/4_e2e_row.json > $L/4_e2e_row.log 2>&1
t "e2e rc=$?"; grep -E "^dense|^moe|EXL3" $L/4_e2e_row.log | cut -c1-200
cd $ROOT
tar -czf $OUT/4_logs.tar.gz -C $L .
t done

# ---- session 15 call 5: the row linear only up to 2^26 weights (Llama-3-8B gate/up and 8192x28672 keep three calls)
cd scripts
timeout 150 python3 gpu_e2e_decode.py --cases dense:1:512,moe:1:512 --codebook mcg --out $OUT/5_e2e_row_gated.json > $L/5_e2e.log 2>&1
t "e2e rc=$?"; grep -E "^dense|^moe" $L/5_e2e.log | cut -c1-200; cp $L/5_e2e.log $OUT/

