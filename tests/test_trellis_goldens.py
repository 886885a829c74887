"""Bit-exact golden vectors of shared/spec/exl3_format.md 2.6 and exl3_format_165.md 1.2."""

import hashlib

import numpy as np
import pytest

from exl3_jax.trellis import decode_states, decode_trellis, unpack_states

# state -> fp16 bits per codebook (spec 2.6, single-state table)
SINGLE_STATES = {
    0x0000: (0x3a25, 0x3f60, 0xc2e8),
    0x0001: (0xbb5b, 0x304e, 0x3921),
    0x0002: (0x3b74, 0xba13, 0xb72d),
    0x1234: (0xc066, 0x3e0f, 0xb89e),
    0x8000: (0xb7f8, 0xb915, 0xbaf2),
    0xABCD: (0xb98e, 0x35e7, 0xbd42),
    0xFFFF: (0xb110, 0x3acd, 0xb936),
}
CODEBOOKS = ("3inst", "mcg", "mul1")


@pytest.mark.parametrize("cb_index,codebook", list(enumerate(CODEBOOKS)))
def test_single_state_goldens(cb_index, codebook):
    states = np.array(list(SINGLE_STATES), dtype=np.uint16)
    got = np.asarray(decode_states(states, codebook)).view(np.uint16)
    want = np.array([v[cb_index] for v in SINGLE_STATES.values()], dtype=np.uint16)
    assert got.tolist() == want.tolist()


# (K, codebook) -> (sha256[:16], W[0,0], W[5,17], W[127,127], sum as float64)
WHOLE_TENSOR = {
    (2, "3inst"): ("87f9567334508431", -0.3486328125, -0.77001953125, 0.058837890625,
                   -16.817626953125),
    (2, "mcg"): ("39f2ce8dc7475427", 1.3017578125, -0.25390625, -0.107177734375, -3.4296875),
    (2, "mul1"): ("0c32a1536953051b", 0.032012939453125, 0.45166015625, 0.857421875,
                  52.92095184326172),
    (3, "3inst"): ("a6d51e3c445ad58f", 3.2890625, -0.35693359375, 2.96484375, -30.4029541015625),
    (3, "mcg"): ("fc9c2580dbd1d543", -0.701171875, -1.0185546875, 1.4423828125,
                 45.688232421875),
    (3, "mul1"): ("843e83d6a20aa3e9", -0.7529296875, 0.09967041015625, -0.51611328125,
                  20.325340270996094),
    (4, "3inst"): ("4175041d45510f82", 0.06396484375, -0.1064453125, -0.095703125,
                   57.354736328125),
    (4, "mcg"): ("0bae84deac0b6ef5", -1.673828125, 2.146484375, -0.30126953125,
                 -178.230712890625),
    (4, "mul1"): ("acd09b118d376028", 0.329833984375, -0.1981201171875, 1.568359375,
                  65.67794036865234),
    (5, "3inst"): ("6dbfc57a476e381f", 0.410400390625, 1.400390625, 1.3046875, -37.601318359375),
    (5, "mcg"): ("0d28836b92c2373b", 0.62548828125, -0.419189453125, -0.95849609375,
                 86.1199951171875),
    (5, "mul1"): ("dfd310ebb2df3fc1", -0.259033203125, -0.99658203125, 1.919921875,
                  -40.63237762451172),
    (8, "3inst"): ("4961a6e28393769c", -1.5712890625, 0.787109375, 1.3203125, 15.327392578125),
    (8, "mcg"): ("2d9b6024b2f3416d", 1.14453125, -1.365234375, -0.84765625, 22.73291015625),
    (8, "mul1"): ("5e0027e26d033915", 0.84423828125, -1.240234375, 1.236328125,
                  -15.763267517089844),
}


@pytest.mark.parametrize("K,codebook", list(WHOLE_TENSOR))
def test_whole_tensor_goldens(K, codebook):
    j = np.arange(8 * 8 * 16 * K, dtype=np.int64)
    words = ((j * 40503 + 12345) % 65536).astype(np.uint16).view(np.int16).reshape(8, 8, 16 * K)
    w = np.asarray(decode_trellis(words, codebook))
    assert w.dtype == np.float16 and w.shape == (128, 128)
    sha, w00, w517, wlast, total = WHOLE_TENSOR[(K, codebook)]
    assert hashlib.sha256(w.astype("<f2").tobytes()).hexdigest()[:16] == sha
    assert (float(w[0, 0]), float(w[5, 17]), float(w[127, 127])) == (w00, w517, wlast)
    assert float(w.astype(np.float64).sum()) == total


# exllamav3 1.6.5 half rates: K -> (states t=0..3, state t=255, W_hat[0,0], [0,1], [1,0] bits)
HALF_RATES = {
    1.5: ((0x3175, 0xc5d4, 0x8ba9, 0x2ea7), 0x98ba, (0x3771, 0xbd26, 0x300e)),
    2.5: ((0xf0aa, 0x8553, 0x154f, 0xaa78), 0x7c2a, (0x381a, 0xbd50, 0xba83)),
    3.5: ((0xfcd4, 0xcd4f, 0x6a78, 0xa78d), 0x5f9a, (0x32df, 0xbd12, 0x3c68)),
}


@pytest.mark.parametrize("K", list(HALF_RATES))
def test_half_rate_goldens(K):
    width = 16 * int(K) + 8
    words = ((np.arange(width) * 0x9E37) % 65536).astype(np.uint16).view(np.int16)
    states = np.asarray(unpack_states(words[None], K))[0]
    first, last, values = HALF_RATES[K]
    assert states[:4].tolist() == list(first)
    assert int(states[255]) == last
    w = np.asarray(decode_trellis(np.tile(words, (8, 8, 1)), "mul1")).view(np.uint16)
    assert (int(w[0, 0]), int(w[0, 1]), int(w[1, 0])) == values
    # every tile is the same, so the decoded 128x128 tensor is the 16x16 tile repeated 8x8
    assert np.array_equal(w, np.tile(w[:16, :16], (8, 8)))
