"""Llama (covers SmolLM2, Llama 3.x with llama3 RoPE scaling): LlamaForCausalLM."""

from .config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"


def parse_config(f) -> ModelConfig:
    if f.get("mlp_bias", False, bool):
        from .config import ConfigFieldError
        raise ConfigFieldError("mlp_bias=true is not supported", file=f.path)
    return ModelConfig(**f.common(qk_norm=False))
