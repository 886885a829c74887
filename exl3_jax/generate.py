"""Jit-compiled generation: prefill + decode loop in one ``jax.jit`` (``lax.while_loop``).

Static shapes: the prompt length is padded (left) to a power-of-two bucket, the output buffer to a
bucket of max_new_tokens, and the KV cache holds prompt bucket + output bucket slots, so repeated
calls with similar sizes reuse one compiled program. Sampling parameters are static (changing
them recompiles); the seed, the stop tokens and max_new_tokens are traced.

For streaming to a terminal, ``Generator.stream`` runs a host loop over a jitted prefill and a
jitted single-token decode step (same buckets, same numerics, the same prefill / decode code as
the loop).

The jitted functions call a model runner (``LocalModel`` on one device; with
``Generator(model, mesh=...)`` the tensor-parallel ``exl3_jax.parallel.ShardedModel``), so
single-device and tensor/expert-parallel generation share one loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MIN_BUCKET = 16
MAX_STOP_TOKENS = 8
_NEG_INF = -jnp.inf


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits, params: SamplingParams):
    """Temperature, top-k and top-p (nucleus) filtering.

    Args:
      logits: float32 [B, V].
    Returns:
      float32 [B, V]: logits / temperature with filtered entries at -inf (ties at a threshold are
      kept).
    """
    x = logits.astype(jnp.float32) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, params.top_k)[0][:, -1:]
        x = jnp.where(x < kth, _NEG_INF, x)
    if params.top_p < 1.0:
        srt = -jnp.sort(-x, axis=-1)                                   # descending
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                    # mass ranked above
        keep = jnp.sum(before < params.top_p, axis=-1, keepdims=True)  # >= 1
        threshold = jnp.take_along_axis(srt, keep - 1, axis=-1)
        x = jnp.where(x < threshold, _NEG_INF, x)
    return x


def sample_tokens(logits, key, params: SamplingParams):
    """Next tokens and their log-probabilities under the unfiltered model distribution.

    Args:
      logits: float32 [B, V]; key: PRNG key; params: SamplingParams.
    Returns:
      (tokens int32 [B], logprobs float32 [B]).
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        tok = jax.random.categorical(key, filter_logits(logits, params), axis=-1)
    tok = tok.astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok, lp


@dataclasses.dataclass(frozen=True)
class LocalModel:
    """The single-device model runner: the model's graph, called on its state.

    A model runner is what the jitted functions below call (a static, hashable argument):
    ``runner(state, tokens, cache, token_valid, last_only=...)`` -> (logits float32
    [B, T or 1, V], cache), ``runner.init_cache(state, batch, size)`` (inside jit), and
    ``put`` / ``host`` to move host arrays in and results out. The tensor-parallel runner is
    ``exl3_jax.parallel.ShardedModel`` (``Generator(model, mesh=...)``).
    """
    graphdef: nnx.GraphDef

    def init_cache(self, state, batch: int, size: int):
        return nnx.merge(self.graphdef, state).init_cache(batch, size)

    def __call__(self, state, tokens, cache, token_valid=None, *, last_only: bool = False):
        return nnx.merge(self.graphdef, state)(tokens, cache, token_valid, last_only=last_only)

    def put(self, x):
        return jnp.asarray(x)

    def host(self, x) -> np.ndarray:
        return np.asarray(x)


def _prefill_core(runner, state, tokens, valid, key, cache_size: int, sampling: SamplingParams):
    """Prompt through a fresh cache, first token sampled: (tok [B], logprob [B], logits [B, V],
    cache, key)."""
    cache = runner.init_cache(state, tokens.shape[0], cache_size)
    logits, cache = runner(state, tokens, cache, valid, last_only=True)
    key, sub = jax.random.split(key)
    tok, lp = sample_tokens(logits[:, -1], sub, sampling)
    return tok, lp, logits[:, -1], cache, key


def _decode_core(runner, state, tok, cache, key, sampling: SamplingParams):
    """One token per row through the cache: (next tok [B], logprob [B], logits [B, V], cache,
    key)."""
    logits, cache = runner(state, tok[:, None], cache)
    key, sub = jax.random.split(key)
    tok, lp = sample_tokens(logits[:, 0], sub, sampling)
    return tok, lp, logits[:, 0], cache, key


@functools.partial(jax.jit, static_argnames=("runner", "cache_size", "out_len", "sampling"))
def _generate(runner, state, tokens, valid, seed, max_new, stop_ids, *, cache_size: int,
              out_len: int, sampling: SamplingParams):
    """tokens/valid [B, Tp], seed int32 [] -> (out int32 [B, out_len] (-1 after stop),
    logprobs [B, out_len], steps int32 [])."""
    B = tokens.shape[0]
    tok, lp, _, cache, key = _prefill_core(runner, state, tokens, valid, jax.random.key(seed),
                                           cache_size, sampling)
    carry = (jnp.zeros((), jnp.int32), tok, lp, jnp.zeros((B,), bool),
             jnp.full((B, out_len), -1, jnp.int32), jnp.zeros((B, out_len), jnp.float32),
             cache, key)

    def cond(c):
        i, _, _, done, *_ = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, tok, lp, done, out, lps, cache, key = c
        out = out.at[:, i].set(jnp.where(done, -1, tok))
        lps = lps.at[:, i].set(jnp.where(done, 0.0, lp))
        done = done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        tok, lp, _, cache, key = _decode_core(runner, state, tok, cache, key, sampling)
        return i + 1, tok, lp, done, out, lps, cache, key

    i, _, _, _, out, lps, _, _ = jax.lax.while_loop(cond, body, carry)
    return out, lps, i


@functools.partial(jax.jit, static_argnames=("runner", "cache_size", "sampling"))
def _prefill(runner, state, tokens, valid, seed, *, cache_size: int, sampling: SamplingParams):
    return _prefill_core(runner, state, tokens, valid, jax.random.key(seed), cache_size,
                         sampling)


@functools.partial(jax.jit, static_argnames=("runner", "sampling"), donate_argnames=("cache",))
def _decode_step(runner, state, tok, cache, key, *, sampling: SamplingParams):
    return _decode_core(runner, state, tok, cache, key, sampling)


@functools.partial(jax.jit, static_argnames=("runner",))
def _full_logits(runner, state, tokens, valid):
    cache = runner.init_cache(state, tokens.shape[0], tokens.shape[1])
    return runner(state, tokens, cache, valid)[0]


@dataclasses.dataclass
class GenerationResult:
    """Per prompt: generated tokens (without the stop token that ended it), their logprobs
    (when asked for), and why it ended ("stop" or "length")."""
    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    finish_reasons: list[str]


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0):
    """int32 [B, length] tokens and bool [B, length] validity, prompts right-aligned."""
    B = len(prompts)
    tokens = np.full((B, length), pad_id, np.int32)
    valid = np.zeros((B, length), bool)
    for b, p in enumerate(prompts):
        if len(p):
            tokens[b, length - len(p):] = p
            valid[b, length - len(p):] = True
    return tokens, valid


class Generator:
    """Batch generation for a ``CausalLM`` (split once into graph + state; jit at the edges).

    With ``mesh`` (a ``jax.sharding.Mesh`` with a "tp" axis, e.g. ``parallel.make_mesh(4)``)
    the weights are laid out once for tensor parallelism (``parallel.shard_model``; MoE experts
    expert-parallel or, with ``moe_mode="tensor"``, tensor-split) and every method runs the
    same jitted prefill / decode loop on the sharded model; results are the same types. Under
    jax.distributed, every process builds the Generator on a mesh over all processes' devices
    and makes the same calls.
    """

    def __init__(self, model, *, min_bucket: int = MIN_BUCKET, mesh=None,
                 moe_mode: str = "experts"):
        if mesh is None:
            graphdef, self.state = nnx.split(model)
            self.runner = LocalModel(graphdef)
        else:
            from .parallel import shard_model
            self.runner, self.state = shard_model(model, mesh, moe_mode=moe_mode)
        self.config = model.config
        self.min_bucket = min_bucket

    @property
    def graphdef(self):
        """The model graph the runner calls (per rank under a mesh)."""
        return self.runner.graphdef

    def _stop_array(self, stop_tokens) -> np.ndarray:
        stop = list(self.config.eos_token_ids if stop_tokens is None else stop_tokens)
        if len(stop) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens, got {len(stop)}")
        return np.array(stop + [-2] * (MAX_STOP_TOKENS - len(stop)), np.int32)

    def _prepare(self, prompts, max_new_tokens: int):
        if not prompts:
            raise ValueError("no prompts")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        t_pad = bucket(max(len(p) for p in prompts), self.min_bucket)
        out_len = bucket(max_new_tokens, self.min_bucket)
        tokens, valid = left_pad(prompts, t_pad)
        return tokens, valid, t_pad, out_len

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 stop_tokens: Sequence[int] | None = None,
                 return_logprobs: bool = False) -> GenerationResult:
        """Generate for a batch of token-id prompts in one jitted call.

        stop_tokens default to the config's eos_token_id(s); pass [] to never stop early."""
        tokens, valid, t_pad, out_len = self._prepare(prompts, max_new_tokens)
        put = self.runner.put
        out, lps, _ = _generate(self.runner, self.state, put(tokens), put(valid),
                                put(np.int32(seed)), put(np.int32(max_new_tokens)),
                                put(self._stop_array(stop_tokens)),
                                cache_size=t_pad + out_len, out_len=out_len, sampling=sampling)
        out, lps = self.runner.host(out), self.runner.host(lps)
        stop = set(self.config.eos_token_ids if stop_tokens is None else stop_tokens)
        toks, lp_rows, reasons = [], [], []
        for b in range(len(prompts)):
            row = [int(t) for t in out[b, :max_new_tokens] if t >= 0]
            n = len(row)
            if row and row[-1] in stop:
                reasons.append("stop")
                n -= 1
            else:
                reasons.append("length")
            toks.append(row[:n])
            lp_rows.append([float(x) for x in lps[b, :n]])
        return GenerationResult(toks, lp_rows if return_logprobs else None, reasons)

    def stream(self, prompt: Sequence[int], *, max_new_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), seed: int = 0,
               stop_tokens: Sequence[int] | None = None,
               with_logits: bool = False) -> Iterator:
        """Yield generated token ids one at a time (host loop over a jitted decode step); the
        stop token is not yielded. With ``with_logits`` yield (token, logits float32 [V])."""
        tokens, valid, t_pad, out_len = self._prepare([prompt], max_new_tokens)
        stop = set(self.config.eos_token_ids if stop_tokens is None else stop_tokens)
        put, host = self.runner.put, self.runner.host
        tok, _, logits, cache, key = _prefill(self.runner, self.state, put(tokens), put(valid),
                                              put(np.int32(seed)), cache_size=t_pad + out_len,
                                              sampling=sampling)
        for i in range(max_new_tokens):
            t = int(host(tok)[0])
            if t in stop:
                return
            yield (t, host(logits)[0]) if with_logits else t
            if i + 1 < max_new_tokens:
                tok, _, logits, cache, key = _decode_step(self.runner, self.state, tok, cache,
                                                          key, sampling=sampling)

    def logits(self, tokens, valid=None):
        """Full-sequence logits float32 [B, T, V] without a prior cache (for perplexity and as
        the recompute reference of cached decoding)."""
        tokens = np.asarray(tokens, np.int32)
        valid = np.ones(tokens.shape, bool) if valid is None else np.asarray(valid, bool)
        return _full_logits(self.runner, self.state, self.runner.put(tokens),
                            self.runner.put(valid))


def perplexity(model, ids: Sequence[int], *, ctx: int = 512, max_windows: int | None = None):
    """exp(mean NLL) of next-token prediction over non-overlapping windows of ``ctx`` tokens (the
    last window is right-padded; padding is not scored). Returns (ppl, predicted token count)."""
    if ctx < 2:
        raise ValueError(f"ctx must be >= 2, got {ctx}")
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens to measure perplexity")
    gen = model if isinstance(model, Generator) else Generator(model)
    nll, count = 0.0, 0
    for w, start in enumerate(range(0, len(ids) - 1, ctx)):
        if max_windows is not None and w >= max_windows:
            break
        chunk = list(ids[start:start + ctx])
        n = len(chunk)
        if n < 2:
            break
        tokens = np.zeros((1, ctx), np.int32)
        tokens[0, :n] = chunk
        logp = jax.nn.log_softmax(gen.logits(tokens)[0, :n - 1], axis=-1)
        nll -= float(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(chunk[1:])[:, None],
                                                 axis=-1)))
        count += n - 1
    return float(np.exp(nll / count)), count
