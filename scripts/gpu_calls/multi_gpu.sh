# Issue #8 (multi-GPU; run when `status` lends nvidia-h200-x2 or -x4; after pre.sh, carry
# [".device"]; ~10 min): TP = 2 logits and greedy tokens against one GPU with the GPU kernels
# (dense, and MoE expert-parallel and tensor-split), then decode and prefill tokens/s of the
# synthetic Qwen3-30B-A3B (and Llama-3-8B) geometry at TP = 1, 2 (and 4 where 4 GPUs are lent),
# MoE layers expert-parallel vs tensor-split, with the scaling efficiency (tp_scaling in the
# JSON). Qwen3's expert intermediate 768 splits into 128-column blocks at TP = 2 only (192 at
# TP = 4 is not a whole Hadamard block), so TP = 4 runs the MoE layers expert-parallel.
# NCCL_NVLS_ENABLE=0: never NVLink multicast.
CALL=multi
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name --format=csv,noheader
NGPU=$(python3 -c "import jax; print(jax.device_count())")
t "devices: $NGPU"
timeout 240 python3 -m pytest -q -x tests/test_parallel_generate_gpu.py > $RES/m_pytest_tp.log 2>&1
t "pytest tp rc=$?"; tail -3 $RES/m_pytest_tp.log; save
CASES="moe:1:512,moe:1:512:tp2:experts,moe:1:512:tp2:tensor,moe:8:64,moe:8:64:tp2:experts,moe:8:64:tp2:tensor,dense:1:512,dense:1:512:tp2"
if [ "$NGPU" -ge 4 ]; then CASES="$CASES,moe:1:512:tp4:experts,moe:8:64:tp4:experts,dense:1:512:tp4"; fi
(cd scripts && timeout 330 python3 gpu_e2e_decode.py --cases $CASES --codebook mcg --budget-s 290 --hard-limit-s 320 --out $RES/m_e2e_tp.json > $RES/m_e2e_tp.log 2>&1)
t "e2e tp rc=$?"; grep -E "^moe|^dense|^scaling" $RES/m_e2e_tp.log | cut -c1-200; save
t done
