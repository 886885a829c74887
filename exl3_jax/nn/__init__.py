"""Flax NNX modules of EXL3 models (Exl3Linear, attention, norms, RoPE, MLP, MoE)."""
