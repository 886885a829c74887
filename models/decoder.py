"""The decoder-only causal LM shared by all supported architectures, ``load_model`` (from a
directory) and ``build_model`` (from any weight source, e.g. one generated in memory).

Layer: x += attn(norm(x)); x += mlp(norm(x)), where mlp is a SwiGLU ``GatedMLP`` or a ``MoEBlock``.
Architecture differences (q/k norm, biases, partial rotary, router kind, shared experts, dense
layers, tensor names) come from ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from exl3_jax.format import MissingTensorError
from exl3_jax.nn import (Attention, Embedding, Exl3Experts, Exl3Linear, GatedMLP, KVCache,
                         MoEBlock, RMSNorm, Router, advance, exl3_forward, init_cache,
                         resolve_dtype, routed_experts)

from .config import ModelConfig
from .weights import WeightSource


class DecoderLayer(nnx.Module):
    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def __call__(self, x, positions, mask, k_cache, v_cache, write_slot):
        """x [B, T, H] -> (x [B, T, H], k_cache, v_cache). The named scopes label the HLO ops
        (profiles, scripts/gpu_profile_decode.py --hlo)."""
        with jax.named_scope("input_norm"):
            h = self.input_layernorm(x)
        with jax.named_scope("attention"):
            a, k_cache, v_cache = self.self_attn(h, positions, mask, k_cache, v_cache,
                                                 write_slot)
        with jax.named_scope("post_attention_norm"):
            x = x + a
            h = self.post_attention_layernorm(x)
        with jax.named_scope("mlp"):
            x = x + self.mlp(h)
        return x, k_cache, v_cache


class CausalLM(nnx.Module):
    """Embedding, decoder layers, final norm, head. ``dtype`` is the activation dtype."""

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[DecoderLayer],
                 norm: RMSNorm, lm_head, *, dtype="bfloat16"):
        self.config = config
        self.dtype = str(resolve_dtype(dtype))
        self.embed_tokens = embed
        self.layers = nnx.List(layers)
        self.norm = norm
        self.lm_head = lm_head          # Exl3Linear | Linear | None (tied to embed_tokens)

    def init_cache(self, batch: int, size: int) -> KVCache:
        c = self.config
        return init_cache(c.num_layers, batch, size, c.num_kv_heads, c.head_dim, self.dtype)

    def cache_dequantized(self) -> "CausalLM":
        """Decode every EXL3 weight once and keep the fp32 copy (CPU reference shortcut)."""
        for _, m in nnx.iter_modules(self):
            if isinstance(m, (Exl3Linear, Exl3Experts)) and m.dense is None:
                m.cache_dequantized()
        return self

    def head(self, x):
        """float32 logits [..., vocab] from final hidden states x [..., H]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(x)
        if isinstance(self.lm_head, Exl3Linear):
            return exl3_forward(x, self.lm_head.weight, self.lm_head.dense)
        return self.lm_head.forward_f32(x)

    def __call__(self, tokens, cache: KVCache, token_valid=None, *, last_only: bool = False):
        """Run T new tokens of B sequences through the model, appending them to the cache.

        Args:
          tokens: int32 [B, T] (left padding allowed); cache: KVCache with room for T more slots.
          token_valid: bool [B, T] (False for padding), default all True.
          last_only: compute logits for the last position only.
        Returns:
          (logits float32 [B, T or 1, vocab], updated cache).
        """
        if token_valid is None:
            token_valid = jnp.ones(tokens.shape, bool)
        write_slot = cache.slot
        positions, mask, cache = advance(cache, token_valid)
        x = self.embed_tokens(tokens, self.dtype)
        ks, vs = list(cache.k), list(cache.v)
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, positions, mask, ks[i], vs[i], write_slot)
        if last_only:
            x = x[:, -1:]
        logits = self.head(self.norm(x))
        return logits, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))


# -- building -------------------------------------------------------------------------------------

def _norm(src: WeightSource, name: str, dim: int, eps: float) -> RMSNorm:
    return RMSNorm(jnp.asarray(src.tensor(name, (dim,)), jnp.float32), eps)


def _mlp(src: WeightSource, prefix: str, names, hidden: int, inter: int) -> GatedMLP:
    g, u, d = names
    return GatedMLP(src.linear(f"{prefix}.{g}", hidden, inter),
                    src.linear(f"{prefix}.{u}", hidden, inter),
                    src.linear(f"{prefix}.{d}", inter, hidden))


def _moe(src: WeightSource, c: ModelConfig, layer: int) -> MoEBlock:
    m = c.moe
    prefix = f"model.layers.{layer}.{m.prefix}"
    H, I, E = c.hidden_size, m.intermediate_size, m.num_experts
    g, u, d = m.expert_names
    keys = lambda n: [f"{prefix}.experts.{e}.{n}" for e in range(E)]  # noqa: E731
    stacks = (src.expert_stack(keys(g), H, I), src.expert_stack(keys(u), H, I),
              src.expert_stack(keys(d), I, H))
    experts = routed_experts(*stacks)     # Exl3Experts, TieredExl3Experts (mixed K) or plain
    if src.is_exl3(f"{prefix}.gate"):
        raise MissingTensorError("the MoE router must be a plain tensor", file=src.directory,
                                 tensor=f"{prefix}.gate.weight")
    router = Router(src.tensor(f"{prefix}.gate.weight", (E, H)))     # [E, H] as stored
    bias = None
    if m.score_bias:
        bias = jnp.asarray(src.tensor(f"{prefix}.gate.e_score_correction_bias", (E,)),
                           jnp.float32)
    shared = None
    if m.shared_intermediate_size:
        shared = _mlp(src, f"{prefix}.shared_experts", ("gate_proj", "up_proj", "down_proj"), H,
                      m.shared_intermediate_size)
    return MoEBlock(router, experts, top_k=m.top_k, router_kind=m.router_kind,
                    renormalize=m.renormalize, routed_scaling_factor=m.routed_scaling_factor,
                    score_bias=bias, shared=shared)


def _layer(src: WeightSource, c: ModelConfig, i: int) -> DecoderLayer:
    p = f"model.layers.{i}"
    H, D = c.hidden_size, c.head_dim
    attn = Attention(
        src.linear(f"{p}.self_attn.q_proj", H, c.num_heads * D, bias=c.attention_bias),
        src.linear(f"{p}.self_attn.k_proj", H, c.num_kv_heads * D, bias=c.attention_bias),
        src.linear(f"{p}.self_attn.v_proj", H, c.num_kv_heads * D, bias=c.attention_bias),
        src.linear(f"{p}.self_attn.o_proj", c.num_heads * D, H),
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=D, rope=c.rope,
        q_norm=_norm(src, f"{p}.self_attn.q_norm.weight", D, c.rms_norm_eps) if c.qk_norm else None,
        k_norm=_norm(src, f"{p}.self_attn.k_norm.weight", D, c.rms_norm_eps) if c.qk_norm else None)
    if c.moe is not None and c.moe.moe_layers[i]:
        mlp = _moe(src, c, i)
    else:
        mlp = _mlp(src, f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), H,
                   c.intermediate_size)
    return DecoderLayer(_norm(src, f"{p}.input_layernorm.weight", H, c.rms_norm_eps), attn,
                        _norm(src, f"{p}.post_attention_layernorm.weight", H, c.rms_norm_eps),
                        mlp)


def _head(src: WeightSource, c: ModelConfig):
    """EXL3 lm_head (never re-tied, spec 1.6), a plain lm_head.weight, or None = tied (HF only)."""
    if src.is_exl3("lm_head") or src.has("lm_head.weight"):
        return src.linear("lm_head", c.hidden_size, c.vocab_size)
    if src.quantized:
        raise MissingTensorError("EXL3 checkpoint has no lm_head (an EXL3 head is stored "
                                 "separately and never re-tied to embed_tokens)",
                                 file=src.directory, tensor="lm_head.trellis")
    if not c.tie_word_embeddings:
        raise MissingTensorError("lm_head.weight is missing and tie_word_embeddings is false",
                                 file=src.directory, tensor="lm_head.weight")
    return None


def build_model(src: WeightSource, *, dtype="bfloat16",
                cache_dequantized: bool = False) -> CausalLM:
    """Build a CausalLM from a weight source (the body of ``load_model``).

    Args:
      src: a ``WeightSource``, or any object with its attributes (``config`` dict,
        ``config_path``, ``directory``, ``quantized``) and methods (``tensor``, ``linear``,
        ``expert_stack``, ``has``, ``is_exl3``): e.g. weights generated in memory.
      dtype: activation dtype, "bfloat16" (default) or "float32".
      cache_dequantized: decode every EXL3 weight once at build (faster on CPU, more memory).
    """
    c = ModelConfig.from_hf(src.config, src.config_path)
    embed = Embedding(src.tensor("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
    layers = [_layer(src, c, i) for i in range(c.num_layers)]
    model = CausalLM(c, embed, layers, _norm(src, "model.norm.weight", c.hidden_size,
                                             c.rms_norm_eps), _head(src, c), dtype=dtype)
    if cache_dequantized:
        model.cache_dequantized()
    return model


def load_model(directory: str | Path, *, dtype="bfloat16",
               cache_dequantized: bool = False) -> CausalLM:
    """Build a CausalLM from an EXL3 directory or an unquantized HF-layout safetensors directory.

    Args:
      directory: model directory with config.json and *.safetensors.
      dtype: activation dtype, "bfloat16" (default) or "float32".
      cache_dequantized: decode every EXL3 weight once at load (faster on CPU, more memory).
    """
    return build_model(WeightSource(directory), dtype=dtype,
                       cache_dequantized=cache_dequantized)
