"""Flax NNX modules of EXL3 models (Exl3Linear, attention, norms, RoPE, MLP, MoE)."""

from .attention import Attention, KVCache, advance, gqa_attention, init_cache
from .linear import Embedding, Exl3Linear, Linear, dequantize_weight, exl3_forward
from .mlp import GatedMLP
from .moe import (ROUTERS, Exl3Experts, MoEBlock, PlainExperts, Router, TieredExl3Experts,
                  route_sigmoid_topk, route_softmax_topk, routed_experts)
from .norm import RMSNorm, rms_norm
from .numerics import ACTIVATION_DTYPES, F16_MAX, fp16_operand, resolve_dtype
from .rope import RopeConfig, apply_rope

__all__ = [
    "ACTIVATION_DTYPES", "Attention", "Embedding", "Exl3Experts", "Exl3Linear", "F16_MAX",
    "GatedMLP", "KVCache", "Linear", "MoEBlock", "PlainExperts", "RMSNorm", "ROUTERS",
    "Router", "TieredExl3Experts", "routed_experts",
    "RopeConfig", "advance", "apply_rope", "dequantize_weight", "exl3_forward", "fp16_operand",
    "gqa_attention", "init_cache", "resolve_dtype", "rms_norm", "route_sigmoid_topk",
    "route_softmax_topk",
]
