# Call 37 (~5 min): call 36 left K4's two-pipe extraction (LaneGeometry.nibble_plan) within one
# run's spread (mcg K4 8192x28672 m = 1 65.35 -> 64.14 us, m = 16 87.79 -> 91.04): the session-27
# tree and this one alternated twice at m = 1 and 16, then the Qwen3-30B-A3B MoE layer (mcg K4,
# whose FC1 / FC2 decode through the same extraction) at m = 1 and 4 in both trees.
# Prediction: m = 1 -1 to -4%, m = 16 within +-2% (the 3-group split kernel's registers went 80 ->
# see SASS), the MoE m = 1 -1 to -3%.
CALL=call37
for tr in s27 here s27 here; do
  tree $tr
  EXL3_JAX_PLAN=decode timeout 60 python3 $ROOT/scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_ONE_TOKEN --values '1' --shapes 8192x28672,4096x14336 --K 4 --codebooks mcg --m 1,16 --out $RES/37_mcg.json > $RES/37_mcg_now.log 2>&1
  t "mcg K4 tree $tr rc=$?"; ab_rows $RES/37_mcg_now.log EXL3_JAX_ONE_TOKEN
  cat $RES/37_mcg_now.log >> $RES/37_mcg.log; rm $RES/37_mcg_now.log; save
done
for tr in s27 here; do
  tree $tr
  timeout 80 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,4 --out $RES/37_moe_$tr.json > $RES/37_moe_$tr.log 2>&1
  t "bench moe tree $tr rc=$?"; grep -v -i warn $RES/37_moe_$tr.log | tail -4 | cut -c1-160; save
done
tree here
t done
