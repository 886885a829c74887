# Ran in session 38 (an H100): the patch was kept and is in main's ffi/hadamard.py (so the
# patch file is gone and this script is a record, not a rerunnable step).
# Call 71 (~5 min, an H100 / H200; queued in session 37, whose device time ran out in refused
# starts): the output transform with 16-byte loads and stores (scripts/gpu_calls/
# had_out_16byte.patch: one LDG.128 per partial, one 8-byte load per svh / bias table, one
# STG.128, for 4 scalar accesses each; 136 SASS instructions for 144; emulated outputs bit-equal
# to main's, multi-member groups, biases and K-splits included) against main, alternating
# processes, `bench linear` 8192x28672 and 4096x14336 K4 mcg at m = 1 and 1024 with the fold off
# (EXL3_JAX_PREFILL_FOLD=0, so both shapes run the transforms at 1024).
# Predictions: m = 1024 -20 to -40 us at 8192x28672 (814 -> 775-795 on the H200: call 70 timed
# the output transform alone at 152 us, ~55 of them the loop's own pass over its partials),
# -5 to -15 us at 4096x14336; m = 1 within +-2% (one wave of blocks, latency-bound). Keep the
# patch (apply it to main) if m = 1024 gains >= 2% on 8192x28672 and m = 1 loses nothing
# beyond the spread of the two main runs.
CALL=call71
I=0
for T in here out16 here out16; do
  I=$((I + 1))
  if [ $T = here ]; then tree here; else tree_patched out16 scripts/gpu_calls/had_out_16byte.patch; fi
  EXL3_JAX_PREFILL_FOLD=0 timeout 90 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 1,1024 --out $RES/71_ab_${I}_$T.json > $RES/71_ab_${I}_$T.log 2>&1
  t "bench $I $T rc=$?"; grep -v -i warn $RES/71_ab_${I}_$T.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -8; save
done
tree here
t done
