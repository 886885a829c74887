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

The generate test (``... GENERATE_WORKER ...``) writes a synthetic EXL3 model (dense: 4 query /
2 KV heads of 128, each KV head replicated on the two devices of one process at tp=4; or, slow,
MoE: 4 experts, one per device), and both processes run ``Generator(model, mesh=make_mesh(4))``
on the global mesh: batch generation (two left-padded prompts) and streaming with logits. Their
greedy tokens must equal a single-process, single-device run in the test process, and the
streamed logits must match it within relative L2 1e-5.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = "WORKER"
GENERATE_WORKER = "GENERATE_WORKER"
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
    reports = _collect(_start_workers(WORKER, port, seed, tmp_path), tmp_path)
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


def _start_workers(mode: str, port: int, seed: int, cwd: Path) -> list[subprocess.Popen]:
    """PROCESSES copies of this file as ``mode`` workers, each with LOCAL_DEVICES CPU devices.

    Their output goes to files (cwd/worker{i}.out/.err), not pipes: a worker blocked on a full
    pipe would stall the other one in the next collective (or at shutdown)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = []
    for i in range(PROCESSES):
        with open(cwd / f"worker{i}.out", "w") as out, open(cwd / f"worker{i}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, mode, str(i), str(port), str(seed)], env=env,
                cwd=str(cwd), stdout=out, stderr=err))
    return procs


def _collect(procs: list[subprocess.Popen], cwd: Path, timeout: float = 300) -> list[dict]:
    """Wait for the workers; each must exit 0 and print a JSON report (its last '{' line)."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = []
    for i, p in enumerate(procs):
        out = (cwd / f"worker{i}.out").read_text()
        err = (cwd / f"worker{i}.err").read_text()
        assert p.returncode == 0, (f"worker {i} failed (rc {p.returncode}):\n{out[-3000:]}\n"
                                   f"{err[-6000:]}")
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"worker {i} printed no report:\n{out[-3000:]}\n{err[-3000:]}"
        reports.append(json.loads(lines[-1]))
    return reports


# synthetic models of the generate test: arguments of tests/helpers_models.parallel_model
# (imported in the test, as this module is also the workers' jax-free entry point); every split
# at tp=4 is 128 wide
GENERATE_MODELS = {"dense": ("llama", {}),
                   "moe": ("qwen3_moe", dict(experts=4, expert_intermediate=128))}
NEW_TOKENS = 6


def _generate_all(gen, prompts) -> dict:
    """Greedy batch tokens, and the streamed tokens and per-step logits of prompt 1."""
    import numpy as np
    steps = list(gen.stream(prompts[1], max_new_tokens=NEW_TOKENS, stop_tokens=[],
                            with_logits=True))
    return {"batch": gen.generate(prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens,
            "stream": [t for t, _ in steps], "logits": np.stack([lg for _, lg in steps]).tolist()}


@pytest.mark.parametrize("name", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_two_process_generate_matches_single_process(tmp_path, name):
    """Both processes of a tp=4 mesh (2 processes x 2 CPU devices) generate exactly the greedy
    tokens of one process on one device, and stream the same per-step logits (dense: KV heads
    replicated within each process; moe: expert parallel, one expert per device)."""
    import numpy as np
    from helpers_models import parallel_model, write_models

    from exl3_jax.generate import Generator
    from exl3_jax.models import load_model

    port, seed = _free_port(), int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    rng = np.random.default_rng(seed)
    arch, kwargs = GENERATE_MODELS[name]
    arch, overrides = parallel_model(arch, **kwargs)
    write_models(arch, tmp_path / "model", rng, config_overrides=overrides)
    prompts = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (5, 11)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    procs = _start_workers(GENERATE_WORKER, port, seed, tmp_path)
    # the single-device reference, while the workers run
    want = _generate_all(Generator(load_model(tmp_path / "model" / "exl3", dtype="float32")),
                         prompts)
    assert want["stream"] == want["batch"][1]
    reports = _collect(procs, tmp_path)
    for i, rep in enumerate(reports):
        assert rep["process_index"] == i and rep["global_devices"] == PROCESSES * LOCAL_DEVICES
        assert rep["batch"] == want["batch"], (i, rep["batch"], want["batch"])
        assert rep["stream"] == want["stream"]
        got, ref = np.asarray(rep["logits"]), np.asarray(want["logits"])
        errors = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        print(f"{name}, process {i}: per-step logits rel L2 {errors}")
        assert errors.shape == (NEW_TOKENS,) and errors.max() <= REL_L2


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
    from exl3_jax.ops import stack_w13, trellis_matmul
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
    gate = weight(H, I, lead=(E,), K=4, out_features=200)
    up = weight(H, I, lead=(E,), K=4, out_features=200)
    down = weight(I, H, lead=(E,), in_features=200)
    w13 = stack_w13(gate, up)
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(5)]).astype(np.int32)
    wts = rng.random((5, 2)).astype(np.float32)
    want = jax.jit(lambda x, w13, d, i, w: par.local_moe(x, w13, d, i, w))(
        jnp.asarray(x), local(w13), local(down), jnp.asarray(ids), jnp.asarray(wts))
    want = np.asarray(want, np.float64)
    args = [replicated(mesh, a) for a in (x, ids, wts)]
    g, d = par.shard_experts(mesh, w13, down, layer="model.layers.1.mlp")
    got = jax.jit(lambda x, g, d, i, w: par.ep_moe(mesh, x, g, d, i, w))(
        args[0], g, d, args[1], args[2])
    result["ep_moe"] = report(host(got), want)
    two = par.make_mesh(axes={"tp": 2}, devices=jax.devices()[1:3])   # one device per process
    g, d = par.shard_experts(two, w13, down, layer="model.layers.1.mlp", mode="tensor")
    args = [replicated(two, a) for a in (x, ids, wts)]
    got = jax.jit(lambda x, g, d, i, w: par.tensor_split_moe(two, x, g, d, i, w))(
        args[0], g, d, args[1], args[2])
    result["tensor_split_moe"] = report(host(got), want)

    # rank-sliced checkpoint: process r is rank r of a tp=2 mesh and reads only its own slices
    from exl3_jax.format import TensorStore
    from exl3_jax.format.rank_sliced import RankSlicedCheckpoint
    reads = []
    original_read = TensorStore.read
    TensorStore.read = lambda self, name: reads.append(name) or original_read(self, name)
    rank = jax.process_index()
    ckpt = RankSlicedCheckpoint("ckpt", tp=2, tp_rank=rank)
    w13, down, tiers = par.rank_sliced_layer(two, {rank: ckpt}, 1)
    TensorStore.read = original_read
    inputs = np.load("inputs.npz")
    args = [replicated(two, inputs[k]) for k in ("x", "ids", "wts")]
    got = jax.jit(lambda x, g, d, i, w: par.rank_sliced_moe(two, x, g, d, tiers, i, w))(
        args[0], w13, down, args[1], args[2])
    got = host(got)
    result["rank_sliced_moe"] = dict(report(got, got), output=got.tolist(), reads=len(reads),
                                     foreign_reads=[n for n in reads if f".rank{rank}." not in n])

    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


def _generate_worker(process_id: int, port: int) -> None:
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=PROCESSES, process_id=process_id,
                               initialization_timeout=120)
    from exl3_jax import parallel as par
    from exl3_jax.generate import Generator
    from exl3_jax.models import load_model

    prompts = json.loads(Path("prompts.json").read_text())
    mesh = par.make_mesh(PROCESSES * LOCAL_DEVICES)          # spans both processes
    model = load_model(Path("model") / "exl3", dtype="float32")
    result = _generate_all(Generator(model, mesh=mesh), prompts)
    result.update(process_index=jax.process_index(), global_devices=jax.device_count())
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == WORKER:
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == GENERATE_WORKER:
    _generate_worker(int(sys.argv[2]), int(sys.argv[3]))
