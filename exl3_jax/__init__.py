"""exl3-jax: run EXL3 (ExLlamaV3 trellis-quantized) language models in JAX."""

__version__ = "0.1.0"
