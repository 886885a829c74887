# Call 14 (~3.5 min): the smallest useful call, for a nearly spent device budget: the MoE
# one-token rows (here) against the tree before them (prev), Qwen3-30B-A3B m = 1..8, twice.
CALL=call14
bench_moe here 14_moe_here 60; bench_moe prev 14_moe_prev 60; bench_moe here 14_moe_here2 60
tree here
t done
