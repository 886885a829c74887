"""Tensor/expert-parallel generation, ``Generator(model, mesh=...)``, on simulated CPU devices.

The synthetic models of tests/test_parallel_model.py, in fp32: by default two one-layer models
(dense with 1 KV head, replicated at tp=2; MoE with 4 experts, expert parallel at tp=2); with
EXL3_JAX_SLOW=1 also the dense llama-like model (2 KV heads, split at tp=2, replicated at tp=4)
and the qwen3_moe-like model (8 experts, top-2; expert parallel at tp=2/4, tensor-split at
tp=2). Against the single-device ``Generator(model)``:
* greedy batch generation (two left-padded prompts of different lengths, prefill + the jitted
  decode loop) gives identical tokens;
* streaming (jitted prefill, then one jitted decode step per token on the sharded KV cache)
  gives identical tokens and every step's logits within relative L2 1e-5;
* the decode step compiles once (not per step), and a second batch with the same buckets
  reuses the compiled generate loop.
Like the other parallel test modules, every test runs in ONE child pytest with 8 simulated
devices (tests/helpers_devices.py).
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from exl3_jax import parallel as par
from exl3_jax.generate import Generator
from helpers_devices import ChildDevices
from test_parallel_model import DEVICES, REL_L2, rel_l2, synthetic_model

CHILD_ENV = "EXL3_JAX_PARALLEL_GENERATE_CHILD"
PROMPT_LENGTHS = (5, 11)
NEW_TOKENS = 6

_child = ChildDevices(__file__, CHILD_ENV, DEVICES)
delegated = _child.delegated

_REFERENCE: dict[str, tuple] = {}
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """Yields a list that receives one entry per XLA compilation inside the block."""
    seen: list[float] = []

    def listener(name, seconds, **_):
        if name == _BACKEND_COMPILE:
            seen.append(seconds)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
_TP_GENERATORS: dict[tuple, Generator] = {}


def tp_generator(model, arch: str, tp: int, mode: str = "experts") -> Generator:
    """One Generator per (model, tp, mode): its runner is the static argument of the jitted
    functions, so reusing it reuses their compiled programs."""
    key = (arch, tp, mode)
    if key not in _TP_GENERATORS:
        _TP_GENERATORS[key] = Generator(model, mesh=par.make_mesh(tp), moe_mode=mode)
    return _TP_GENERATORS[key]


def reference(arch: str, tmp_path_factory):
    """(model, prompts, single-device batch tokens, single-device stream [(token, logits)])
    of the synthetic model ``arch``, computed once per child process."""
    if arch not in _REFERENCE:
        model = synthetic_model(arch, tmp_path_factory)
        rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
        vocab = model.config.vocab_size
        prompts = [[int(t) for t in rng.integers(3, vocab, size=n)] for n in PROMPT_LENGTHS]
        print(f"{arch} prompts: {prompts}")
        gen = Generator(model)
        batch = gen.generate(prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        assert [len(t) for t in batch] == [NEW_TOKENS] * len(prompts)
        stream = list(gen.stream(prompts[1], max_new_tokens=NEW_TOKENS, stop_tokens=[],
                                 with_logits=True))
        assert [t for t, _ in stream] == batch[1]
        _REFERENCE[arch] = (model, prompts, batch, stream)
    return _REFERENCE[arch]


def check_tp_generation(arch, tmp_path_factory, tp, mode="experts"):
    model, prompts, want_batch, want_stream = reference(arch, tmp_path_factory)
    gen = tp_generator(model, arch, tp, mode)
    assert isinstance(gen.runner, par.ShardedModel)
    got = gen.generate(prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[])
    assert got.tokens == want_batch, f"{arch} tp={tp} {mode}: {got.tokens} != {want_batch}"
    assert got.finish_reasons == ["length"] * len(prompts)

    with backend_compiles() as compiles:                # prefill + decode step, once each
        stream = list(gen.stream(prompts[1], max_new_tokens=NEW_TOKENS, stop_tokens=[],
                                 with_logits=True))
    assert len(compiles) <= 2, f"{len(compiles)} compilations for {NEW_TOKENS} steps"
    assert [t for t, _ in stream] == [t for t, _ in want_stream]
    errors = [rel_l2(g, w) for (_, g), (_, w) in zip(stream, want_stream)]
    print(f"{arch} tp={tp} {mode}: per-step logits rel L2 {[f'{e:.2g}' for e in errors]}")
    assert len(errors) == NEW_TOKENS and max(errors) <= REL_L2
    return gen


def test_tiny_dense_tp2_generation_matches_single_device(request, tmp_path_factory):
    """One KV head, replicated on both ranks; o/down row-parallel, head column-parallel."""
    if delegated(request):
        return
    gen = check_tp_generation("llama_tiny", tmp_path_factory, 2)
    assert gen.runner.cache_shape == (1, 2, 128)          # [B, S, 2 x the one KV head, D]
    # another batch and another stream in the same buckets reuse the compiled programs
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    with backend_compiles() as compiles:
        gen.generate([[int(t) for t in rng.integers(3, 256, size=n)] for n in (3, 8)],
                     max_new_tokens=NEW_TOKENS - 2, stop_tokens=[])
        list(gen.stream([7, 8, 9], max_new_tokens=NEW_TOKENS, stop_tokens=[]))
    assert compiles == [], "same buckets must not recompile"


def test_tiny_moe_tp2_generation_matches_single_device(request, tmp_path_factory):
    if delegated(request):
        return
    gen = check_tp_generation("qwen3_moe_tiny", tmp_path_factory, 2)
    down = gen.state["layers"][0]["mlp"]["experts"]["down"]["trellis"]
    assert down.sharding.shard_shape(down.shape)[0] == 2        # 2 of the 4 experts per rank


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_dense_tp_generation_matches_single_device(request, tmp_path_factory, tp):
    """tp=2: one KV head per rank; tp=4: each KV head replicated on two ranks."""
    if delegated(request):
        return
    gen = check_tp_generation("llama", tmp_path_factory, tp)
    # KV cache split by (replicated) KV heads: [B, S, tp * 1, D] at tp=4
    cache_layers, cache_heads, head_dim = gen.runner.cache_shape
    assert (cache_layers, cache_heads, head_dim) == (2, max(2, tp), 128)


@pytest.mark.slow
@pytest.mark.parametrize("tp, mode", [(2, "experts"), (4, "experts"), (2, "tensor")])
def test_moe_tp_generation_matches_single_device(request, tmp_path_factory, tp, mode):
    if delegated(request):
        return
    gen = check_tp_generation("qwen3_moe", tmp_path_factory, tp, mode)
    down = gen.state["layers"][0]["mlp"]["experts"]["down"]["trellis"]   # [E, I/16, H/16, W]
    shard = down.sharding.shard_shape(down.shape)
    assert shard[:2] == ((8 // tp, 256 // 16) if mode == "experts" else (8, 256 // 16 // tp))


def test_stop_tokens_under_tp(request, tmp_path_factory):
    """A stop token ends a row as on one device (the same compiled programs as above)."""
    if delegated(request):
        return
    model, prompts, want_batch, _ = reference("llama_tiny", tmp_path_factory)
    gen = tp_generator(model, "llama_tiny", 2)
    stop = want_batch[0][2]
    got = gen.generate(prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[stop])
    want = Generator(model).generate(prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[stop])
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert got.tokens[0] == want_batch[0][:want_batch[0].index(stop)]
