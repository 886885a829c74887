"""Multi-process tensor/expert parallelism: two processes on localhost with jax.distributed (CPU).

The test starts this file twice as a worker (``python test_parallel_distributed.py WORKER ...``),
each process with 2 simulated CPU devices, so the mesh spans 4 devices in 2 processes. Each worker
builds the same random weights from a shared seed, runs the tensor-parallel MLP and the
expert-parallel MoE through the global mesh (psum across processes over gloo), checks the result
against its own unsharded single-device computation, and prints a JSON line with a digest of the
outputs; the test requires both workers to succeed and agree. Finally each process opens a
rank-sliced checkpoint (written by the test) as its own rank of a tp=2 mesh, reads only its own
slices, and the two run the rank-sliced MoE together; the test checks the output against a
float64 loop over the full (unsliced) experts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = "WORKER"
PROCESSES = 2
LOCAL_DEVICES = 2
REL_L2 = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_tensor_and_expert_parallel(tmp_path):
    import numpy as np
    write_rank_sliced_checkpoint = _sibling_test_module().write_rank_sliced_checkpoint

    port, seed = _free_port(), int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    rng = np.random.default_rng(seed)
    _, experts = write_rank_sliced_checkpoint(tmp_path / "ckpt", rng, ks=(3, 4, 4, 3))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int32)
    wts = rng.random((5, 2)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", x=x, ids=ids, wts=wts)
    want = _moe_loop(x, ids, wts, experts)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = [subprocess.Popen([sys.executable, __file__, WORKER, str(i), str(port), str(seed)],
                              env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(PROCESSES)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = []
    for i, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"worker {i} failed (rc {rc}):\n{out[-3000:]}\n{err[-6000:]}"
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"worker {i} printed no report:\n{out}\n{err[-3000:]}"
        reports.append(json.loads(lines[-1]))
    for i, rep in enumerate(reports):
        assert rep["process_index"] == i and rep["process_count"] == PROCESSES
        assert rep["global_devices"] == PROCESSES * LOCAL_DEVICES
        assert rep["local_devices"] == LOCAL_DEVICES
        for name in ("mlp", "column_gather", "ep_moe", "tensor_split_moe"):
            assert rep[name]["rel_l2"] <= REL_L2, (i, name, rep[name])
        rank_sliced = np.asarray(rep["rank_sliced_moe"]["output"])
        assert float(np.linalg.norm(rank_sliced - want) / np.linalg.norm(want)) <= REL_L2
        assert rep["rank_sliced_moe"]["reads"] > 0
        assert rep["rank_sliced_moe"]["foreign_reads"] == [], rep["rank_sliced_moe"]
    for name in ("mlp", "column_gather", "ep_moe", "tensor_split_moe", "rank_sliced_moe"):
        assert reports[0][name]["digest"] == reports[1][name]["digest"]


def _sibling_test_module():
    """tests/test_parallel.py as a module (already imported by pytest, or loaded from its file)."""
    import importlib.util
    module = sys.modules.get("test_parallel")
    if module is None or not hasattr(module, "write_rank_sliced_checkpoint"):
        path = Path(__file__).with_name("test_parallel.py")
        spec = importlib.util.spec_from_file_location("_exl3_jax_test_parallel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _moe_loop(x, ids, wts, experts):
    """float64 reference: sum over routes of w * down(silu(gate x) * up x), full experts."""
    import jax
    import numpy as np

    from exl3_jax.trellis import dequantize
    deq = jax.jit(dequantize, static_argnums=3)
    dense = [[np.asarray(deq(w.trellis, w.suh, w.svh, w.codebook), np.float64) for w in ws]
             for ws in experts]
    X = np.asarray(x, np.float64)
    out = np.zeros((X.shape[0], dense[0][2].shape[1]))
    for t in range(X.shape[0]):
        for e, w in zip(ids[t], wts[t]):
            g, u, d = (X[t] @ dense[e][0], X[t] @ dense[e][1], dense[e][2])
            out[t] += float(w) * ((g / (1 + np.exp(-g)) * u) @ d)
    return out


# -------------------------------------------------------------------------------------------
# worker

def _worker(process_id: int, port: int, seed: int) -> None:
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=PROCESSES, process_id=process_id,
                               initialization_timeout=120)
    import hashlib

    import jax.numpy as jnp
    import numpy as np

    from exl3_jax import parallel as par
    from exl3_jax.ops import combine_matrix, trellis_matmul
    from exl3_jax.trellis import Exl3Weight

    rng = np.random.default_rng(seed)                  # same weights in every process

    def weight(k, n, *, lead=(), K=3, **logical):
        return Exl3Weight.create(
            rng.integers(-32768, 32768, lead + (k // 16, n // 16, 16 * K), dtype=np.int16),
            (rng.standard_normal(lead + (k,)) * 0.1).astype(np.float16),
            (rng.standard_normal(lead + (n,)) * 0.1).astype(np.float16), "mcg", **logical)

    def local(w):                                      # the same weight on this process' device
        return jax.tree.map(jnp.asarray, w)

    def replicated(mesh, x):
        return par.put_global(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def host(y):                                       # a global result, as numpy
        return par.to_host(y).astype(np.float64)

    def report(got, want):
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        return {"rel_l2": rel, "digest": hashlib.sha256(got.astype(np.float32).tobytes())
                .hexdigest()}

    mesh = par.make_mesh(PROCESSES * LOCAL_DEVICES)
    result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "global_devices": jax.device_count(), "local_devices": jax.local_device_count()}

    H, I = 256, 512
    gate, up = weight(H, I, out_features=500), weight(H, I, out_features=500, K=4)
    down = weight(I, H, in_features=500)
    x = rng.standard_normal((5, H)).astype(np.float32)
    want = jax.jit(lambda x, g, u, d: trellis_matmul(
        jax.nn.silu(trellis_matmul(x, g)) * trellis_matmul(x, u), d))(
        jnp.asarray(x), local(gate), local(up), local(down))
    g, u, d = par.shard_mlp(mesh, gate, up, down, layer="model.layers.0.mlp")
    got = jax.jit(lambda *a: par.tp_mlp(mesh, *a))(replicated(mesh, x), g, u, d)
    result["mlp"] = report(host(got), np.asarray(want, np.float64))
    # a sharded (not replicated) global result, gathered across the two processes
    blocks = jax.jit(lambda *a: par.tp_column_linear(mesh, *a, gather=False))(
        replicated(mesh, x), g)
    assert not blocks.is_fully_addressable and not blocks.is_fully_replicated
    gate_out = jax.jit(trellis_matmul)(jnp.asarray(x), local(gate))
    result["column_gather"] = report(host(blocks)[:, :500], np.asarray(gate_out, np.float64))

    E, I = 8, 256
    gate = weight(H, I, lead=(E,), out_features=200)
    up = weight(H, I, lead=(E,), K=4, out_features=200)
    down = weight(I, H, lead=(E,), in_features=200)
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(5)]).astype(np.int32)
    wts = rng.random((5, 2)).astype(np.float32)
    want = jax.jit(lambda x, g, u, d, c: par.local_moe(x, g, u, d, c))(
        jnp.asarray(x), local(gate), local(up), local(down),
        combine_matrix(jnp.asarray(ids), jnp.asarray(wts), E))
    want = np.asarray(want, np.float64)
    args = [replicated(mesh, a) for a in (x, ids, wts)]
    g, u, d = par.shard_experts(mesh, gate, up, down, layer="model.layers.1.mlp")
    got = jax.jit(lambda x, g, u, d, i, w: par.ep_moe(mesh, x, g, u, d, i, w))(
        args[0], g, u, d, args[1], args[2])
    result["ep_moe"] = report(host(got), want)
    two = par.make_mesh(axes={"tp": 2}, devices=jax.devices()[1:3])   # one device per process
    g, u, d = par.shard_experts(two, gate, up, down, layer="model.layers.1.mlp", mode="tensor")
    args = [replicated(two, a) for a in (x, ids, wts)]
    got = jax.jit(lambda x, g, u, d, i, w: par.tensor_split_moe(two, x, g, u, d, i, w))(
        args[0], g, u, d, args[1], args[2])
    result["tensor_split_moe"] = report(host(got), want)

    # rank-sliced checkpoint: process r is rank r of a tp=2 mesh and reads only its own slices
    from exl3_jax.format import TensorStore
    from exl3_jax.format.rank_sliced import RankSlicedCheckpoint
    reads = []
    original_read = TensorStore.read
    TensorStore.read = lambda self, name: reads.append(name) or original_read(self, name)
    rank = jax.process_index()
    ckpt = RankSlicedCheckpoint("ckpt", tp=2, tp_rank=rank)
    gate, up, down, tiers = par.rank_sliced_layer(two, {rank: ckpt}, 1)
    TensorStore.read = original_read
    inputs = np.load("inputs.npz")
    args = [replicated(two, inputs[k]) for k in ("x", "ids", "wts")]
    got = jax.jit(lambda x, g, u, d, i, w: par.rank_sliced_moe(two, x, g, u, d, tiers, i, w))(
        args[0], gate, up, down, args[1], args[2])
    got = host(got)
    result["rank_sliced_moe"] = dict(report(got, got), output=got.tolist(), reads=len(reads),
                                     foreign_reads=[n for n in reads if f".rank{rank}." not in n])

    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == WORKER:
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
