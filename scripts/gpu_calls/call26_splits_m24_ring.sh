# Call 26 (~5 min): (1) m = 16 with fewer K-splits: since session 25 the m = 16 plan runs 8-step
# chunks, so each warp of the default split (8192x28672: 4 splits, 4096x14336: 2) decodes only
# 2 chunks; CPU-compiled SASS (8192x28672 K4 mcg) puts the m = 16 loop body at 568
# instructions per 4096 weights per warp, the m = 1 kernel's count, yet m = 16 runs 89 vs
# 71 us (m = 1 direct loads): per-CTA fixed cost (prologue, fold, partials) over 2 chunks and 3
# CTAs per SM (78 registers). Prediction: 2 splits 0 to -8%, 1 split worse at 4096x14336
# (112 CTAs x 1 split < 132 SMs x 3). (2) m = 24 (three groups, 1-step chunks) against 2 / 4 /
# 8 steps. (3) the uncapped ring at m = 4 / 8 (one group of B fragments; session 24 timed it
# capped only: +19%), 2 and 1 splits (the default's 8 splits leave one chunk per warp).
CALL=call26
ab_ring 26_m16s 16 8192x28672,4096x14336 '|0,8,2|0,8,1|'
ab_ring 26_m24 24 8192x28672,4096x14336 '|0,2,0|0,4,0|0,8,0|'
ab_ring 26_ring4 4,8 8192x28672,4096x28672 '|3,8,2|3,8,1|'
t done
