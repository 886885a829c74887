# Call 47 (~9.5 min; named nvidia-h200, since the issues' targets are H200 numbers; an H100 may
# come instead): the tree after the warp-specialised form's removal (session 30: the register-A
# wgmma kernel is again the file calls 41-42 validated and timed). (1) Hardware check of the
# wgmma kinds (one-hot decode, GEMM rows with poisoned outputs at m 33 / 128 / 1000). (2) `bench
# linear`, issue #5's table (8192x28672 and 4096x14336, K 3 / 4, mcg / mul1, m 1..4096).
# (3) `bench moe`, Qwen3-30B-A3B m 1..8. (4) e2e decode: Llama-3-8B geometry b1 / b8 against
# bf16, Qwen3-30B-A3B b1 / b8. Predictions: on an H200 the kernels' times within 5% of
# session 28's H200 (mcg K4 m = 1 ~64 us) and of call 42's H100 rows (decode-bound kernels run
# at the same clocks); bf16 ~25-40% faster than the H100's, so x bf16 at m = 1 1.65-1.75.
CALL=call47
issue_table 47
t done
