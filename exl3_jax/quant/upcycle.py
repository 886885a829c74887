"""Upcycle a dense Llama model (SmolLM2) into a tiny Qwen3-MoE (shared/spec/test_models.md 4).

Every layer's SwiGLU MLP becomes ``E`` experts ``mlp.experts.{e}.{gate,up,down}_proj`` and a
random router ``mlp.gate`` [E, hidden] (seeded per layer) picks ``top_k`` of them per token with
``norm_topk_prob = true``, so the routing weights of a token sum to 1. Attention, norms,
embeddings and head are carried over unchanged. Llama has no q/k norm, so the config says
``use_qk_norm: false`` (an exl3-jax extension of the Qwen3-MoE config; HF transformers would
ignore it).

Two sources:

* ``upcycle_exl3``: an EXL3 Llama checkpoint (the default model). The already quantized MLP
  tensors are copied into every expert slot, bit for bit, so no re-encoding is needed. With
  identical experts and weights summing to 1 the MoE model computes the dense model's function
  exactly (up to fp32 rounding in the combine), while still routing every token through top-k.
* ``upcycle_hf``: an unquantized HF-layout Llama directory. Each expert is the MLP plus Gaussian
  noise of relative size ``noise`` (std of the noise = noise * std of the weight), so experts
  differ; the result is written as an HF-layout Qwen3-MoE directory, and quantized through
  ``convert_hf`` when ``bits`` is given (slow on CPU: E times the MLP tiles).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..format import Exl3Checkpoint, Exl3Writer, TensorStore, read_json, staging_dir
from .convert import SIDE_FILES, convert_hf

SOURCE_ARCHITECTURE = "LlamaForCausalLM"
ARCHITECTURE = "Qwen3MoeForCausalLM"
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
# Llama-only config fields that mean nothing (or something else) in a Qwen3-MoE config
_DROP_FIELDS = ("architectures", "model_type", "mlp_bias", "pretraining_tp",
                "quantization_config", "original_quantization_config")
# quantization_config fields the writer derives from the tensors it writes
_DERIVED_QUANT_FIELDS = ("quant_method", "version", "bits", "head_bits", "codebook")


class UpcycleError(ValueError):
    """The source model or the upcycling parameters are not usable."""


# -- shared pieces --------------------------------------------------------------------------------

def check_source_config(config: dict[str, Any], *, num_experts: int, top_k: int,
                        where: str | Path) -> int:
    """Validate a dense source config.json and the MoE shape; returns the number of layers."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch != SOURCE_ARCHITECTURE:
        raise UpcycleError(f"{where}: upcycling needs a {SOURCE_ARCHITECTURE} source (SwiGLU MLP, "
                           f"no q/k norm), got architecture {arch!r}")
    if config.get("mlp_bias"):
        raise UpcycleError(f"{where}: mlp_bias=true is not supported")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise UpcycleError(f"num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise UpcycleError(f"top_k must be an integer in [1, num_experts={num_experts}], "
                           f"got {top_k!r}")
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise UpcycleError(f"{where}: config field 'num_hidden_layers' is missing or invalid")
    return layers


def moe_config(dense: dict[str, Any], *, num_experts: int, top_k: int) -> dict[str, Any]:
    """The Qwen3-MoE config.json of an upcycled dense Llama config (every layer sparse)."""
    cfg = {k: v for k, v in dense.items() if k not in _DROP_FIELDS}
    heads = dense["num_attention_heads"]
    cfg.update(
        architectures=[ARCHITECTURE], model_type="qwen3_moe",
        head_dim=dense.get("head_dim") or dense["hidden_size"] // heads,
        num_key_value_heads=dense.get("num_key_value_heads") or heads,
        attention_bias=bool(dense.get("attention_bias", False)), use_qk_norm=False,
        num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=dense["intermediate_size"], norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    return cfg


def router_weight(seed: int, layer: int, num_experts: int, hidden: int) -> np.ndarray:
    """Random router of one layer, float32 [E, hidden] ~ N(0, 1/hidden): logits of a normalised
    hidden state are then O(1), so tokens spread over the experts. Seeded by (seed, layer)."""
    rng = np.random.default_rng([seed, layer])
    return (rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)


def dense_mlp_key(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.{proj}"


def expert_key(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}"


def router_key(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def _upcycle_meta(source: Path, num_experts: int, top_k: int, seed: int,
                  noise: float) -> dict[str, Any]:
    return {"source": source.name, "source_architecture": SOURCE_ARCHITECTURE,
            "num_experts": num_experts, "top_k": top_k, "router_seed": seed, "noise": noise}


# -- EXL3 source ----------------------------------------------------------------------------------

def upcycle_exl3(source: str | Path, output: str | Path, *, num_experts: int = 8,
                 top_k: int = 2, seed: int = 0, overwrite: bool = False) -> Path:
    """EXL3 Llama checkpoint -> EXL3 Qwen3-MoE checkpoint with copies of each MLP as experts.

    No tensor is re-encoded: trellis/suh/svh (and codebook) of ``mlp.{gate,up,down}_proj`` are
    written unchanged under every ``mlp.experts.{e}``; the router is stored fp16 (the converter's
    rule for plain tensors). Written atomically. Returns the output directory.
    """
    source, output = Path(source), Path(output)
    ckpt = Exl3Checkpoint(source)
    layers = check_source_config(ckpt.config, num_experts=num_experts, top_k=top_k,
                                 where=source / "config.json")
    if ckpt.embeddings:
        raise UpcycleError(f"{source}: trellis-quantized embeddings ({sorted(ckpt.embeddings)}) "
                           f"are not supported")
    mlp_keys = {dense_mlp_key(i, p) for i in range(layers) for p in MLP_PROJS}
    missing = sorted(k for k in mlp_keys if k not in ckpt.linears)
    if missing:
        raise UpcycleError(f"{source}: dense MLP linears are not EXL3 tensors or are missing: "
                           f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")
    hidden = int(ckpt.config["hidden_size"])
    quant_extra = {k: v for k, v in ckpt.quantization_config.items()
                   if k not in _DERIVED_QUANT_FIELDS}
    quant_extra["upcycle"] = _upcycle_meta(source, num_experts, top_k, seed, 0.0)

    with Exl3Writer(output, moe_config(ckpt.config, num_experts=num_experts, top_k=top_k),
                    overwrite=overwrite) as writer:
        for name in ckpt.plain:
            writer.add_tensor(name, ckpt.read_tensor(name))
        for key, info in ckpt.linears.items():
            arrays = ckpt.read_linear(key)
            targets = [key]
            if key in mlp_keys:
                layer, proj = int(key.split(".")[2]), key.rpartition(".")[2]
                targets = [expert_key(layer, e, proj) for e in range(num_experts)]
            for target in targets:
                writer.add_linear(target, arrays["trellis"], arrays["suh"], arrays["svh"],
                                  info.codebook, arrays["bias"])
        for i in range(layers):
            writer.add_tensor(router_key(i),
                              router_weight(seed, i, num_experts, hidden).astype(np.float16))
        for fname in SIDE_FILES:
            if (source / fname).is_file():
                writer.add_file(fname, source / fname)
        writer.set_quantization(**quant_extra)
    return output


# -- HF source ------------------------------------------------------------------------------------

def perturbed(weight: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """weight + N(0, (noise * std(weight))^2), in weight's dtype (noise 0: an exact copy)."""
    if noise == 0:
        return weight.copy()
    w = np.asarray(weight, np.float32)
    return (w + noise * float(w.std()) * rng.standard_normal(w.shape, np.float32)).astype(
        weight.dtype)


def upcycle_hf(source: str | Path, output: str | Path, *, num_experts: int = 8, top_k: int = 2,
               noise: float = 0.01, seed: int = 0, bits: float | None = None,
               overwrite: bool = False, log: Callable[[str], None] | None = None,
               **convert_kwargs) -> Path:
    """HF-layout Llama directory -> Qwen3-MoE with perturbed MLP copies as experts.

    Args:
      source: unquantized HF-layout Llama directory (config.json, *.safetensors).
      output: directory to create: HF-layout Qwen3-MoE when ``bits`` is None, else EXL3.
      noise: relative noise std of each expert (>= 0); expert e of layer i draws its noise from
        the seed (seed, i, e), the router from (seed, i).
      bits: quantize with ``convert_hf(..., bits=bits, **convert_kwargs)`` (E x the MLP tiles).
    Returns the output directory. Written atomically (one safetensors shard per layer).
    """
    from safetensors.numpy import save_file

    source, output = Path(source), Path(output)
    config = read_json(source / "config.json")
    if not isinstance(config, dict):
        raise UpcycleError(f"{source / 'config.json'} must hold a JSON object")
    if isinstance(config.get("quantization_config"), dict):
        raise UpcycleError(f"{source} is quantized; use upcycle_exl3 for EXL3 sources")
    layers = check_source_config(config, num_experts=num_experts, top_k=top_k,
                                 where=source / "config.json")
    if not noise >= 0:
        raise UpcycleError(f"noise must be >= 0, got {noise!r}")
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists (pass overwrite=True to replace it)")
    store = TensorStore(source)
    mlp_names = {f"{dense_mlp_key(i, p)}.weight": (i, p) for i in range(layers)
                 for p in MLP_PROJS}
    missing = sorted(n for n in mlp_names if n not in store)
    if missing:
        raise UpcycleError(f"{source}: dense MLP weights are missing: {missing[:3]}")
    hidden = int(config["hidden_size"])
    cfg = moe_config(config, num_experts=num_experts, top_k=top_k)
    cfg["upcycle"] = _upcycle_meta(source, num_experts, top_k, seed, float(noise))

    stage = staging_dir(output)
    try:
        hf_dir = stage / "hf" if bits is not None else stage
        hf_dir.mkdir(exist_ok=True)
        weight_map: dict[str, str] = {}

        def shard(tensors: dict[str, np.ndarray], fname: str) -> None:
            save_file(tensors, str(hf_dir / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))

        # layer-independent tensors, then one shard per layer (memory: one layer's experts)
        shard({n: store.read(n) for n in store.names() if ".layers." not in n},
              "model-globals.safetensors")
        for i in range(layers):
            prefix = f"model.layers.{i}."
            tensors = {n: store.read(n) for n in store.names()
                       if n.startswith(prefix) and n not in mlp_names}
            for proj in MLP_PROJS:
                w = store.read(f"{dense_mlp_key(i, proj)}.weight")
                for e in range(num_experts):
                    rng = np.random.default_rng([seed, i, e, MLP_PROJS.index(proj)])
                    tensors[f"{expert_key(i, e, proj)}.weight"] = perturbed(w, noise, rng)
            tensors[router_key(i)] = router_weight(seed, i, num_experts, hidden)
            shard(tensors, f"model-layer{i:05d}.safetensors")
        (hf_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        for fname in SIDE_FILES:
            if (source / fname).is_file():
                shutil.copyfile(source / fname, hf_dir / fname)
        if bits is not None:
            convert_hf(hf_dir, stage / "exl3", bits=bits, log=log, **convert_kwargs)
            result = stage / "exl3"
        else:
            result = stage
        if output.exists():
            shutil.rmtree(output)
        os.replace(result, output)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return output


__all__ = ["UpcycleError", "check_source_config", "moe_config", "router_weight", "upcycle_exl3",
           "upcycle_hf"]
