"""GLM-4-MoE (GLM-4.5 / 4.6): Glm4MoeForCausalLM.

Sigmoid ("dots") router with e_score_correction_bias and routed_scaling_factor, shared experts
(``mlp.shared_experts``, intermediate moe_intermediate_size * n_shared_experts), the first
``first_k_dense_replace`` layers dense, partial rotary (default factor 0.5), q/k/v biases when
attention_bias, optional q/k norm (use_qk_norm). MTP/next-n layers past num_hidden_layers are
ignored. n_group/topk_group are ignored, as in exllamav3's dots router (spec 5.2).
"""

from .config import ModelConfig, MoeConfig

ARCHITECTURE = "Glm4MoeForCausalLM"


def parse_config(f) -> ModelConfig:
    n = f.get("num_hidden_layers")
    first_dense = f.get("first_k_dense_replace", 0)
    moe_inter = f.get("moe_intermediate_size")
    shared = f.get("n_shared_experts", 0)
    moe = MoeConfig(
        num_experts=f.get("n_routed_experts"), top_k=f.get("num_experts_per_tok"),
        intermediate_size=moe_inter, router_kind="sigmoid",
        renormalize=f.get("norm_topk_prob", True, bool),
        routed_scaling_factor=f.get("routed_scaling_factor", 1.0, float), score_bias=True,
        shared_intermediate_size=moe_inter * shared,
        moe_layers=tuple(i >= first_dense for i in range(n)))
    return ModelConfig(**f.common(qk_norm=f.get("use_qk_norm", False, bool),
                                  partial_rotary_default=0.5, moe=moe))
