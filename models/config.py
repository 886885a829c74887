"""Model configuration parsed from an HF config.json (EXL3 or unquantized directory).

``ModelConfig.from_hf`` validates the fields each supported architecture needs and raises
``Exl3FormatError`` subclasses naming config.json and the field, so a bad directory fails before
any tensor is read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from exl3_jax.format import Exl3FormatError
from exl3_jax.nn.rope import RopeConfig


class UnsupportedArchitectureError(Exl3FormatError):
    """config.json names an architecture exl3-jax has no model graph for."""


class ConfigFieldError(Exl3FormatError):
    """config.json lacks a field the architecture needs, or has an invalid value."""


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Static MoE parameters (hashable)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    router_kind: str                  # "softmax" | "sigmoid"
    renormalize: bool
    routed_scaling_factor: float = 1.0
    score_bias: bool = False          # e_score_correction_bias present (sigmoid router)
    shared_intermediate_size: int = 0  # 0: no shared experts
    prefix: str = "mlp"               # "mlp" or "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP (False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    moe: MoeConfig | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], path: str | Path | None = None) -> "ModelConfig":
        """Parse an HF config.json dict; ``path`` (the config file) is named in errors."""
        from . import ARCHITECTURES
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise ConfigFieldError("config.json has no 'architectures' list", file=path)
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}",
                file=path)
        return ARCHITECTURES[arch](_Fields(cfg, path, arch))


_ZERO_OK = frozenset({"first_k_dense_replace", "n_shared_experts"})


class _Fields:
    """Typed access to config.json fields with errors that name the field."""

    def __init__(self, cfg: Mapping[str, Any], path, arch: str):
        self.cfg, self.path, self.arch = cfg, path, arch

    def get(self, name: str, default: Any = ..., kind: type = int) -> Any:
        if name not in self.cfg or self.cfg[name] is None:
            if default is ...:
                raise ConfigFieldError(f"{self.arch} needs config field {name!r}", file=self.path)
            return default
        value = self.cfg[name]
        try:
            if kind is bool:
                if not isinstance(value, bool):
                    raise TypeError
                return value
            out = kind(value)
        except (TypeError, ValueError):
            raise ConfigFieldError(f"config field {name!r} = {value!r} is not a "
                                   f"{kind.__name__}", file=self.path) from None
        if kind is int and (out < 0 or (out == 0 and name not in _ZERO_OK)):
            raise ConfigFieldError(f"config field {name!r} must be "
                                   f"{'>= 0' if name in _ZERO_OK else 'positive'}, got {value!r}",
                                   file=self.path)
        return out

    def common(self, *, qk_norm: bool, partial_rotary_default: float = 1.0,
               **extra) -> dict[str, Any]:
        """Fields shared by every decoder architecture."""
        hidden = self.get("hidden_size")
        heads = self.get("num_attention_heads")
        head_dim = self.get("head_dim", hidden // heads)
        eos = self.cfg.get("eos_token_id")
        eos = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        # transformers >= 5 nests theta / scaling / partial factor in "rope_parameters"
        rp = self.cfg.get("rope_parameters")
        rp = rp if isinstance(rp, dict) else {}
        theta = rp.get("rope_theta", self.get("rope_theta", 10000.0, float))
        scaling = rp if rp.get("rope_type", "default") != "default" else \
            self.cfg.get("rope_scaling")
        partial = rp.get("partial_rotary_factor",
                         self.get("partial_rotary_factor", partial_rotary_default, float))
        try:
            rope = RopeConfig.from_hf(head_dim, float(theta), scaling, float(partial))
        except (ValueError, KeyError) as e:
            raise ConfigFieldError(f"bad RoPE configuration: {e}", file=self.path) from None
        fields = dict(
            architecture=self.arch, vocab_size=self.get("vocab_size"), hidden_size=hidden,
            num_layers=self.get("num_hidden_layers"), num_heads=heads,
            num_kv_heads=self.get("num_key_value_heads", heads), head_dim=head_dim,
            intermediate_size=self.get("intermediate_size"),
            rms_norm_eps=self.get("rms_norm_eps", 1e-6, float), rope=rope,
            tie_word_embeddings=self.get("tie_word_embeddings", False, bool), qk_norm=qk_norm,
            attention_bias=self.get("attention_bias", False, bool),
            max_position_embeddings=self.get("max_position_embeddings", 4096),
            bos_token_id=self.cfg.get("bos_token_id"), eos_token_ids=eos)
        fields.update(extra)
        if fields["num_heads"] % fields["num_kv_heads"]:
            raise ConfigFieldError(f"num_attention_heads {heads} is not a multiple of "
                                   f"num_key_value_heads {fields['num_kv_heads']}", file=self.path)
        return fields
