"""Mixtral: MixtralForCausalLM; softmax top-k router, always renormalised; experts
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down), router ``block_sparse_moe.gate``."""

from .config import ModelConfig, MoeConfig

ARCHITECTURE = "MixtralForCausalLM"


def parse_config(f) -> ModelConfig:
    n = f.get("num_hidden_layers")
    moe = MoeConfig(
        num_experts=f.get("num_local_experts"), top_k=f.get("num_experts_per_tok"),
        intermediate_size=f.get("intermediate_size"), router_kind="softmax", renormalize=True,
        prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), moe_layers=(True,) * n)
    return ModelConfig(**f.common(qk_norm=False, moe=moe))
