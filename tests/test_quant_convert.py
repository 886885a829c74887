"""HF safetensors -> EXL3 conversion (exl3_jax.quant.convert, `exl3-jax quantize`) on tiny random
Qwen3-style models the tests write themselves."""

import json
import secrets

import numpy as np
import pytest
from safetensors.numpy import save_file

from exl3_jax.cli import main
from exl3_jax.format import Exl3Checkpoint, TensorStore
from exl3_jax.quant.convert import convert_hf, plan
from exl3_jax.trellis import Exl3Weight, dequantize

# the reference encoder's relative tile MSE (spec 6.5); relative weight error ~ its square root
MSE_MEASURED = {2: 0.070, 3: 0.018}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_tiny_model(directory, rng, *, hidden=96, inter=160, vocab=200, layers=1, mlp=True,
                     head_dim=64, heads=2, kv_heads=1, tied=True, kv=True):
    """A random Qwen3-like HF checkpoint: dims that are not multiples of 128 (padding path),
    a q_proj bias, q/k norms, tied embeddings (no lm_head.weight). Returns name -> array.
    mlp=False / kv=False leave out the MLP / k_proj and v_proj (fewer linears, faster tests)."""
    def lin(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)

    t = {"model.embed_tokens.weight": lin(vocab, hidden),
         "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = lin(heads * head_dim, hidden)
        t[p + "self_attn.q_proj.bias"] = (0.1 * rng.standard_normal(heads * head_dim)).astype(
            np.float32)
        if kv:
            t[p + "self_attn.k_proj.weight"] = lin(kv_heads * head_dim, hidden)
            t[p + "self_attn.v_proj.weight"] = lin(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = lin(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        if mlp:
            t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
            t[p + "mlp.gate_proj.weight"] = lin(inter, hidden)
            t[p + "mlp.up_proj.weight"] = lin(inter, hidden)
            t[p + "mlp.down_proj.weight"] = lin(hidden, inter)
    if not tied:
        t["lm_head.weight"] = lin(vocab, hidden)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "vocab_size": vocab, "tie_word_embeddings": tied,
              "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    return t


def rel_fro(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_plan_finds_the_linears_in_layer_order(tmp_path, rng):
    write_tiny_model(tmp_path, rng, layers=2, tied=True)
    jobs, plain = plan(TensorStore(tmp_path), bits=3, head_bits=5)
    expected = [f"model.layers.{i}.{g}.{n}" for i in range(2)
                for g, names in (("self_attn", ATTN), ("mlp", MLP)) for n in names]
    assert [j.key for j in jobs] == expected + ["lm_head"]
    assert [j.K for j in jobs] == [3] * len(expected) + [5]
    head = jobs[-1]
    assert head.source == "model.embed_tokens.weight" and head.shape == (96, 200)  # (in, out)
    assert jobs[0].shape == (96, 128) and jobs[6].shape == (160, 96)              # q, down
    # q/k/v share an input (one qmap, same sign flips); gate/up share another; o and down own one
    qmaps = [j.qmap for j in jobs[:7]]
    assert qmaps[0] == qmaps[1] == qmaps[2] and qmaps[4] == qmaps[5]
    assert len(set(qmaps)) == 4 and jobs[7].qmap != qmaps[0]
    assert "model.layers.0.self_attn.q_proj.bias" not in plain                    # goes with q
    assert "model.embed_tokens.weight" in plain
    assert "model.layers.1.mlp.gate_proj.weight" not in plain
    assert plan(TensorStore(tmp_path), bits=3, head_bits=16)[0][-1].key != "lm_head"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion through the CLI (K=2 body, K=3 head, fast mode), shared by the tests.
    Attention only: the MLP goes through the same code (see the plan test) and would double the
    time."""
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    root = tmp_path_factory.mktemp("convert")
    src, out = root / "hf", root / "exl3"
    tensors = write_tiny_model(src, np.random.default_rng(seed), mlp=False)
    rc = main(["quantize", str(src), str(out), "--bits", "2", "--head-bits", "3", "--fast",
               "--codebook", "mcg"])
    assert rc == 0
    return src, out, tensors


def test_checkpoint_layout(converted):
    src, out, tensors = converted
    ckpt = Exl3Checkpoint(out)
    body = {f"model.layers.0.self_attn.{n}" for n in ATTN}
    assert set(ckpt.linears) == body | {"lm_head"}
    assert all(ckpt.linears[k].K == 2 and ckpt.linears[k].codebook == "mcg" for k in body)
    assert ckpt.linears["lm_head"].K == 3
    qc = ckpt.quantization_config
    assert qc["quant_method"] == "exl3" and qc["bits"] == 2 and qc["head_bits"] == 3
    assert qc["codebook"] == "mcg" and qc["encoder"]["mode"] == "fast"
    assert ckpt.config["tie_word_embeddings"] is False
    storage = ckpt.tensor_storage
    assert storage["lm_head"]["bits_per_weight"] == 3
    assert storage["model.layers.0.self_attn.q_proj"]["mcg_multiplier"] == 0xCBAC1FED
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    # plain tensors: copied, fp32 -> fp16; no stray lm_head.weight and no leftover staging dir
    emb = ckpt.read_tensor("model.embed_tokens.weight")
    assert emb.dtype == np.float16
    np.testing.assert_array_equal(emb, tensors["model.embed_tokens.weight"].astype(np.float16))
    assert "model.layers.0.self_attn.q_norm.weight" in ckpt.plain
    assert "lm_head.weight" not in ckpt.plain
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_linears_approximate_the_source(converted):
    _, out, tensors = converted
    ckpt = Exl3Checkpoint(out)
    for key in ckpt.linears:
        source = tensors["model.embed_tokens.weight" if key == "lm_head" else key + ".weight"]
        q = Exl3Weight.from_checkpoint(ckpt, key)
        full = np.asarray(dequantize(q.trellis, q.suh, q.svh, q.codebook))
        w = full[:source.shape[1], :source.shape[0]]              # (in, out) vs HF (out, in)
        K = ckpt.linears[key].K
        err = rel_fro(w, source.T)
        assert 0.5 * np.sqrt(MSE_MEASURED[K]) < err < 1.35 * np.sqrt(MSE_MEASURED[K]), (key, err)
        assert np.all(full[:, source.shape[0]:] == 0.0)           # padded outputs are exact 0
    bias = ckpt.read_linear("model.layers.0.self_attn.q_proj")["bias"]
    np.testing.assert_array_equal(bias, tensors["model.layers.0.self_attn.q_proj.bias"]
                                  .astype(np.float16))


class RecordingHessians:
    """A calibration stand-in: the Hessian of random correlated inputs for q_proj, none
    elsewhere (keeps the test fast; LDLQ itself is tested in test_quant_ldlq); records calls."""

    def __init__(self, rng, hidden):
        x = rng.standard_normal((256, hidden)) @ rng.standard_normal((hidden, hidden))
        self.h = (x.T @ x, 256)
        self.calls = []

    def hessian(self, key):
        self.calls.append(("hessian", key))
        return self.h if key.endswith("q_proj") else None

    def layer_done(self, layer, quantized):
        self.calls.append(("layer_done", layer, sorted(quantized)))


def test_hessian_provider_plugs_in(tmp_path, rng):
    src, out = tmp_path / "hf", tmp_path / "exl3"
    write_tiny_model(src, rng, hidden=64, layers=2, mlp=False, tied=False, heads=1, kv=False)
    provider = RecordingHessians(rng, 64)
    reports = convert_hf(src, out, bits=2, head_bits=16, mode="fast", hessians=provider)
    keys = [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_proj", "o_proj")]
    assert [r.key for r in reports] == keys
    assert [r.info.used_hessian for r in reports] == [True, False] * 2
    assert provider.calls == ([("hessian", k) for k in keys[:2]]
                              + [("layer_done", 0, sorted(keys[:2]))]
                              + [("hessian", k) for k in keys[2:]]
                              + [("layer_done", 1, sorted(keys[2:]))])
    ckpt = Exl3Checkpoint(out)
    assert "lm_head" not in ckpt.linears and "lm_head.weight" in ckpt.plain    # head_bits 16
    assert ckpt.quantization_config["head_bits"] == 16


def test_failed_conversion_leaves_nothing(tmp_path, rng):
    src, out = tmp_path / "hf", tmp_path / "exl3"
    write_tiny_model(src, rng, hidden=64, mlp=False)

    class Broken(RecordingHessians):
        def hessian(self, key):
            raise RuntimeError("calibration failed")

    with pytest.raises(RuntimeError, match="calibration failed"):
        convert_hf(src, out, bits=2, hessians=Broken(rng, 64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_rich_progress_prints_a_line_per_layer_off_terminal(tmp_path, rng):
    """Piped to a file (no terminal, no notebook) rich draws no live bars: the progress sink
    then prints one line per finished layer, and the last one reports every tile done."""
    import io

    from rich.console import Console

    from exl3_jax.quant.convert import RichProgress
    buf = io.StringIO()
    progress = RichProgress(console=Console(file=buf, force_terminal=False,
                                            force_jupyter=False, width=200))
    src, out = tmp_path / "hf", tmp_path / "exl3"
    write_tiny_model(src, rng, hidden=64, mlp=False, kv=False, vocab=64)
    convert_hf(src, out, bits=2, head_bits=2, mode="fast", progress=progress)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("layer ")]
    total = int(lines[0].split()[1].split("/")[1])
    assert [int(ln.split()[1].split("/")[0]) for ln in lines] == list(range(1, total + 1))
    done, all_tiles = lines[-1].split(": ")[1].split()[0].split("/")
    assert 0 < int(done) <= int(all_tiles)
    assert "eta" in lines[-1]
