"""The default model's cache bookkeeping: manifest written last, partial/corrupt builds detected,
one build at a time per cache root."""

import threading
import time

from exl3_jax.quant import default_model as dm
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


def test_concurrent_first_uses_build_once(tmp_path, monkeypatch):
    """Two callers racing on an empty cache (two terminals, two pytest-xdist workers): the
    second waits on the build lock and takes the first one's model; nothing is built twice."""
    builds = []

    def fake_build(root, out, text, *args):      # the real one quantizes for ~15 minutes
        builds.append(threading.get_ident())
        time.sleep(0.5)                          # both callers have passed the unlocked check
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(bytes(range(256)))
        write_manifest(out)

    monkeypatch.setattr(dm, "_build_default_model", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(builds) == 1, builds
    assert len(results) == 2 and results[0] == results[1]
    assert check_manifest(results[0]) is None
