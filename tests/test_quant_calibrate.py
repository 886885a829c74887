"""Hessian capture by running the model layer by layer, against a NumPy Llama forward."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from exl3_jax.quant.calibrate import ModelCalibration, calibration_rows
from exl3_jax.quant.convert import convert_hf
from exl3_jax.format import Exl3Checkpoint
from exl3_jax.trellis import Exl3Weight, dequantize

HIDDEN, HEADS, KV, HEAD_DIM, INTER, VOCAB, LAYERS, EPS, THETA = 160, 2, 1, 64, 192, 97, 2, 1e-5, 1e4


def write_llama(directory, rng):
    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
    t = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[p + "self_attn.q_proj.weight"] = lin(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = lin(KV * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = lin(KV * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
    directory.mkdir(parents=True)
    save_file(t, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "rms_norm_eps": EPS, "rope_theta": THETA, "tie_word_embeddings": True}))
    return t


def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rope(x, pos):
    d = x.shape[-1]
    ang = pos[:, None] / THETA ** (np.arange(0, d, 2) / d)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def layer_inputs(t, i, x):
    """NumPy Llama layer on one row x [T, H]: the inputs of each linear and the output."""
    p = f"model.layers.{i}."
    T = x.shape[0]
    pos = np.arange(T, dtype=np.float64)
    h = rms(x, t[p + "input_layernorm.weight"])
    q = rope((h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, HEADS, HEAD_DIM), pos)
    k = rope((h @ t[p + "self_attn.k_proj.weight"].T).reshape(T, KV, HEAD_DIM), pos)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(T, KV, HEAD_DIM)
    k, v = np.repeat(k, HEADS // KV, 1), np.repeat(v, HEADS // KV, 1)
    a = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM) + np.triu(np.full((T, T), -1e30), 1)
    a = np.exp(a - a.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", a, v).reshape(T, HEADS * HEAD_DIM)
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    h2 = rms(x, t[p + "post_attention_layernorm.weight"])
    g, u = h2 @ t[p + "mlp.gate_proj.weight"].T, h2 @ t[p + "mlp.up_proj.weight"].T
    act = g / (1 + np.exp(-g)) * u
    x = x + act @ t[p + "mlp.down_proj.weight"].T
    return {"self_attn.q_proj": h, "self_attn.o_proj": o, "mlp.gate_proj": h2,
            "mlp.down_proj": act}, x


def test_calibration_captures_hessians_and_advances_through_quantized_layers(tmp_path, rng):
    from exl3_jax.models.decoder import load_model

    t = {k: v.astype(np.float64) for k, v in write_llama(tmp_path / "hf", rng).items()}
    tokens = calibration_rows(rng.integers(0, VOCAB, 2 * 24 + 5).tolist(), 24)   # 2 rows of 24
    calib = ModelCalibration(load_model(tmp_path / "hf", dtype="float32"), tokens)

    xs = [t["model.embed_tokens.weight"][row] for row in tokens]
    for layer in range(LAYERS):
        per_row = [layer_inputs(t, layer, x) for x in xs]
        for path in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            X = np.concatenate([inputs[path] for inputs, _ in per_row])
            h, count = calib.hessian(f"model.layers.{layer}.{path}")
            assert count == tokens.size
            np.testing.assert_allclose(h, X.T @ X, rtol=2e-4, atol=2e-4 * np.abs(X.T @ X).max())
        # q/k/v share their input, and so do gate/up
        for a, b in (("q_proj", "k_proj"), ("q_proj", "v_proj")):
            assert np.array_equal(calib.hessian(f"model.layers.{layer}.self_attn.{a}")[0],
                                  calib.hessian(f"model.layers.{layer}.self_attn.{b}")[0])
        # quantize the layer with random trellis weights; the reference swaps in the same W
        quantized = {}
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            key = f"model.layers.{layer}.{path}"
            out_f, in_f = t[key + ".weight"].shape
            k, n = -(-in_f // 128) * 128, -(-out_f // 128) * 128
            w = Exl3Weight.create(rng.integers(-32768, 32768, (k // 16, n // 16, 48),
                                               dtype=np.int16),
                                  (rng.standard_normal(k) / np.sqrt(k)).astype(np.float16),
                                  (rng.standard_normal(n) * 0.5).astype(np.float16), "mcg",
                                  in_features=in_f, out_features=out_f)
            quantized[key] = w
            W = np.asarray(dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64)
            t[key + ".weight"] = W[:in_f, :out_f].T
        calib.layer_done(layer, quantized)
        xs = [layer_inputs(t, layer, x)[1] for x in xs]
        np.testing.assert_allclose(np.asarray(calib._x, np.float64), np.stack(xs), rtol=0,
                                   atol=1e-3 * max(np.abs(x).max() for x in xs))
    h, count = calib.hessian("lm_head")
    X = np.concatenate([rms(x, t["model.norm.weight"]) for x in xs])
    np.testing.assert_allclose(h, X.T @ X, rtol=1e-3, atol=1e-3 * np.abs(X.T @ X).max())


@pytest.mark.slow
def test_convert_with_calibration_end_to_end(tmp_path, rng):
    from exl3_jax.models.decoder import load_model

    write_llama(tmp_path / "hf", rng)
    tokens = calibration_rows(rng.integers(0, VOCAB, 3 * 32).tolist(), 32)
    calib = ModelCalibration(load_model(tmp_path / "hf", dtype="float32"), tokens)
    reports = convert_hf(tmp_path / "hf", tmp_path / "exl3", bits=4, head_bits=6,
                         codebook="mcg", mode="fast", hessians=calib)
    ckpt = Exl3Checkpoint(tmp_path / "exl3")
    assert len(ckpt.linears) == 7 * LAYERS + 1
    assert ckpt.quantization_config["encoder"]["hessian"] == "ModelCalibration"
    assert all(r.info.proxy_error < 0.05 for r in reports), [r.info.proxy_error for r in reports]
