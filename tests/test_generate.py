"""Generation: KV-cache decoding vs full recompute, batching with left padding, sampling, stop
tokens, bucketing, tokenizer/chat template and the CLI, on synthetic random-trellis models."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exl3_jax import cli
from exl3_jax.generate import (Generator, SamplingParams, _generate, bucket, filter_logits,
                               left_pad, perplexity, sample_tokens)
from exl3_jax.models import load_model
from exl3_jax.tokenizer import StreamDecoder, Tokenizer
from helpers_models import ARCHS, RECOMPUTE_SHAPE, cached_models

jax.config.update("jax_default_matmul_precision", "highest")


def recompute_logits(gen, rows):
    """Each row alone, no left padding: right-pad to a common length (causal attention makes
    the padded tail irrelevant) -> list of float32 [len, V]."""
    B, L = RECOMPUTE_SHAPE
    assert len(rows) <= B and max(len(r) for r in rows) <= L
    tokens = np.zeros((B, L), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    logits = np.asarray(gen.logits(tokens))
    return [logits[b, :len(r)] for b, r in enumerate(rows)]


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_batch_decoding_matches_recompute_alone(arch, tmp_path_factory, rng):
    """Greedy batch generation (left-padded prompts of different lengths, KV cache) gives, per
    row, the argmax tokens of a full recompute of that row alone, and the same logprobs.

    Runs on the dequantized fp32 twin of each synthetic model: the cache, masking and RoPE code
    is the same for EXL3 and plain linears (test_models checks the two forwards agree), and the
    dense twin compiles several times faster; the EXL3 model itself is generated from in the
    llama tests below."""
    _, hf_dir = cached_models(arch, tmp_path_factory)
    gen = Generator(load_model(hf_dir, dtype="float32"))
    prompts = [list(rng.integers(3, 300, size=n)) for n in (5, 13, 1)]
    n_new = 9
    res = gen.generate(prompts, max_new_tokens=n_new, stop_tokens=[], return_logprobs=True)
    assert [len(t) for t in res.tokens] == [n_new] * 3 and res.finish_reasons == ["length"] * 3
    full = recompute_logits(gen, [p + t for p, t in zip(prompts, res.tokens)])
    for p, toks, lps, lg in zip(prompts, res.tokens, res.logprobs, full):
        steps = lg[len(p) - 1:len(p) - 1 + n_new]                     # predicts toks[i]
        assert list(steps.argmax(-1)) == toks
        want = log_softmax(steps)[np.arange(n_new), toks]
        np.testing.assert_allclose(lps, want, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    exl3_dir, _ = cached_models("llama", tmp_path_factory)
    return exl3_dir, Generator(load_model(exl3_dir, dtype="float32", cache_dequantized=True))


def test_stream_logits_match_recompute(llama, rng):
    """Every decode step's full logit vector equals the recomputed one within 1e-4."""
    _, gen = llama
    prompt = list(rng.integers(3, 300, size=6))
    out = list(gen.stream(prompt, max_new_tokens=7, stop_tokens=[], with_logits=True))
    toks = [t for t, _ in out]
    full = recompute_logits(gen, [prompt + toks])[0]
    for i, (t, lg) in enumerate(out):
        np.testing.assert_allclose(lg, full[len(prompt) - 1 + i], atol=1e-4, rtol=0)
        assert t == int(np.argmax(lg))
    assert toks == gen.generate([prompt], max_new_tokens=7, stop_tokens=[]).tokens[0]


def test_batch_equals_alone_and_no_recompile(llama, rng):
    _, gen = llama
    prompts = [list(rng.integers(3, 300, size=n)) for n in (4, 11)]
    batch = gen.generate(prompts, max_new_tokens=6, stop_tokens=[]).tokens
    alone = [gen.generate([p], max_new_tokens=6, stop_tokens=[]).tokens[0] for p in prompts]
    assert batch == alone
    n = _generate._cache_size()
    other = [list(rng.integers(3, 300, size=n)) for n in (7, 2)]         # same buckets
    gen.generate(other, max_new_tokens=5, stop_tokens=[], seed=3)
    assert _generate._cache_size() == n, "same buckets must not recompile"


def test_stop_tokens(llama, rng):
    _, gen = llama
    prompt = list(rng.integers(3, 300, size=5))
    free = gen.generate([prompt], max_new_tokens=8, stop_tokens=[]).tokens[0]
    stop = free[3]
    first = free.index(stop)
    res = gen.generate([prompt, prompt], max_new_tokens=8, stop_tokens=[stop])
    assert res.tokens == [free[:first]] * 2 and res.finish_reasons == ["stop"] * 2


def test_sampling_in_generate(llama, rng):
    _, gen = llama
    prompt = list(rng.integers(3, 300, size=5))
    greedy = gen.generate([prompt], max_new_tokens=6, stop_tokens=[]).tokens
    hot = SamplingParams(temperature=5.0, top_k=200, top_p=0.95)
    a = gen.generate([prompt], max_new_tokens=6, stop_tokens=[], seed=1, sampling=hot).tokens
    b = gen.generate([prompt], max_new_tokens=6, stop_tokens=[], seed=1, sampling=hot).tokens
    c = gen.generate([prompt], max_new_tokens=6, stop_tokens=[], seed=2, sampling=hot).tokens
    assert a == b and a != c and a != greedy and all(0 <= t < 300 for t in a[0])


def test_top_k_1_is_greedy(rng):
    logits = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)
    tok, _ = jax.jit(sample_tokens, static_argnums=2)(logits, jax.random.key(7),
                                                       SamplingParams(temperature=0.8, top_k=1))
    np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), -1))


def test_filter_logits_matches_numpy(rng):
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
    p = SamplingParams(temperature=0.7, top_k=10, top_p=0.6)
    got = np.asarray(jax.jit(filter_logits, static_argnums=1)(jnp.asarray(logits), p))
    for row, g in zip(logits, got):
        x = row.astype(np.float64) / 0.7
        x[x < np.sort(x)[-10]] = -np.inf
        order = np.argsort(-x)
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        keep = order[(np.cumsum(probs) - probs) < 0.6]
        want = np.full_like(x, -np.inf)
        want[keep] = x[keep]
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(want))
        np.testing.assert_allclose(g[np.isfinite(g)], want[np.isfinite(want)], rtol=1e-6)


def test_sample_tokens_distribution(rng):
    logits = jnp.log(jnp.array([[0.7, 0.2, 0.1, 1e-9]], jnp.float32)).repeat(4000, 0)
    sample = jax.jit(sample_tokens, static_argnums=2)
    tok, lp = sample(logits, jax.random.key(0), SamplingParams(temperature=1.0))
    freq = np.bincount(np.asarray(tok), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1, 0.0], atol=0.03)
    np.testing.assert_allclose(lp, np.log(np.array([0.7, 0.2, 0.1, 1e-9]))[np.asarray(tok)],
                               rtol=1e-4)
    tok, _ = sample(logits[:2], jax.random.key(0), SamplingParams(top_p=0.5, temperature=1.0))
    assert list(np.asarray(tok)) == [0, 0]


def test_helpers_and_bad_arguments():
    assert [bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    tokens, valid = left_pad([[1, 2], [3]], 4)
    np.testing.assert_array_equal(tokens, [[0, 0, 1, 2], [0, 0, 0, 3]])
    np.testing.assert_array_equal(valid, [[0, 0, 1, 1], [0, 0, 0, 1]])
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generate_rejects_bad_prompts(llama):
    _, gen = llama
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[1, 2], []])
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[1, 300]])


# -- tokenizer, chat template, CLI -----------------------------------------------------------------

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tokenizer(directory, vocab_size=300):
    """A byte-level BPE tokenizer with no merges (ids 3.. for bytes) and 3 special tokens."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({ch: 3 + i for i, ch in enumerate(sorted(alphabet))})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
         "add_bos_token": False}))


def test_tokenizer_and_chat_template(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi é"}])
    assert text == "<|im_start|>user\nHi é<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 1 and tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    s = StreamDecoder(tok)
    assert "".join(s.push(i) for i in tok.encode("Hi é!")) == "Hi é!"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_cli_generate_and_ppl(llama, tmp_path, capsys):
    import shutil
    exl3_dir, _ = llama
    d = tmp_path / "model"
    shutil.copytree(exl3_dir, d)
    write_tokenizer(d)
    # --raw keeps the prompt in the 16-token bucket the other llama tests compiled for; the chat
    # template itself is tested in test_tokenizer_and_chat_template.
    argv = ["generate", "--model", str(d), "--prompt", "Hello", "--raw", "--max-new-tokens", "5",
            "--dtype", "float32", "--cache-dequantized"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    tok = Tokenizer.from_dir(d)
    _, gen = llama
    want = gen.generate([tok.encode("Hello")], max_new_tokens=5, stop_tokens=[2]).tokens[0]
    assert out == tok.decode(want) + "\n"
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    assert cli.main(["ppl", str(d), "--text", str(text), "--ctx", "32", "--dtype", "float32",
                     "--cache-dequantized"]) == 0
    line = capsys.readouterr().out
    ppl, n = perplexity(gen, tok.encode(text.read_text()), ctx=32)
    assert f"perplexity {ppl:.4f} over {n} predicted tokens" in line
    assert 1.0 < ppl < 1e4
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
