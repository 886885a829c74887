"""Qwen3-MoE: Qwen3MoeForCausalLM; softmax top-k router (renormalised when norm_topk_prob),
experts ``mlp.experts.{e}.{gate,up,down}_proj``, dense MLP on ``mlp_only_layers`` and off the
``decoder_sparse_step`` grid. ``use_qk_norm: false`` (exl3-jax extension, default true) drops
q/k norm, for SmolLM2 upcycled into this layout (exl3_jax.quant.upcycle)."""

from .config import ModelConfig, MoeConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"


def parse_config(f) -> ModelConfig:
    n = f.get("num_hidden_layers")
    step = f.get("decoder_sparse_step", 1)
    dense_only = set(f.cfg.get("mlp_only_layers") or [])
    moe = MoeConfig(
        num_experts=f.get("num_experts"), top_k=f.get("num_experts_per_tok"),
        intermediate_size=f.get("moe_intermediate_size"), router_kind="softmax",
        renormalize=f.get("norm_topk_prob", False, bool),
        moe_layers=tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n)))
    return ModelConfig(**f.common(qk_norm=f.get("use_qk_norm", True, bool), moe=moe))
