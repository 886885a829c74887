# Call 72 (~4 min, an H100 / H200; queued in session 37): per-kernel durations of the prefill op
# under ncu (gpu__time_duration of every launch; the last op call's launches printed: the
# transforms or x's fusions, the dequantize kernel, cuBLAS), 8192x28672 K4 mcg at m = 1024 (the
# transforms, no fold) and 4096 (folded), because call 70's parts timed alone do not add up to
# the op (1042 us of parts against 814 of op at m = 1024).
# Predictions: at m = 1024 the output transform 60-100 us, the input transform 10-40, the
# dequantize 140-175, cuBLAS 600-670; at m = 4096 the folding dequantize 200-235 us and x's two
# fusions 30-40 together.
CALL=call72   # ncu_op: pre.sh (this call's own parser, since moved there, failed on the
              # program's JSON line; session 38 parsed its CSVs by hand)
NCU_CALLS=5 NCU_LAST=16 ncu_op 72_ncu_8192_1024 8192 28672 1024
NCU_CALLS=5 NCU_LAST=16 ncu_op 72_ncu_8192_4096 8192 28672 4096
t done
