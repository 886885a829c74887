# Call 64 (~7 min, an H100 / H200; session 33): the route-packing kernel (ffi/route_pack.py, one
# CTA; auto keeps XLA's counting sort until this call: moe_plans.PACK_KERNEL).
# (1) compute-sanitizer memcheck of the kernel and of a layer packed by it (gpu_validate_moe's
# memcheck with EXL3_JAX_MOE_PACK=kernel). (2) call64_pack_kernel.py: tables equal to XLA's at
# m 8..4096 on E 128 / 256 / 1000 with invalid ids; the packing alone and the Qwen3 layer with
# its packing, kernel vs XLA. (3) gpu_validate_moe accuracy / edge / tiers with the kernel.
# (4) e2e Qwen3-30B-A3B b1 / b8 decode and 512-token prefill, kernel vs XLA.
# Predictions: (2) the kernel 3-6 us at m <= 512 (XLA 14-23 us), 5-10 us at 4096 (XLA 19); the
# layer -8 to -15 us at m = 8..1024; (4) b8 decode +3-6% (48 layers x ~10 us of ~8.2 ms), b1
# unchanged (per-route packing), prefill +1%. If (1)-(3) hold and (2) wins: PACK_KERNEL = True.
# Ran in session 34 (H200; steps 2-4 cut by their limits): the default became the kernel up to
# 4096 routes (moe_plans.PACK_KERNEL_MAX_ROUTES), XLA above. Since then call 63 times that
# default and no longer reads the /tmp/pack_choice this call writes (kept: it is what ran).
CALL=call64
EXL3_JAX_MOE_PACK=kernel XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/gpu_validate_moe.py --memcheck > $RES/64_memcheck.log 2>&1
t "memcheck rc=$?"; grep -E "memcheck run|ERROR SUMMARY" $RES/64_memcheck.log | head -10; save
timeout 200 python3 scripts/gpu_calls/call64_pack_kernel.py > $RES/64_pack.log 2>&1
t "pack kernel rc=$?"; grep '^{' $RES/64_pack.log | cut -c1-260; save
EXL3_JAX_MOE_PACK=kernel timeout 120 python3 scripts/gpu_validate_moe.py --quick --no-bench --sections accuracy,edge,tiers --budget-s 100 --out $RES/64_validate.json > $RES/64_validate.log 2>&1
t "validate rc=$?"; grep -E 'SUMMARY' $RES/64_validate.log | cut -c1-250; save
# The choice call 63 (fired right after, same machine) times with: the kernel if its memcheck
# was clean, its tables equal, the validation passed and it won every layer row.
python3 - <<'PY' > /tmp/pack_choice 2>/dev/null || echo xla > /tmp/pack_choice
import json, re, statistics as st
mc = open("/tmp/res/64_memcheck.log").read()
ok = "ERROR SUMMARY" in mc and not re.search(r"ERROR SUMMARY: [1-9]", mc)
rows = [json.loads(l) for l in open("/tmp/res/64_pack.log") if l.startswith("{")]
ok &= all(r["equal"] for r in rows if r["check"] == "tables") and bool(rows)
ok &= all(st.median(r["layer_kernel_us"]) < st.median(r["layer_xla_us"])
          for r in rows if "layer_kernel_us" in r)
ok &= "ok = True" in open("/tmp/res/64_validate.log").read()
print("kernel" if ok else "xla")
PY
t "pack choice for call 63: $(cat /tmp/pack_choice)"
for P in kernel xla; do
  (cd scripts && EXL3_JAX_MOE_PACK=$P timeout 100 python3 gpu_e2e_decode.py --cases moe:1:512,moe:8:512 --codebook mcg --repeats 3 --budget-s 85 --hard-limit-s 95 --out $RES/64_e2e_$P.json > $RES/64_e2e_$P.log 2>&1)
  t "e2e $P rc=$?"; grep -E "^moe" $RES/64_e2e_$P.log | cut -c1-200 | head -3; save
done
t done
