"""GGUF -> HF-layout import on a tiny llama GGUF the test writes with the gguf package."""

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from safetensors.numpy import load_file  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402

from exl3_jax.quant.gguf_import import (GGUFImportError, gguf_to_hf_directory,  # noqa: E402
                                        permute_rope_rows, unpermute_rope_rows)

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ hello"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def hf_weights(rng, vocab):
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": rng.standard_normal(HIDDEN)}
    shapes = {"self_attn.q_proj.weight": (N_HEAD * HEAD_DIM, HIDDEN),
              "self_attn.k_proj.weight": (N_KV * HEAD_DIM, HIDDEN),
              "self_attn.v_proj.weight": (N_KV * HEAD_DIM, HIDDEN),
              "self_attn.o_proj.weight": (HIDDEN, N_HEAD * HEAD_DIM),
              "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, FFN),
              "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}"] = rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def write_tiny_gguf(path, weights, tokens, arch="llama"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, arr in weights.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[rest]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight"}[name]
        if rest_is(name, "q_proj"):
            arr = permute_rope_rows(arr, N_HEAD)
        elif rest_is(name, "k_proj"):
            arr = permute_rope_rows(arr, N_KV)
        if name.endswith("mlp.up_proj.weight"):      # one quantized type on the way
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rest_is(name, proj):
    return name.endswith(f"self_attn.{proj}.weight")


def tiny_vocab():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return SPECIALS + alphabet + ["he", "ll", "hell", "hello", "Ġhello"]


def test_gguf_to_hf_directory(tmp_path, rng):
    tokens = tiny_vocab()
    weights = hf_weights(rng, len(tokens))
    write_tiny_gguf(tmp_path / "tiny.gguf", weights, tokens)
    out = gguf_to_hf_directory(tmp_path / "tiny.gguf", tmp_path / "hf")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, want in weights.items():
        if name.endswith("up_proj.weight"):
            # Q8_0: 32-element blocks, scale d = absmax/127 stored in fp16: error <= d/2 plus
            # 127 steps of the scale's fp16 rounding (2^-11 relative)
            d = np.abs(want).reshape(-1, 32).max(1).repeat(32).reshape(want.shape) / 127
            assert np.all(np.abs(got[name] - want) <= (0.5 + 127 * 2.0**-11) * d + 1e-6), name
            assert not np.array_equal(got[name], want)
        else:
            assert np.array_equal(got[name], want), name
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        HIDDEN, N_HEAD, N_KV, HEAD_DIM, len(tokens), True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|>hello hello<|im_end|>")
    assert enc.ids == [1, tokens.index("hello"), tokens.index("Ġhello"), 2]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello hello<|im_end|>"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == TEMPLATE and tok_cfg["eos_token"] == "<|im_end|>"
    assert not list(tmp_path.glob(".hf.partial-*"))
    with pytest.raises(FileExistsError):
        gguf_to_hf_directory(tmp_path / "tiny.gguf", out)


def test_unsupported_architecture_is_named(tmp_path, rng):
    tokens = tiny_vocab()
    write_tiny_gguf(tmp_path / "t.gguf", hf_weights(rng, len(tokens)), tokens, arch="mamba")
    with pytest.raises(GGUFImportError, match="mamba"):
        gguf_to_hf_directory(tmp_path / "t.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def rope_half_split(x, pos, theta=10000.0):
    """HF convention: rotate (x[i], x[i + d/2]) pairs. x [T, d]."""
    d = x.shape[-1]
    ang = pos[:, None] / theta ** (np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, :d // 2], x[:, d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=1)


def rope_adjacent(x, pos, theta=10000.0):
    """llama.cpp "normal" mode: rotate (x[2i], x[2i + 1]) pairs. x [T, d]."""
    d = x.shape[-1]
    ang = pos[:, None] / theta ** (np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, b * c + a * s
    return out


def test_unpermute_turns_adjacent_pair_rope_into_half_split_rope(rng):
    """The permutation is exactly what makes the two RoPE conventions agree, head by head."""
    w_hf = rng.standard_normal((N_HEAD * HEAD_DIM, HIDDEN))
    w_gguf = permute_rope_rows(w_hf, N_HEAD)
    assert np.array_equal(unpermute_rope_rows(w_gguf, N_HEAD), w_hf)
    h = rng.standard_normal((5, HIDDEN))
    pos = np.arange(5, dtype=np.float64) + 3
    for head in range(N_HEAD):
        rows = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        q_hf = rope_half_split(h @ w_hf[rows].T, pos)
        q_cpp = rope_adjacent(h @ w_gguf[rows].T, pos)
        # the GGUF head's adjacent pair i is the HF head's pair (i, i + d/2)
        np.testing.assert_allclose(q_cpp[:, 0::2], q_hf[:, :HEAD_DIM // 2], atol=1e-9)
        np.testing.assert_allclose(q_cpp[:, 1::2], q_hf[:, HEAD_DIM // 2:], atol=1e-9)
