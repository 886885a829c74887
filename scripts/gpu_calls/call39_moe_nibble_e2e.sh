# Call 39 (~7 min, on an H200 if one starts): (1) the two-pipe K4 extraction in the MoE kernels
# (MmaTiling.nibble_extraction, session 28) against the session-27 tree (.device/s27.tar.xz:
# `git archive f42c551 pyproject.toml README.md exl3_jax ffi models scripts | xz`), alternated
# three times, `bench moe` Qwen3-30B-A3B m 1 / 4: call 37 had it -3.6 / -4% in one pair of runs,
# while call 38 on another H100 put m = 1 at 25.8 us (the between-machine spread is ~2 us);
# keep it only if the three pairs agree. (2) End to end with session 28's defaults: the
# Llama-3-8B geometry at 4 bpw mcg, batch 1 and 8 (issue #5 item 8: >= 1.8x bf16 at batch 1),
# the Qwen3-30B-A3B geometry at batch 1 (issue #6 item 8: >= 250 tok/s).
CALL=${CALL:-call39}
for tr in s27 here s27 here s27 here; do
  tree $tr
  timeout 45 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,4 --out $RES/39_moe_now.json > $RES/39_moe_now.log 2>&1
  t "bench moe tree $tr rc=$?"; grep -v -i warn $RES/39_moe_now.log | tail -2 | cut -c1-100
  python3 -c "import json,sys; r=json.load(open('$RES/39_moe_now.json')); r['tree']='$tr'; print(json.dumps(r))" >> $RES/39_moe.jsonl 2>/dev/null; save
done
tree here
(cd scripts && timeout 170 python3 gpu_e2e_decode.py --cases dense:1:512,dense:8:64,moe:1:512 --codebook mcg --repeats 3 --budget-s 150 --hard-limit-s 160 --out $RES/39_e2e.json > $RES/39_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "tok/s" $RES/39_e2e.log | cut -c1-200 | head -8; save
t done
