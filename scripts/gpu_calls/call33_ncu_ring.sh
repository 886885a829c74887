# Call 33 (~3 min; after call 32 on the same machine): where the m = 1 decode kernel's warps
# stall since the cp.async ring (session 24) replaced its global weight loads (call 9, before
# the ring: 65% of samples long-scoreboard at the first funnel of each step's words, 1.7 of 15
# warps eligible). SASS counts of the ring kernels (CPU, 8192x28672 K4): mcg 563 / mul1 581
# instructions per chunk of 128 weights per lane, ~50% of the issue bound at 63 us. Same
# sections as call 9, default plans (ring, 3 slots), K4 mcg and mul1.
CALL=call33
for cb in mcg mul1; do
    ncu_kernel 33_m1_$cb trellis --k 8192 --n 28672 --K 4 --codebook $cb --m 1 --calls 3
done
t done
