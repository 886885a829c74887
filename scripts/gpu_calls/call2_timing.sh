# Call 2 (~9 min): timing of this tree (main since session 19, which merged sessions 16-18)
# against main before session 17 (base, 55c788a), two rounds in separate processes (the spread
# between rounds shows drift); the Qwen3 MoE layer for base and this tree; end-to-end decode
# (this tree). Needs .device/base.tar.xz (make_device_dir.sh).
CALL=call2
for round in 1 2; do
  for name in base here; do bench_linear $name 2_linear_${name}_r$round 120; done
done
for name in base here; do bench_moe $name 2_moe_$name 100; done
tree here
(cd scripts && timeout 230 python3 gpu_e2e_decode.py --cases dense:1:512,moe:1:512,moe:8:64 --codebook mcg --budget-s 200 --hard-limit-s 225 --out $RES/2_e2e.json > $RES/2_e2e.log 2>&1)
t "e2e rc=$?"; grep -E "^dense|^moe|tok/s" $RES/2_e2e.log | cut -c1-200 | head -12; save
t done
