"""The HLO side of scripts/gpu_profile_decode.py (--hlo): a real optimized-HLO dump of a jitted
function with named scopes (XLA:CPU in a child process, dump flags set before it starts),
parsed back into per-fusion scopes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

PROGRAM = """
import jax, jax.numpy as jnp

def _generate(x, w):
    with jax.named_scope("attention"):
        with jax.named_scope("qk_norm_rope"):
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    with jax.named_scope("mlp"):
        return jnp.tanh(y @ w) + 1.0

jax.jit(_generate)(jnp.ones((4, 64)), jnp.ones((64, 32))).block_until_ready()
"""


def test_fusion_scopes_of_a_real_dump(tmp_path):
    from gpu_profile_decode import dumped_fusions, op_scope
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text "
                         "--xla_dump_hlo_module_re=.*generate.*")
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=300)
    fusions = dumped_fusions(str(tmp_path))
    assert fusions, sorted(os.listdir(tmp_path))
    scopes = {sc for f in fusions.values() for sc in f["scopes"]}
    # every fusion is attributed to the scopes above (no tracing plumbing left in the paths)
    assert any(sc.startswith("attention/qk_norm_rope/") for sc in scopes), fusions
    assert all(not sc.startswith(("jit(", "pjit(")) for sc in scopes), scopes
    assert all(f["shape"].startswith(("f32[", "(")) for f in fusions.values()), fusions
    assert all("." not in name and "-" not in name for name in fusions)
    assert op_scope("jit(_generate)/while/body/closed_call/mlp/router/dot_general") == \
        "mlp/router/dot_general"


def test_profile_linear_times_every_call_in_the_timing_loop(monkeypatch):
    # gpu_profile_linear.profile runs bench's timing loop (calls chained through x, weights as
    # loop arguments): the op is traced once per unrolled call and the traced loop runs
    # calls / UNROLL trips; the profiler itself is stubbed (no GPU trace here).
    import jax
    import jax.numpy as jnp
    import numpy as np
    import gpu_profile_linear as gpl
    seen = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    monkeypatch.setattr(gpl, "kernel_times", lambda d: (0, {"k": 8000.0 * 3}, None))
    x = jnp.asarray(np.random.default_rng().standard_normal((3, 8)), jnp.float32)

    def op(v, w):
        seen.append(1)
        jax.debug.callback(lambda: seen.append(2))
        return v @ w
    got = gpl.profile(op, (x, jnp.ones((8, 5), jnp.float32)), 12)
    assert seen.count(1) == gpl.UNROLL                 # traced once per unrolled call
    assert seen.count(2) == 2 * 12                     # warm-up and traced run: every call
    assert got == {"k": round(8000.0 * 3 / 12 / 1e3, 2)}


def test_hlo_kernels_list_fusions_and_custom_calls_with_tuple_results():
    # The probes' kernel list (_gpu_bench_common.hlo_kernels): a real XLA:CPU compile, and GPU
    # HLO lines as XLA prints them, where cuBLAS returns (output, workspace) as a tuple.
    import jax.numpy as jnp
    from _gpu_bench_common import hlo_kernels, kernels_in_hlo
    got = hlo_kernels(lambda a: jnp.sin(a) * 2, jnp.ones((8,)))
    assert got and all(k.startswith("fusion:") for k in got) and "f32[8]{0}" in got[-1]
    text = (
        '  %custom-call.1 = (f32[4096,28672]{1,0}, s8[33554432]{0}) custom-call(f16[4096,8192]'
        '{1,0} %p0, f16[8192,28672]{1,0} %p1), custom_call_target="__cublas$lt$matmul"\n'
        "  ROOT %fusion.2 = f16[4096,8192]{1,0} fusion(bf16[4096,8192]{1,0} %x), kind=kLoop\n"
        "  %add.3 = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)\n")
    assert kernels_in_hlo(text) == [
        "custom-call:__cublas$lt$matmul (f32[4096,28672]{1,0}, s8[33554432]{0})",
        "fusion:kLoop f16[4096,8192]{1,0}"]


def test_loop_probe_forms_and_counts():
    # scripts/gpu_loop_probe.py's loop forms on XLA:CPU: each computes the chained calls'
    # value, and only "none" (no barrier) lets XLA move the weight-only cosine out of the
    # loop body; hlo_counts finds the body's instructions by computation.
    import re

    import jax.numpy as jnp
    import numpy as np
    import gpu_loop_probe as probe
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((1, 16)), jnp.float32)
    rests = [(jnp.asarray(rng.standard_normal((16, 16)), jnp.float32),) for _ in range(2)]

    def op(x, w):
        return x @ jnp.cos(w)
    want = np.asarray(x) @ np.cos(np.asarray(rests[1][0]))     # the last call reads copy 1
    for form in ("call", "none", "trip", "after"):
        loop = probe.loop_of(op, form, 2, 4, 2)
        np.testing.assert_allclose(loop(x, rests), want[0, 0], rtol=1e-5)
        text = loop.lower(x, rests).compile().as_text()
        body = re.search(r"body=%?([\w.\-]+)", text).group(1)
        counts = probe.hlo_counts(text)
        assert counts[body], counts
        in_body = re.search(r"%?" + re.escape(body) + r" [^\n]*\{\n(.*?)\n\}", text, re.S).group(1)
        assert ("cosine" in in_body) == (form != "none"), form
    with pytest.raises(ValueError, match="unknown loop form"):
        probe.loop_of(op, "later", 2, 4, 2)
