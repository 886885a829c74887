"""Flax model graphs per architecture (installed as ``exl3_jax.models``).

``load_model(directory)`` builds a ``CausalLM`` from an EXL3 directory (config.json with an exl3
quantization_config) or from an unquantized HF-layout safetensors directory.
"""

from . import glm4_moe, llama, mixtral, qwen3, qwen3_moe

ARCHITECTURES = {m.ARCHITECTURE: m.parse_config
                 for m in (llama, qwen3, qwen3_moe, mixtral, glm4_moe)}

from .config import (ConfigFieldError, ModelConfig, MoeConfig,  # noqa: E402
                     UnsupportedArchitectureError)
from .decoder import CausalLM, DecoderLayer, build_model, load_model  # noqa: E402
from .weights import WeightSource  # noqa: E402

__all__ = ["ARCHITECTURES", "CausalLM", "ConfigFieldError", "DecoderLayer", "ModelConfig",
           "MoeConfig", "UnsupportedArchitectureError", "WeightSource", "build_model",
           "load_model"]
