"""Qwen3 (dense): Qwen3ForCausalLM; per-head RMSNorm on q and k before RoPE.

``use_qk_norm: false`` (an exl3-jax extension, default true) drops q/k norm, for Llama weights
carried in a Qwen3 layout (exl3_jax.quant.upcycle)."""

from .config import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"


def parse_config(f) -> ModelConfig:
    return ModelConfig(**f.common(qk_norm=f.get("use_qk_norm", True, bool)))
