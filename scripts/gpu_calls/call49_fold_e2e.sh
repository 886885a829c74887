# Call 49 (~3 min, any H100 / H200): the prefill plan's new fold rule (plans.prefill_folds,
# session 30) end to end. At a 512-token prompt every Llama-3-8B-geometry linear (<= 58.7 M
# weights) now folds (EXL3_JAX_PREFILL_FOLD=1 is the new rule there, 0 the old m >= 2048 one).
# Prediction: prefill tokens/s +8 to +15% (the linears' A/B: -5 to -13% at m = 512), decode
# unchanged.
CALL=call49
for f in 0 1; do
  (cd scripts && EXL3_JAX_PREFILL_FOLD=$f timeout 100 python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mcg --repeats 3 --budget-s 80 --hard-limit-s 95 --out $RES/49_e2e_fold$f.json > $RES/49_e2e_fold$f.log 2>&1)
  t "e2e fold=$f rc=$?"; grep -E "^dense" $RES/49_e2e_fold$f.log | cut -c1-120; save
done
(cd scripts && timeout 100 python3 gpu_e2e_decode.py --cases dense:1:512 --codebook mcg --repeats 3 --budget-s 80 --hard-limit-s 95 --out $RES/49_e2e_auto.json > $RES/49_e2e_auto.log 2>&1)
t "e2e auto rc=$?"; grep -E "^dense" $RES/49_e2e_auto.log | cut -c1-120; save
t done
