"""Checkpoint reading/writing: round trip, legacy signs, quantized embeddings, and bad input."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import ml_dtypes
from exl3_jax.format import (CodebookMarkerError, CorruptFileError, Exl3Checkpoint,
                             Exl3FormatError, Exl3Writer, MissingFileError, MissingTensorError,
                             TensorDtypeError, TensorShapeError, UnsupportedQuantMethodError,
                             marker_as_int32, rate_from_width, width_from_rate)
from exl3_jax.trellis import Exl3Weight, decode_embedding, decode_trellis, pack_ring

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256}


def random_linear(rng, k, n, K):
    return (rng.integers(-32768, 32768, (k // 16, n // 16, width_from_rate(K)), dtype=np.int16),
            rng.standard_normal(k).astype(np.float16), rng.standard_normal(n).astype(np.float16))


@pytest.fixture
def written(tmp_path, rng):
    """A small multi-shard checkpoint and the arrays that went into it."""
    linears = {
        "model.layers.0.self_attn.q_proj": (random_linear(rng, 256, 128, 4), "mcg", True),
        "model.layers.0.mlp.up_proj": (random_linear(rng, 128, 384, 2.5), "mul1", False),
        "lm_head": (random_linear(rng, 256, 256, 6), "3inst", False),
    }
    plain = {"model.embed_tokens.weight":
             rng.standard_normal((64, 256)).astype(ml_dtypes.bfloat16),
             "model.norm.weight": rng.standard_normal(256).astype(np.float32)}
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    out = tmp_path / "model"
    with Exl3Writer(out, CONFIG, max_shard_bytes=40_000) as w:
        for key, ((trellis, suh, svh), cb, bias) in linears.items():
            b = rng.standard_normal(svh.shape).astype(np.float32) if bias else None
            linears[key] = ((trellis, suh, svh), cb, b)
            w.add_linear(key, trellis, suh, svh, cb, bias=b)
        for name, arr in plain.items():
            w.add_tensor(name, arr)
        w.add_file("tokenizer.json", tok)
        w.set_quantization(head_bits=6, calibration={"rows": 0, "cols": 0})
    return out, linears, plain


def test_round_trip(written):
    out, linears, plain = written
    ckpt = Exl3Checkpoint(out)
    assert (out / "model.safetensors.index.json").exists()     # forced into several shards
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert not list(out.parent.glob(".model.partial-*"))
    assert set(ckpt.linears) == set(linears)
    assert sorted(ckpt.plain) == sorted(plain)
    for key, ((trellis, suh, svh), cb, bias) in linears.items():
        info = ckpt.linears[key]
        assert (info.codebook, info.K, info.k, info.n) == (
            cb, rate_from_width(trellis.shape[2]), trellis.shape[0] * 16, trellis.shape[1] * 16)
        got = ckpt.read_linear(key)
        assert np.array_equal(got["trellis"], trellis)
        assert np.array_equal(got["suh"], suh) and np.array_equal(got["svh"], svh)
        if bias is None:
            assert got["bias"] is None
        else:
            assert got["bias"].dtype == np.float16
            assert np.array_equal(got["bias"], bias.astype(np.float16))
        weight = Exl3Weight.from_checkpoint(ckpt, key)
        assert (weight.K, weight.codebook, weight.k, weight.n) == (info.K, cb, info.k, info.n)
        assert np.array_equal(np.asarray(decode_trellis(weight.trellis, cb)).view(np.uint16),
                              np.asarray(decode_trellis(trellis, cb)).view(np.uint16))
    for name, arr in plain.items():
        got = ckpt.read_tensor(name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr)
    qc = ckpt.quantization_config
    assert qc["quant_method"] == "exl3" and qc["head_bits"] == 6
    # body bits: weighted mean over the non-head linears (256*128 at 4, 128*384 at 2.5)
    assert qc["bits"] == round((4 * 256 * 128 + 2.5 * 128 * 384) / (256 * 128 + 128 * 384), 2)
    storage = ckpt.tensor_storage["model.layers.0.self_attn.q_proj"]
    assert storage["quant_format"] == "exl3" and storage["bits_per_weight"] == 4
    assert storage["mcg_multiplier"] == 0xCBAC1FED
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    s = ckpt.summary()
    assert s["linears"] == 3 and s["weights"] == 256 * 128 + 128 * 384 + 256 * 256


def test_writer_is_atomic(tmp_path, rng):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError, match="boom"):
        with Exl3Writer(out, CONFIG, max_shard_bytes=1000) as w:
            w.add_linear("a", *random_linear(rng, 128, 128, 4), "mcg")
            w.add_linear("b", *random_linear(rng, 128, 128, 4), "mcg")   # flushes a shard
            raise RuntimeError("boom")
    assert not out.exists() and os.listdir(tmp_path) == []
    with Exl3Writer(out, CONFIG) as w:
        w.add_linear("a", *random_linear(rng, 128, 128, 4), "mcg")
    with pytest.raises(FileExistsError):
        Exl3Writer(out, CONFIG)
    with Exl3Writer(out, CONFIG, overwrite=True) as w:
        w.add_linear("c", *random_linear(rng, 128, 128, 3), "mul1")
    assert set(Exl3Checkpoint(out).linears) == {"c"}
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_writer_validates_before_writing(tmp_path, rng):
    trellis, suh, svh = random_linear(rng, 128, 128, 4)
    w = Exl3Writer(tmp_path / "m", CONFIG)
    with pytest.raises(TensorShapeError, match="suh"):
        w.add_linear("x", trellis, suh[:64], svh, "mcg")
    with pytest.raises(Exl3FormatError, match="codebook"):
        w.add_linear("x", trellis, suh, svh, "foo")
    with pytest.raises(CodebookMarkerError, match="mul1"):
        w.add_linear("x", *random_linear(rng, 128, 128, 2.5), "mcg")
    w.abort()
    assert not (tmp_path / "m").exists()


def pack_sign_bits(signs):
    """Spec 1.5 by hand: element 16w+b -> bit b of word w, set for -1."""
    words = np.zeros(len(signs) // 16, np.uint16)
    for i, s in enumerate(signs):
        if s < 0:
            words[i // 16] |= np.uint16(1 << (i % 16))
    return words.view(np.int16)


def write_raw(directory, tensors, config=None, quant_method="exl3"):
    """A checkpoint written without the validating writer (to build bad ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIG if config is None else config)
    if quant_method is not None:
        cfg["quantization_config"] = {"quant_method": quant_method, "bits": 4, "head_bits": 6}
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_legacy_su_sv_are_expanded(tmp_path, rng):
    trellis, _, _ = random_linear(rng, 256, 128, 3)
    su = np.where(rng.random(256) < 0.5, -1.0, 1.0).astype(np.float16)
    sv = np.where(rng.random(128) < 0.5, -1.0, 1.0).astype(np.float16)
    d = write_raw(tmp_path / "m", {"l.trellis": trellis, "l.su": pack_sign_bits(su),
                                   "l.sv": pack_sign_bits(sv)})
    ckpt = Exl3Checkpoint(d)
    got = ckpt.read_linear("l")
    assert ckpt.linears["l"].legacy_signs == (True, True)
    assert np.array_equal(got["suh"], su) and np.array_equal(got["svh"], sv)


def mul1_reference(state):
    x = (int(state) * 0x83DCD12D) & 0xFFFFFFFF
    s = sum((x >> (8 * i)) & 0xFF for i in range(4))
    k_inv = np.float32(np.uint16(0x1EEE).view(np.float16))
    k_bias = np.float32(np.uint16(0xC931).view(np.float16))
    return np.float32(np.float32(1024 + s) * k_inv + k_bias).astype(np.float16)


def ring_reference(words, sign, K):
    """exl3_format_165.md 2.1 rotate mode, written out with loops."""
    u = words.view(np.uint16)
    scale = np.float32(u[:1].view(np.float16)[0])
    bit = lambda b: (int(u[1 + b // 16]) >> (b % 16)) & 1
    v = np.zeros(256, np.float32)
    for i in range(256):
        state = sum(bit(((i - m // K) % 256) * K + m % K) << m for m in range(16))
        v[i] = np.float32(mul1_reference(state)) * scale
    h = 1
    while h < 256:
        for i in range(256):
            if not i & h:
                a, b = v[i], v[i | h]
                v[i], v[i | h] = a + b, a - b
        h *= 2
    return (v * np.float32(1 / 16) * sign.astype(np.float32)).astype(np.float16)


def test_quantized_embedding_through_the_reader(tmp_path, rng):
    K, hidden, rows = 3, 300, 5                      # 300 -> G = 2 rings of 256, cut to 300
    groups = 2
    codes = rng.integers(0, 1 << K, (rows, groups, 256))
    scales = (rng.random((rows, groups)) * 0.1).astype(np.float16)
    trellis = np.asarray(pack_ring(codes, scales, K)).reshape(rows, groups * (1 + 16 * K))
    signs = np.where(rng.random((groups, 256)) < 0.5, -1.0, 1.0).astype(np.float16)
    d = write_raw(tmp_path / "m", {"model.embed_tokens.trellis": trellis,
                                   "model.embed_tokens.signs": signs,
                                   "model.norm.weight": np.ones(hidden, np.float16)})
    ckpt = Exl3Checkpoint(d)
    info = ckpt.embeddings["model.embed_tokens"]
    assert (info.K, info.rows, info.groups) == (K, rows, groups)
    assert ckpt.linears == {} and ckpt.plain == ["model.norm.weight"]
    arrays = ckpt.read_embedding("model.embed_tokens")
    got = np.asarray(decode_embedding(arrays["trellis"][[1, 3]], arrays["signs"], hidden))
    for out_row, r in zip(got, [1, 3]):
        ring = trellis[r].reshape(groups, -1)
        want = np.concatenate([ring_reference(ring[g], signs[g], K) for g in range(groups)])
        assert np.array_equal(out_row.view(np.uint16), want[:hidden].view(np.uint16))


def test_ngram_file_is_named_as_unsupported(tmp_path, rng):
    d = write_raw(tmp_path / "m", {"l.trellis": random_linear(rng, 128, 128, 4)[0],
                                   "l.suh": np.ones(128, np.float16),
                                   "l.svh": np.ones(128, np.float16)})
    save_file({"P.trellis": np.zeros((4, 41), np.int16)}, str(d / "ngram_embedding.safetensors"))
    ckpt = Exl3Checkpoint(d)
    assert list(ckpt.linears) == ["l"]             # the n-gram file is not a shard
    with pytest.raises(NotImplementedError, match="ngram_embedding.safetensors"):
        ckpt.read_ngram_table()


# --- bad input: each case must raise its own error naming the file and the tensor ------------

def good_tensors(rng, K=4, marker="mcg"):
    trellis, suh, svh = random_linear(rng, 256, 128, K)
    t = {"m.trellis": trellis, "m.suh": suh, "m.svh": svh}
    if marker:
        t[f"m.{marker}"] = np.array(marker_as_int32(marker), np.int32)
    return t


def mutate(rng, drop=(), **changes):
    t = good_tensors(rng)
    for name in drop:
        del t[name]
    t.update({f"m.{k}": v for k, v in changes.items()})
    return t


BAD_CASES = {
    "missing suh": (lambda r: mutate(r, drop=["m.suh"]), MissingTensorError, "m.suh"),
    "missing svh": (lambda r: mutate(r, drop=["m.svh"]), MissingTensorError, "m.svh"),
    "width 72": (lambda r: mutate(r, trellis=np.zeros((16, 8, 72), np.int16)),
                 TensorShapeError, "72"),
    "width 40 without mul1": (lambda r: mutate(r, trellis=np.zeros((16, 8, 40), np.int16)),
                              CodebookMarkerError, "mul1"),
    "width 20": (lambda r: mutate(r, trellis=np.zeros((16, 8, 20), np.int16)),
                 TensorShapeError, "20"),
    "k not a multiple of 128": (lambda r: dict(mutate(r, trellis=np.zeros((12, 8, 64), np.int16)),
                                               **{"m.suh": np.ones(192, np.float16)}),
                                TensorShapeError, "128"),
    "suh shape": (lambda r: mutate(r, suh=np.ones(128, np.float16)), TensorShapeError, "suh"),
    "svh shape": (lambda r: mutate(r, svh=np.ones(256, np.float16)), TensorShapeError, "svh"),
    "bias shape": (lambda r: mutate(r, bias=np.ones(256, np.float16)), TensorShapeError, "bias"),
    "trellis dtype": (lambda r: mutate(r, trellis=np.zeros((16, 8, 64), np.int32)),
                      TensorDtypeError, "int16"),
    "suh dtype": (lambda r: mutate(r, suh=np.ones(256, np.float32)), TensorDtypeError, "suh"),
    "trellis rank": (lambda r: mutate(r, trellis=np.zeros((16, 512), np.int16)),
                     TensorShapeError, "3-D"),
    "both markers": (lambda r: mutate(r, mul1=np.array(marker_as_int32("mul1"), np.int32)),
                     CodebookMarkerError, "both"),
    "non-standard multiplier": (lambda r: mutate(r, mcg=np.array(12345, np.int32)),
                                CodebookMarkerError, "0x00003039"),
    "marker not a scalar": (lambda r: mutate(r, mcg=np.zeros(2, np.int32)),
                            CodebookMarkerError, "scalar"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_linear_is_rejected(case, tmp_path, rng):
    build, error, fragment = BAD_CASES[case]
    d = write_raw(tmp_path / "m", build(rng))
    with pytest.raises(error, match=fragment) as info:
        Exl3Checkpoint(d)
    assert info.value.file is not None and "model.safetensors" in info.value.file
    assert info.value.tensor is not None and info.value.tensor.startswith("m.")


def test_truncated_safetensors(tmp_path, rng):
    d = write_raw(tmp_path / "m", good_tensors(rng))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CorruptFileError, match="model.safetensors"):
        Exl3Checkpoint(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptFileError, match="model.safetensors"):
        Exl3Checkpoint(d)


def write_sharded(tmp_path, rng):
    d = tmp_path / "m"
    with Exl3Writer(d, CONFIG, max_shard_bytes=20_000) as w:
        for i in range(3):
            w.add_linear(f"l{i}", *random_linear(rng, 256, 128, 4), "mcg")
    return d


def test_missing_shard(tmp_path, rng):
    d = write_sharded(tmp_path, rng)
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(MissingFileError, match=victim.name):
        Exl3Checkpoint(d)


def test_index_names_a_tensor_its_shard_lacks(tmp_path, rng):
    d = write_sharded(tmp_path, rng)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["ghost.weight"] = first
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match="ghost.weight"):
        Exl3Checkpoint(d)


def test_tensor_storage_must_agree_with_the_shards(tmp_path, rng):
    d = write_sharded(tmp_path, rng)
    qc = json.loads((d / "quantization_config.json").read_text())
    qc["tensor_storage"]["l0"]["stored_tensors"]["l0.trellis"]["shape"] = [1, 2, 3]
    (d / "quantization_config.json").write_text(json.dumps(qc))
    with pytest.raises(TensorShapeError, match="l0.trellis"):
        Exl3Checkpoint(d)


@pytest.mark.parametrize("method", ["gptq", None])
def test_unknown_quant_method(method, tmp_path, rng):
    d = write_raw(tmp_path / "m", good_tensors(rng), quant_method=method)
    with pytest.raises(UnsupportedQuantMethodError, match="config.json"):
        Exl3Checkpoint(d)


def test_missing_or_corrupt_config(tmp_path, rng):
    d = write_raw(tmp_path / "m", good_tensors(rng))
    (d / "config.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="config.json"):
        Exl3Checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(MissingFileError, match="config.json"):
        Exl3Checkpoint(d)
    with pytest.raises(MissingFileError):
        Exl3Checkpoint(tmp_path / "nowhere")


def test_staging_dir_removes_only_what_killed_runs_left(tmp_path):
    """Staging directories carry their owner's PID: a new build removes those of processes that
    are gone (and PID-less legacy ones older than a day), never a live build's directory."""
    import subprocess
    import time

    from exl3_jax.format import staging_dir
    dead = subprocess.Popen(["true"])
    dead.wait()
    dest = tmp_path / "model"
    killed = tmp_path / f".model.partial-{dead.pid}-abc123"
    live = tmp_path / f".model.partial-{os.getpid()}-def456"
    legacy_old = tmp_path / ".model.partial-q1w2e3"
    legacy_new = tmp_path / ".model.partial-r4t5y6"
    other = tmp_path / f".other.partial-{dead.pid}-zzz"
    for d in (killed, live, legacy_old, legacy_new, other):
        (d / "sub").mkdir(parents=True)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(legacy_old, (day_ago, day_ago))
    stage = staging_dir(dest)
    assert stage.name.startswith(f".model.partial-{os.getpid()}-") and stage.is_dir()
    assert oct(stage.stat().st_mode & 0o777) == "0o755"
    assert not killed.exists() and not legacy_old.exists()
    assert live.exists() and legacy_new.exists() and other.exists() and not dest.exists()
