"""The trellis math against independent NumPy references written from the spec's text."""

import numpy as np
import pytest

from exl3_jax.format.spec import width_from_rate
from exl3_jax.trellis import (decode_states, decode_trellis, dequantize, hadamard128,
                              hadamard_matrix, is_tail_biting, linear_reference, pack_codes,
                              tile_perm, unpack_states)
from exl3_jax.trellis.hadamard import HADAMARD_SCALE_F32

ALL_RATES = [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5]


def code_bits(K):
    """Bits of each element's code: K, or KA + (t odd) for half rates."""
    t = np.arange(256)
    return np.full(256, K) if K == int(K) else int(K) + (t % 2)


def reference_states(words, K):
    """Spec 2.2/2.3 literally: a bit list MSB-first per little-endian uint32, circular windows."""
    u = words.astype(np.int16).view(np.uint16).astype(np.uint64)
    U = u[0::2] | (u[1::2] << 16)
    stream = [(int(U[p >> 5]) >> (31 - (p & 31))) & 1 for p in range(32 * len(U))]
    R = len(stream)
    ends = np.cumsum(code_bits(K))
    return np.array([sum(stream[(e - 16 + j) % R] << (15 - j) for j in range(16)) for e in ends])


@pytest.mark.parametrize("K", ALL_RATES)
def test_unpack_matches_bit_list_reference(K, rng):
    words = rng.integers(-32768, 32768, width_from_rate(K), dtype=np.int16)
    got = np.asarray(unpack_states(words, K))
    assert got.dtype == np.uint16
    assert got.tolist() == reference_states(words, K).tolist()


@pytest.mark.parametrize("K", ALL_RATES)
def test_pack_unpack_round_trip(K, rng):
    states = rng.integers(0, 1 << 16, (3, 5, 256))
    mask = (1 << code_bits(K)) - 1
    packed = np.asarray(pack_codes(states, K))
    assert packed.dtype == np.int16 and packed.shape == (3, 5, width_from_rate(K))
    # the codes survive; the states are the windows of the packed ring
    assert np.array_equal(np.asarray(unpack_states(packed, K)) & mask, states & mask)
    words = rng.integers(-32768, 32768, (4, width_from_rate(K)), dtype=np.int16)
    assert np.array_equal(np.asarray(pack_codes(unpack_states(words, K), K)), words)
    assert bool(np.all(is_tail_biting(unpack_states(words, K), K)))


def test_tail_biting_detects_a_broken_chain(rng):
    words = rng.integers(-32768, 32768, (1, 64), dtype=np.int16)
    states = np.asarray(unpack_states(words, 4)).astype(np.int64)
    states[0, 7] ^= 0x0100            # flip a bit that the next state must also carry
    assert not bool(is_tail_biting(states, 4)[0])


def test_tile_perm_is_a_permutation_with_the_inverse_formula():
    perm = tile_perm()
    assert sorted(perm.tolist()) == list(range(256))
    for p in range(256):
        r, c = divmod(p, 16)
        lane = 4 * (c % 8) + ((r % 8) >> 1)
        j = (r & 1) + 2 * (r >= 8) + 4 * (c >= 8)
        assert perm[8 * lane + j] == p
    assert perm[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]
    assert perm[8 * 31:].tolist() == [103, 119, 231, 247, 111, 127, 239, 255]


@pytest.mark.parametrize("K,codebook", [(3, "mcg"), (4, "3inst"), (2.5, "mul1"), (7, "mul1")])
def test_decode_places_states_by_tile_perm(K, codebook, rng):
    trellis = rng.integers(-32768, 32768, (2, 3, width_from_rate(K)), dtype=np.int16)
    w = np.asarray(decode_trellis(trellis, codebook))
    values = np.asarray(decode_states(unpack_states(trellis, K), codebook))    # [2, 3, 256]
    r, c = np.divmod(tile_perm(), 16)
    for tk in range(2):
        for tn in range(3):
            tile = np.zeros((16, 16), np.float16)
            tile[r, c] = values[tk, tn]
            assert np.array_equal(w[16 * tk:16 * tk + 16, 16 * tn:16 * tn + 16].view(np.uint16),
                                  tile.view(np.uint16))


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_unrounded_values_round_to_the_weights(codebook, rng):
    # Every state: the fp32 value before the fp16 rounding (what the split-pair kernels'
    # MMA multiplies) rounds to the weight, and for 3inst / mcg it is the exact sum of the two
    # fp16 halves (float64 NumPy), for mul1 the exact (1024 + bytesum) * k_inv + k_bias.
    states = np.arange(1 << 16, dtype=np.uint32)
    exact = np.asarray(decode_states(states, codebook, unrounded=True))
    assert exact.dtype == np.float32
    weights = np.asarray(decode_states(states, codebook))
    np.testing.assert_array_equal(exact.astype(np.float16).view(np.uint16),
                                  weights.view(np.uint16))
    if codebook == "mul1":
        x = (states * np.uint64(0x83DCD12D)) % np.uint64(2**32)
        h = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)) + 1024
        want = h * float(np.float16(np.uint16(0x1EEE).view(np.float16))) + float(
            np.float16(np.uint16(0xC931).view(np.float16)))
    else:
        a, b = (0xCBAC1FED, 0) if codebook == "mcg" else (89226354, 64248484)
        x = (states.astype(np.uint64) * np.uint64(a) + np.uint64(b)) % np.uint64(2**32)
        x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
        halves = [(x >> np.uint64(s)) & np.uint64(0xFFFF) for s in (0, 16)]
        want = sum(v.astype(np.uint16).view(np.float16).astype(np.float64) for v in halves)
    np.testing.assert_array_equal(exact.astype(np.float64), want)
    assert not np.array_equal(exact, weights.astype(np.float32))       # some do round
    trellis = rng.integers(-32768, 32768, (2, 2, width_from_rate(3)), dtype=np.int16)
    np.testing.assert_array_equal(
        np.asarray(decode_trellis(trellis, codebook, unrounded=True)).astype(np.float16),
        np.asarray(decode_trellis(trellis, codebook)))


def test_mul1_affine_split_is_exact():
    # The mul1 split-pair kernels multiply the integer h - MUL1_CENTER (h = 1024 + bytesum, the
    # dp4a's fp16 low half; -MUL1_CENTER its fp16 high half) and add MUL1_RESIDUAL * sum(x):
    # for every h, k_inv * (h - 1534) + residual equals k_inv * h + k_bias exactly in fp32, and
    # -MUL1_CENTER is an fp16 integer.
    from exl3_jax.trellis.codebook import MUL1_CENTER, MUL1_K_BIAS, MUL1_K_INV, MUL1_RESIDUAL
    assert float(np.float16(-MUL1_CENTER)) == -MUL1_CENTER
    h = np.arange(1024, 1024 + 4 * 255 + 1, dtype=np.float32)
    kinv, kbias = np.float32(MUL1_K_INV), np.float32(MUL1_K_BIAS)
    split = kinv * (h - np.float32(MUL1_CENTER)) + MUL1_RESIDUAL
    direct = h * kinv + kbias
    np.testing.assert_array_equal(split, direct)
    np.testing.assert_array_equal(split.astype(np.float64),
                                  h.astype(np.float64) * float(kinv) + float(kbias))
    assert abs(float(MUL1_RESIDUAL)) < 0.002 and np.abs(h - MUL1_CENTER).max() <= 510


def test_half_rate_needs_mul1(rng):
    trellis = rng.integers(-32768, 32768, (8, 8, 40), dtype=np.int16)
    with pytest.raises(ValueError, match="mul1"):
        decode_trellis(trellis, "mcg")
    with pytest.raises(ValueError, match="72"):
        decode_trellis(rng.integers(-32768, 32768, (8, 8, 72), dtype=np.int16), "mul1")


def test_hadamard_matrix_is_sylvester_and_orthogonal():
    h = hadamard_matrix().astype(np.float64)
    i = np.arange(128)
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    assert np.array_equal(np.sign(h), (-1.0) ** popcount)
    np.testing.assert_allclose(h @ h, np.eye(128), atol=1e-6)
    np.testing.assert_allclose(h, h.T)


def test_hadamard128_blocks(rng):
    x = rng.standard_normal((3, 384)).astype(np.float32)
    y = np.asarray(hadamard128(x))
    h = hadamard_matrix().astype(np.float64)
    ref = np.concatenate([x[:, b:b + 128] @ h for b in range(0, 384, 128)], axis=1)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hadamard128(y)), x, atol=1e-5)     # involution


def butterflies_reference(v):
    """Spec 4.2 with explicit pair loops in np.float32: stage b pairs (i, i | 2^b)."""
    v = v.astype(np.float32).copy()
    for b in range(7):
        h = 1 << b
        for i in range(128):
            if not i & h:
                lo, hi = v[i], v[i | h]
                v[i], v[i | h] = np.float32(lo + hi), np.float32(lo - hi)
    return v * np.float32(HADAMARD_SCALE_F32)


def test_hadamard_exact_mode_matches_the_kernel_arithmetic(rng):
    x = (rng.standard_normal((4, 128)) * 3).astype(np.float16).astype(np.float32)
    got = np.asarray(hadamard128(x, exact=True))
    want = np.stack([butterflies_reference(row) for row in x])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # one-hot inputs give exactly +-r, the kernel's fp32 1/sqrt(128)
    e = np.asarray(hadamard128(np.eye(128, dtype=np.float32), exact=True))
    assert np.array_equal(np.abs(e), np.full((128, 128), HADAMARD_SCALE_F32, np.float32))
    assert np.array_equal(np.sign(e), np.sign(hadamard_matrix()))
    # and it stays within fp32 rounding of the plain matmul
    np.testing.assert_allclose(got, np.asarray(hadamard128(x)), rtol=0, atol=1e-5)


def random_linear(rng, k, n, K, codebook):
    trellis = rng.integers(-32768, 32768, (k // 16, n // 16, width_from_rate(K)), dtype=np.int16)
    suh = (rng.standard_normal(k) / np.sqrt(k)).astype(np.float16)
    svh = rng.standard_normal(n).astype(np.float16)
    return trellis, suh, svh


@pytest.mark.parametrize("K,codebook", [(2, "3inst"), (4, "mcg"), (3.5, "mul1")])
def test_dequantize_equals_decode_and_explicit_rotations(K, codebook, rng):
    k, n = 256, 384
    trellis, suh, svh = random_linear(rng, k, n, K, codebook)
    w_hat = np.asarray(decode_trellis(trellis, codebook)).astype(np.float64)
    h = hadamard_matrix().astype(np.float64)
    bk = np.kron(np.eye(k // 128), h)
    bn = np.kron(np.eye(n // 128), h)
    ref = np.diag(suh.astype(np.float64)) @ bk @ w_hat @ bn @ np.diag(svh.astype(np.float64))
    got = np.asarray(dequantize(trellis, suh, svh, codebook))
    assert got.dtype == np.float32 and got.shape == (k, n)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("K,codebook,bias", [(4, "mcg", True), (2, "mul1", False),
                                             (2.5, "mul1", True), (6, "3inst", False)])
def test_linear_reference_matches_x_at_dequantized_weight(K, codebook, bias, rng):
    k, n = 384, 256
    trellis, suh, svh = random_linear(rng, k, n, K, codebook)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    x = rng.standard_normal((5, k)).astype(np.float32)
    y = np.asarray(linear_reference(x, trellis, suh, svh, codebook, b))
    ref = x.astype(np.float64) @ np.asarray(dequantize(trellis, suh, svh, codebook),
                                            np.float64)
    if bias:
        ref = ref + b.astype(np.float64)
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    # the fp16 emulation of exllamav3's kernel path stays within fp16 rounding of it
    y16 = np.asarray(linear_reference(x, trellis, suh, svh, codebook, b, exact=True))
    assert y16.dtype == np.float16
    rel16 = np.linalg.norm(y16.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert rel16 < 3e-3, rel16


def test_linear_reference_rejects_wrong_width(rng):
    trellis, suh, svh = random_linear(rng, 128, 128, 4, "mcg")
    with pytest.raises(ValueError, match="in_features"):
        linear_reference(np.ones((1, 100), np.float32), trellis, suh, svh, "mcg")
