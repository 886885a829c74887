"""The random Llama model and the logit metrics of scripts/interop_exllamav3.py (CPU).

The GPU script compares exllamav3's and exl3-jax's logits on this model; these tests check the
pieces that run anywhere: the generator is deterministic and writes a standard HF Llama directory
(checked against an independent NumPy Llama forward in float64), its logits are not degenerate,
the token streams are well formed, and the metrics are right on cases with closed forms.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import interop_exllamav3 as interop  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("interop") / "hf"
    info = interop.write_hf_model(d, tiny=True, seed=interop.SEED)
    return d, info


def numpy_llama_logits(directory: Path, ids: np.ndarray) -> np.ndarray:
    """float64 logits [T, vocab] of an HF Llama directory, written from the HF Llama definition
    (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU MLP, untied head)."""
    cfg = json.loads((directory / "config.json").read_text())
    w = {k: v.astype(np.float64)
         for k, v in load_file(str(directory / "model.safetensors")).items()}
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)

    def rms(x, g):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g

    inv_freq = cfg["rope_theta"] ** (-np.arange(0, D, 2) / D)           # [D/2]
    ang = np.arange(T)[:, None] * inv_freq[None]                        # [T, D/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                                        # x [heads, T, D]
        rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos + rot * sin

    x = w["model.embed_tokens.weight"][ids]                            # [T, H]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms(x, w[f"{p}.input_layernorm.weight"])
        q = (h @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, nh, D).transpose(1, 0, 2)
        k = (h @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, nkv, D).transpose(1, 0, 2)
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, nkv, D).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
        s = np.einsum("htd,hsd->hts", q, k) / np.sqrt(D)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,hsd->thd", a, v).reshape(T, nh * D)
        x = x + o @ w[f"{p}.self_attn.o_proj.weight"].T
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        g, u = h @ w[f"{p}.mlp.gate_proj.weight"].T, h @ w[f"{p}.mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[f"{p}.mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_generator_is_deterministic_and_hf_shaped(tiny_model, tmp_path):
    d, info = tiny_model
    again = tmp_path / "again"
    interop.write_hf_model(again, tiny=True, seed=interop.SEED)
    other = tmp_path / "other"
    interop.write_hf_model(other, tiny=True, seed=interop.SEED + 1)
    a, b, c = (load_file(str(p / "model.safetensors")) for p in (d, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (d / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()

    cfg = json.loads((d / "config.json").read_text())
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    expect = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expect.update({f"{p}.input_layernorm.weight": (H,),
                       f"{p}.post_attention_layernorm.weight": (H,),
                       f"{p}.self_attn.q_proj.weight": (nh * D, H),
                       f"{p}.self_attn.k_proj.weight": (nkv * D, H),
                       f"{p}.self_attn.v_proj.weight": (nkv * D, H),
                       f"{p}.self_attn.o_proj.weight": (H, nh * D),
                       f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H),
                       f"{p}.mlp.down_proj.weight": (H, I)})
    assert {k: v.shape for k, v in a.items()} == expect
    assert all(v.dtype == np.float16 for v in a.values())
    # the GPU model's quantized dims are multiples of 128 (no padding on either converter's side)
    f = interop.FULL
    assert all(d % 128 == 0 for d in (f["hidden_size"], f["intermediate_size"], f["vocab_size"],
                                      f["num_attention_heads"] * f["head_dim"],
                                      f["num_key_value_heads"] * f["head_dim"]))
    assert info["parameters"] == sum(v.size for v in a.values())


def test_token_streams(tiny_model):
    d, _ = tiny_model
    rows, cols = interop.CAL["tiny"]
    inputs, cal, n_text = interop.token_streams(d, rows, cols)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    assert sorted(inputs) == sorted(interop.INPUT_LENGTHS)
    longest = inputs[max(inputs)]
    for n, inp in inputs.items():
        assert inp.shape == (n,) and inp[0] == 1 and 0 <= inp.min() and inp.max() < vocab
        np.testing.assert_array_equal(inp[1:], longest[len(longest) - n + 1:])   # a suffix
    assert cal.shape == (rows, cols) and 0 < n_text < rows
    assert cal.min() >= 0 and cal.max() < vocab
    # the fixed inputs are held out: the start of the longest does not occur in the text rows
    text = cal[:n_text].ravel()
    head = longest[1:17]
    windows = np.lib.stride_tricks.sliding_window_view(text, len(head))
    assert not (windows == head).all(axis=1).any()


def test_exl3_jax_reads_the_model_like_numpy_llama(tiny_model):
    """exl3-jax's fp32 logits of the unquantized model equal an independent float64 Llama, and
    they look like a trained model's (std ~4, top-1 neither a near-tie nor one-hot)."""
    d, _ = tiny_model
    inputs, _, _ = interop.token_streams(d, *interop.CAL["tiny"])
    ids = inputs[min(inputs)][:48]
    ref = numpy_llama_logits(d, ids)
    (got,) = interop._jax_logits(d, [ids])
    assert got.shape == ref.shape
    rel = np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean())
    assert rel < 1e-4, rel
    m = interop.compare_logits(ref, got)
    assert m["top1_agreement"] == 1.0 and m["mean_kl"] < 1e-7
    assert 2.0 < ref.std(-1).mean() < 8.0
    top1 = np.exp(interop.log_softmax(ref)).max(-1).mean()
    assert 0.2 < top1 < 0.95


def test_compare_logits_closed_forms(rng):
    T, V = 64, 50
    ref = 3.0 * rng.standard_normal((T, V))
    same = interop.compare_logits(ref, ref + rng.standard_normal((T, 1)))   # per-row shift
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] < 1e-12
    # two classes: KL(Bern(p) || Bern(q)) with p = sigmoid(a), q = sigmoid(b)
    a, b = rng.standard_normal(T) * 2, rng.standard_normal(T) * 2
    zeros = np.zeros(T)
    m = interop.compare_logits(np.stack([zeros, a], 1), np.stack([zeros, b], 1))
    p, q = 1 / (1 + np.exp(-a)), 1 / (1 + np.exp(-b))
    kl = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    np.testing.assert_allclose(m["mean_kl"], kl.mean(), rtol=1e-10)
    np.testing.assert_allclose(m["max_kl"], kl.max(), rtol=1e-10)
    assert m["top1_agreement"] == pytest.approx(((a > 0) == (b > 0)).mean())
    assert interop.passes(dict(top1_agreement=0.99, mean_kl=1e-3))
    assert not interop.passes(dict(top1_agreement=0.98, mean_kl=1e-4))
    assert not interop.passes(dict(top1_agreement=1.0, mean_kl=2e-3))
    with pytest.raises(ValueError, match="shapes differ"):
        interop.compare_logits(ref, ref[:, :-1])


def test_comparisons_cover_both_directions():
    keys = {f"{rt}__{m}__T{n}" for n in (128, 512)
            for rt, m in [("ex", "ex"), ("jax", "ex"), ("ex", "ex_b35"), ("jax", "ex_b35"),
                          ("jax", "jax_mul1"), ("ex", "jax_mul1"), ("torch", "hf"),
                          ("jax", "hf"), ("ex", "hf")]}
    comps = interop.comparisons_for(keys)
    gated = {(ref, other) for _, ref, other, g in comps if g}
    assert gated == {(f"ex__{m}__T{n}", f"jax__{m}__T{n}") for m in ("ex", "ex_b35")
                     for n in (128, 512)} | {(f"jax__jax_mul1__T{n}", f"ex__jax_mul1__T{n}")
                                             for n in (128, 512)}
    # every logits file takes part in some comparison
    assert keys <= {k for _, ref, other, _ in comps for k in (ref, other)}
