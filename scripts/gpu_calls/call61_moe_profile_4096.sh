# Call 61 (~1.5 min, an H100 / H200; session 33): call 58's stage profile at m = 4096 alone (call
# 58's profile step ran out of its time before 4096). Its layer times leave out the route
# packing (XLA hoisted it out of the timing loop; the profile includes it from session 33 on).
CALL=call61
timeout 170 python3 scripts/gpu_validate_moe.py --sections profile --profile-m 4096 --profile-s 150 --out $RES/61_profile.json > $RES/61_profile.log 2>&1
t "profile rc=$?"; grep -E '"m":' $RES/61_profile.log | cut -c1-330; save
