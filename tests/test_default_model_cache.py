"""The default model's cache bookkeeping: manifest written last, partial/corrupt builds detected."""

from exl3_jax.quant.default_model import MANIFEST, cache_root, check_manifest, write_manifest


def test_manifest_detects_partial_and_corrupt_directories(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\x01" * 1000)
    assert check_manifest(d) == "no manifest (partial build)"
    write_manifest(d)
    assert check_manifest(d) is None
    data = bytearray((d / "model.safetensors").read_bytes())
    data[500] ^= 0xFF                                   # same size, different content
    (d / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors is corrupt" in check_manifest(d)
    write_manifest(d)
    (d / "config.json").unlink()
    assert check_manifest(d) == "config.json is missing"
    (d / MANIFEST).write_text("{not json")
    assert check_manifest(d) == "unreadable manifest"


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3_JAX_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("EXL3_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "exl3-jax"
