# Call 34 (~4 min): the one-token ring's occupancy. The default (3 slots, 8-step chunks, one
# split, 8 warps: 60 KB of shared memory per CTA; 62 registers mcg, 66 mul1) holds 3 CTAs per
# SM, so 8192x28672's 896 CTAs run as 2.26 waves of 396, and the SASS (CPU, K4: mcg 563 / mul1
# 581 instructions per chunk of 128 weights per lane) puts 63 us at ~50% of the issue bound.
# * 2,8,1,4: two slots (40 KB; one chunk in flight while one decodes, ~2.5 us per chunk
#   against ~1 us of load latency), 4 CTAs per SM (a 64-register cap: 54 / 64 registers, no
#   spills): 1.70 waves.
# * 3,8,1,0,4: CTAs of 4 warps (30 KB, the same registers; 7 CTAs per SM = 924 >= 896: one
#   wave, no tail), each warp 16 chunks instead of 8.
# Prediction: 2,8,1,4 -3 to -10% where the tail and the 6 warps per scheduler bind, +0-5% if
# the second chunk in flight mattered; 3,8,1,0,4 -5 to -12% at 8192x28672 (the tail gone,
# 7 x 4 = 28 warps per SM), 4096x28672 (896 CTAs of 4 chunks per warp, 8 with 4 warps) alike.
CALL=call34
ab_ring 34_ring_m1 1 8192x28672,4096x28672 '|2,8,1,4|3,8,1,0,4||3,8,1,0,4|2,8,1,4' 280
t done
