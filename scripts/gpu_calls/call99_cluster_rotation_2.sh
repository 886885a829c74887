# Call 99 (session 43, ~6 min, same machine after call 98): call 98's A/B a second time in
# reverse order (here, cuts, s42), then ncu's duration of the Qwen3 m = 1 layer's kernels
# (launches serialised: call 97's method) with and without the clusters. Session 35 (H100):
# FC1 12.0-13.1 us, activation 4.1-4.4, FC2 7.2-7.4, combine 3.1-3.3. Prediction: FC1 with
# clusters -0.5 to -1.5 us against EXL3_JAX_MOE_CLUSTER=1; the other kernels unchanged.
CALL=call99
moe_cluster_ab 99_r2 here cuts s42
for tr in cuts here; do
  tree here
  if [ $tr = cuts ]; then export EXL3_JAX_MOE_CLUSTER=1; else export EXL3_JAX_MOE_CLUSTER=auto; fi
  timeout 80 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum -k regex:"grouped_mma|activation|combine" --launch-skip 16 --launch-count 12 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1 --no-baseline > $RES/99_ncu_${tr}.log 2>&1
  t "ncu $tr rc=$?"; grep gpu__time_duration $RES/99_ncu_${tr}.log | awk -F'","' '{print $(NF), $(NF-1), substr($5,1,40)}' | head -12; save
done
unset EXL3_JAX_MOE_CLUSTER; tree here
t done
