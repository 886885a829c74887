"""GGUF (llama.cpp) -> HF-layout model directory: weights, config.json and tokenizer.json.

Reads with the ``gguf`` package, dequantizes every tensor to float32, maps llama.cpp tensor names to
HF names, and undoes llama.cpp's Q/K row permutation (GGUF "llama" weights are laid out for RoPE on
adjacent pairs; HF rotates the two halves of each head). The GGUF tokenizer (gpt2-style byte-level
BPE) becomes a ``tokenizers`` tokenizer.json; its chat template goes to tokenizer_config.json.
See shared/spec/test_models.md section 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..format import staging_dir

# llama.cpp block tensor name -> HF name inside model.layers.{i}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
CONTROL_TOKEN_TYPE = 3


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, missing metadata, ...)."""


def _field(reader, key: str, default: Any = None, *, required: bool = True) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFImportError(f"GGUF metadata {key!r} is missing")
        return default
    return f.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: rows [head, pair, 2] -> [head, 2, pair] (HF half split).

    w: [n_head * head_dim, in]. Inverse of llama.cpp's
    ``w.reshape(n_head, 2, hd // 2, in).swapaxes(1, 2)``.
    """
    out, inp = w.shape
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF); used to build test files."""
    out, inp = w.shape
    hd = out // n_head
    return w.reshape(n_head, 2, hd // 2, inp).swapaxes(1, 2).reshape(out, inp)


def read_llama_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """Read a llama-architecture GGUF.

    Returns a dict with ``config`` (HF config.json fields), ``tensors`` (HF name -> float32 numpy,
    HF [out, in] orientation), ``tokenizer`` (a tokenizers.Tokenizer) and ``tokenizer_config``.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(only 'llama', which covers SmolLM2)")
    n_layer = int(_field(reader, "llama.block_count"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.rope.dimension_count", hidden // n_head))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise GGUFImportError(f"{path}: unexpected tensor {t.name!r}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{v}" for i in range(n_layer) for v in _LAYER_NAMES.values()}
    missing = sorted(expected - set(tensors))
    if missing:
        raise GGUFImportError(f"{path}: tensors missing for {missing[:3]}"
                              f"{' ...' if len(missing) > 3 else ''}")

    bos = _field(reader, "tokenizer.ggml.bos_token_id", required=False)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", required=False)
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", required=False)
    pad = _field(reader, "tokenizer.ggml.padding_token_id", required=False)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": n_layer, "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "vocab_size": len(tokens), "tie_word_embeddings": tied, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
    }
    tokenizer = _tokenizer(reader, tokens)
    tok_cfg = {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False,
                                            required=False)),
               "model_max_length": config["max_position_embeddings"]}
    for key, idx in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk),
                     ("pad_token", pad)):
        if idx is not None:
            tok_cfg[key] = tokens[int(idx)]
    template = _field(reader, "tokenizer.chat_template", required=False)
    if template:
        tok_cfg["chat_template"] = template
    return {"config": config, "tensors": tensors, "tokenizer": tokenizer,
            "tokenizer_config": tok_cfg}


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _tokenizer(reader, tokens: list[str]):
    """Byte-level BPE from the GGUF vocab and merges; control tokens become special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFImportError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' "
                              f"byte-level BPE)")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), required=False))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if int(ty) == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens(specials)
    return tok


def gguf_to_hf_directory(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                         *, overwrite: bool = False) -> Path:
    """Write an HF-layout directory (config.json, model.safetensors in float32, tokenizer.json,
    tokenizer_config.json, generation_config.json) from a llama GGUF. Atomic: staged in a
    temporary sibling directory and renamed when complete."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    model = read_llama_gguf(gguf_path)
    stage = staging_dir(out)
    try:
        save_file(model["tensors"], str(stage / "model.safetensors"), metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(model["config"], indent=2))
        model["tokenizer"].save(str(stage / "tokenizer.json"))
        (stage / "tokenizer_config.json").write_text(json.dumps(model["tokenizer_config"],
                                                                indent=2))
        gen = {k: model["config"][k] for k in ("bos_token_id", "eos_token_id")
               if model["config"][k] is not None}
        (stage / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out
