"""Ahead-of-time kernels wired into the dispatch (CPU only: export + lowering, no GPU run).

scripts/build_aot.py exports two small linears (decode and prefill plan) for sm_90a in a child
process; the tests check the manifest and artifacts, that EXL3_JAX_AOT_DIR makes
ops.trellis_matmul lower to the artifacts for CUDA in a process that cannot import the CuTe
compiler, and that the lookup key rejects every mismatch (shape, dtype, bias, plan, arch).
"""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax.ffi import aot
from exl3_jax.trellis import Exl3Weight

ROOT = Path(__file__).resolve().parents[1]
K_IN, N_OUT, RATE, CB = 256, 384, 2, "mcg"
MS = (1, 40, 300)              # a decode-, a wgmma- (sm_90a, 25 <= m <= 256 here) and a
                               # prefill-plan artifact
HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
pytestmark = pytest.mark.skipif(not HAVE_CUTLASS, reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def aot_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    env = dict(os.environ)
    env.pop(aot.AOT_DIR_ENV, None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_aot.py"), "--out", str(out), "--arch",
         "sm_90a", "--linears", f"{K_IN}x{N_OUT}:{RATE}:{CB}", "--m", ",".join(map(str, MS)),
         "--x-dtype", "float16"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def fresh_sets(monkeypatch):
    monkeypatch.setattr(aot, "_SETS", {})
    monkeypatch.setenv(aot.ARCH_ENV, "sm_90a")


def weight(bias: bool = False, codebook: str = CB) -> Exl3Weight:
    return Exl3Weight.create(jnp.zeros((K_IN // 16, N_OUT // 16, 16 * RATE), jnp.int16),
                             jnp.ones((K_IN,), jnp.float16), jnp.ones((N_OUT,), jnp.float16),
                             codebook,
                             bias=jnp.zeros((N_OUT,), jnp.float16) if bias else None)


def test_manifest_and_artifacts(aot_dir, monkeypatch):
    monkeypatch.setenv(aot.ARCH_ENV, "sm_90a")           # the plans of the artifacts' arch
    rows = json.loads((aot_dir / "manifest.json").read_text())
    assert sorted(r["m"] for r in rows) == list(MS)
    for r in rows:
        plan = aot.resolve_plan(r["m"], K_IN, N_OUT)
        assert r["arch"] == "sm_90a" and 90 in r["sms"], r
        assert r["plan"] == dataclasses.asdict(plan)
        assert r["plan"]["kind"] == {1: "decode", 40: "wgmma", 300: "prefill"}[r["m"]]
        assert r["key"] == aot.linear_key(K_IN, N_OUT, RATE, CB, r["m"], jnp.float16, False,
                                          plan)
        exp = aot.load(str(aot_dir / r["file"]))
        assert exp.platforms == ("cuda",)
        assert [(a.shape, a.dtype) for a in exp.in_avals] == [
            ((r["m"], K_IN), jnp.float16), ((K_IN // 16, N_OUT // 16, 16 * RATE), jnp.int16),
            ((K_IN,), jnp.float16), ((N_OUT,), jnp.float16)]
        assert [(a.shape, a.dtype) for a in exp.out_avals] == [((r["m"], N_OUT), jnp.float32)]
        # had_in, GEMM (wgmma), had_out; the prefill plan: the dequantize kernel alone (the
        # rotations folded into the weight; XLA's dot is no custom call); one token: the row
        # linear (ffi/trellis_linear.py), one call
        calls = {"wgmma": 3, "prefill": 1, "decode": 1}[r["plan"]["kind"]]
        assert exp.mlir_module().count(aot.CUSTOM_CALL_PREFIX) == calls


LOWER_WITHOUT_CUTLASS = """
import json, sys
sys.path[:] = [p for p in sys.path if "dsl_packages" not in p]   # CuTe DSL not importable
import jax, jax.numpy as jnp
from jax import export
from exl3_jax.ffi import aot
from exl3_jax.ops import trellis_matmul
from exl3_jax.trellis import Exl3Weight
K_IN, N_OUT, RATE = {k}, {n}, {K}
checks = [export.DisabledSafetyCheck.custom_call(t) for t in aot._RUNTIME_TARGETS_V2]

def f(x, trellis, suh, svh):
    w = Exl3Weight(trellis, suh, svh, None, "{cb}", RATE, K_IN, N_OUT - 10)
    return trellis_matmul(x.astype(jnp.float16), w, backend="gpu")

def lower(lead):
    sds = jax.ShapeDtypeStruct
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
        sds((*lead, K_IN - 56), jnp.bfloat16), sds((K_IN // 16, N_OUT // 16, 16 * RATE), jnp.int16),
        sds((K_IN,), jnp.float16), sds((N_OUT,), jnp.float16))
    return exp.mlir_module().count(aot.CUSTOM_CALL_PREFIX), exp.out_avals[0].shape

out = dict(decode=lower((1,)), wgmma=lower((5, 8)), prefill=lower((5, 60)))
try:
    lower((2,))
    out["miss"] = "no error"
except RuntimeError as e:
    out["miss"] = str(e)
arts = aot.artifacts()
out.update(hits=sum(arts.hits.values()), misses=sum(arts.misses.values()),
           cutlass="cutlass" in sys.modules)
print("RESULT " + json.dumps(out))
"""


def test_dispatch_lowers_to_artifacts_without_cutlass(aot_dir):
    # With EXL3_JAX_AOT_DIR the dispatch op (what Exl3Linear calls) lowers for CUDA from the
    # artifacts alone: padded input (200 -> 256) and trimmed output, leading axes flattened to
    # m = 1 (decode), m = 40 (wgmma) and m = 300 (prefill); an m with no artifact is a clear
    # error naming the export command, since the process cannot compile kernels.
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUTE_DSL_ARCH="sm_90a",
               **{aot.AOT_DIR_ENV: str(aot_dir)})
    code = LOWER_WITHOUT_CUTLASS.format(k=K_IN, n=N_OUT, K=RATE, cb=CB)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    assert out["decode"] == [1, [1, N_OUT - 10]]        # m = 1: the row linear's one call
    assert out["wgmma"] == [3, [5, 8, N_OUT - 10]]       # 4 K-splits: had_in, GEMM, had_out
    assert out["prefill"] == [1, [5, 60, N_OUT - 10]]    # dequantize, rotations folded in
    assert "build_aot.py" in out["miss"] and "m=2|" in out["miss"] and "--m 2" in out["miss"]
    assert (out["hits"], out["misses"], out["cutlass"]) == (3, 1, False)


def test_lookup_rejects_every_mismatch(aot_dir, fresh_sets, monkeypatch):
    monkeypatch.setenv(aot.AOT_DIR_ENV, str(aot_dir))
    no_jit = lambda: False                                        # noqa: E731
    x = jax.ShapeDtypeStruct((1, K_IN), jnp.float16)
    plan = aot.resolve_plan(1, K_IN, N_OUT)
    hit = aot.lookup_linear(x, weight(), plan, "cute", jit_ok=no_jit)
    assert hit is not None and hit.in_avals[0].shape == (1, K_IN)
    misses = [
        (jax.ShapeDtypeStruct((1, K_IN), jnp.bfloat16), weight(), plan, "cute"),
        (x, weight(bias=True), plan, "cute"),
        (x, weight(), plan, "xla"),
        (x, weight(codebook="mul1"), plan, "cute"),
        (x, weight(), dataclasses.replace(plan, unroll=1), "cute"),
        (jax.ShapeDtypeStruct((3, K_IN), jnp.float16), weight(), aot.resolve_plan(3, K_IN, N_OUT),
         "cute"),
    ]
    for args in misses:
        with pytest.raises(RuntimeError, match="no AOT artifact"):
            aot.lookup_linear(*args, jit_ok=no_jit)
    with pytest.warns(UserWarning, match="compiling just in time"):
        assert aot.lookup_linear(*misses[0], jit_ok=lambda: True) is None
    arts = aot.artifacts()
    assert sum(arts.hits.values()) == 1 and sum(arts.misses.values()) == len(misses) + 1


def test_arch_and_configuration(aot_dir, fresh_sets, monkeypatch, tmp_path):
    # Only artifacts of the device's arch are visible; no directory configured = no lookup.
    monkeypatch.delenv(aot.AOT_DIR_ENV, raising=False)
    x = jax.ShapeDtypeStruct((1, K_IN), jnp.float16)
    plan = aot.resolve_plan(1, K_IN, N_OUT)
    assert aot.artifacts() is None
    assert aot.lookup_linear(x, weight(), plan, "cute", jit_ok=lambda: False) is None
    other = tmp_path / "other"
    shutil.copytree(aot_dir, other)
    rows = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps([dict(r, arch="sm_120a") for r in rows]))
    monkeypatch.setenv(aot.AOT_DIR_ENV, str(other))
    assert aot.artifacts().files == {}
    monkeypatch.setenv(aot.ARCH_ENV, "sm_120a")
    assert len(aot.artifacts().files) == len(MS)
    monkeypatch.setenv(aot.AOT_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        aot.artifacts()
    with pytest.raises(RuntimeError, match="unset"):
        aot.export_linear(K_IN, N_OUT, RATE, CB, 1)


def test_linear_key_fields():
    plan = aot.resolve_plan(16, 4096, 14336)
    base = dict(k=4096, n=14336, K=3, codebook="mcg", m=16, x_dtype=jnp.float16, bias=False,
                plan=plan, transforms="cute")
    key = aot.linear_key(**base)
    variants = [dict(k=2048), dict(n=4096), dict(K=4), dict(codebook="mul1"), dict(m=8),
                dict(x_dtype=jnp.bfloat16), dict(bias=True), dict(transforms="xla"),
                dict(plan=dataclasses.replace(plan, splits=plan.splits * 2))]
    keys = {aot.linear_key(**dict(base, **v)) for v in variants}
    assert key not in keys and len(keys) == len(variants)
    assert aot.linear_key(**dict(base, x_dtype=np.dtype("float16"))) == key
