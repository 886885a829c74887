# Call 66 (~9 min, an H100 / H200; session 35): calls 65 and 63 cut to one call, since starts
# are scarce (session 35: four refused, ~740 s of the 1800). (1) Call 65's step 1: the packing
# kernel against XLA's counting sort at m 1024 / 2048 / 4096 (8192-32768 routes at top-8:
# tables, packing times; the Qwen3 layer at 1024), which decides
# moe_plans.PACK_KERNEL_MAX_ROUTES. (2) Call 63's steps 1-2: `bench moe` on the three
# geometries at m 1..128 with the ragged baseline and at 1024 / 4096 without, all under main's
# default packing (the first full table since the packing entered the timing loop, session 33).
# (3) ncu's duration of each kernel of the Qwen3 m = 1 layer (ncu serialises the launches, so
# no PDL overlap): the last per-kernel rows are session 13's.
# Predictions: (1) the kernel ~28 / ~50 / ~95 us at 8192 / 16384 / 32768 routes against XLA's
# 15-25: the limit stays 4096 (if the kernel wins at 8192, raise it to the last size it wins);
# (2) Qwen3 m = 1..4 within +-5% of call 52 (24.7 / 37.7 / 58.6 us), m = 8..128 +0-10 us over
# session 32's rows (packing now timed, in the kernel), every row faster than the baseline;
# m = 1024 / 4096 +15-25 us over call 57 (806 / 1995); (3) FC1 7-9 us, FC2 4-6, activation and
# combine 1.5-3 each.
CALL=call66
timeout 150 python3 scripts/gpu_calls/call64_pack_kernel.py --m 1024,2048,4096 --layer-m 1024 > $RES/66_pack.log 2>&1
t "pack kernel rc=$?"; grep '^{' $RES/66_pack.log | cut -c1-260; save
timeout 200 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1,2,4,8,16,32,128 --out $RES/66_moe.json > $RES/66_moe.log 2>&1
t "bench moe rc=$?"; grep -v -i warn $RES/66_moe.log | grep " us " | cut -c1-150; save
timeout 120 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-4.5-air,glm-5.2-tp4 --m 1024,4096 --no-baseline --out $RES/66_moe_prefill.json > $RES/66_moe_prefill.log 2>&1
t "bench moe prefill rc=$?"; grep -v -i warn $RES/66_moe_prefill.log | grep " us " | cut -c1-150; save
timeout 70 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum -k regex:"grouped_mma|activation|combine" --launch-skip 16 --launch-count 12 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1 --no-baseline > $RES/66_ncu_m1.log 2>&1
t "ncu m=1 rc=$?"; grep gpu__time_duration $RES/66_ncu_m1.log | awk -F'","' '{print $(NF), $(NF-1), substr($5,1,40)}' | head -12; save
t done
