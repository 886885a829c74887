"""Qwen3 (dense): Qwen3ForCausalLM; per-head RMSNorm on q and k before RoPE."""

from .config import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"


def parse_config(f) -> ModelConfig:
    return ModelConfig(**f.common(qk_norm=True))
