# Call 97 (session 42, ~3 min, any card; after call 96, on the same warm machine): where the
# Qwen3-30B-A3B m = 1 layer's kernels stand with call 96's cuts. ncu's duration of each kernel
# (launches serialised, caches flushed: call 66's method) in tree s42 (4bd7dc8) and this tree.
# Session 35 (call 66, H100): FC1 12.0-13.1 us, activation 4.1-4.4, FC2 7.2-7.4, combine 3.1-3.3.
# Prediction: FC1 -0.2 to -0.6 us (the selects of its rotate-in); the activation -0.3 to -1.5
# (8 CTAs instead of 64, each with fewer instructions; under ncu each launch runs alone, so
# its 56 padding CTAs cost only their share of the SMs' issue and the tail); FC2 unchanged
# (+-0.3); the combine -0.1 to -0.4 (its selects).
CALL=call97
for tr in s42 here; do
  tree $tr
  timeout 80 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum -k regex:"grouped_mma|activation|combine" --launch-skip 16 --launch-count 12 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1 --no-baseline > $RES/97_ncu_${tr}.log 2>&1
  t "ncu $tr rc=$?"; grep gpu__time_duration $RES/97_ncu_${tr}.log | awk -F'","' '{print $(NF), $(NF-1), substr($5,1,40)}' | head -12; save
done
tree here
t done
