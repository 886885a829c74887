"""The tail-biting trellis encoder (exl3_jax.quant.viterbi) against the encoder invariants of
shared/spec/test_models.md section 6 and an independent numpy Viterbi.

encode_tiles runs numba loops on CPUs (viterbi_cpu) and the JAX search elsewhere; tests without a
``backend`` argument exercise the numba one here, the others run both.

Tile counts are small (CPU, 2 cores); heavier configurations are marked slow.
"""


import importlib.util

import jax
import numpy as np
import pytest

from exl3_jax.format.spec import TILE_WEIGHTS
from exl3_jax.quant.viterbi import BACKENDS, default_backend, encode_tiles
from exl3_jax.trellis import codebook_table, decode_states, is_tail_biting, pack_codes, \
    unpack_states

# upstream test bounds (exl3_format.md 9) and the reference encoder's measured relative MSE (6.5)
MSE_BOUND = {1: 0.3, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.1, 6: 0.07, 7: 0.05, 8: 0.04}
MSE_MEASURED = {1: 0.27, 2: 0.070, 3: 0.018, 4: 0.0048, 5: 0.0014, 6: 0.0004, 8: 0.0001}
# heavier configurations run only with EXL3_JAX_SLOW=1 (tests/conftest.py)
slow = [pytest.mark.slow]
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
# both backends where numba is installed (it is a dependency; a --no-deps install may lack it)
BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.skipif(b == "numba" and not HAVE_NUMBA,
                                                           reason="numba is not installed"))
                  for b in BACKENDS]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="numba is the CPU default only")
def test_numba_backend_is_the_cpu_default():
    # CI installs the package with its dependencies, numba among them: the fast CPU path must be
    # the one that runs, or every build silently takes the slower XLA:CPU search
    assert HAVE_NUMBA, "numba (a dependency) is not installed"
    assert default_backend() == "numba"


def gaussian_tiles(rng, n, codebook="mcg"):
    """N(0, sigma^2) tiles with sigma = the codebook's own std (1.2437 for 3inst/mcg, 1.0003 for
    mul1), the setting of the measured MSE table."""
    sigma = float(np.std(np.asarray(codebook_table(codebook), np.float64)))
    return (rng.standard_normal((n, TILE_WEIGHTS)) * sigma).astype(np.float32)


def rel_mse(values, tiles):
    return float(np.mean((values.astype(np.float32) - tiles) ** 2) / np.mean(tiles ** 2))


def check_codeword(states, values, K, codebook):
    """Spec invariants 1 and 2: tail-biting, and the states decode to the reported values."""
    assert states.dtype == np.uint16 and values.dtype == np.float16
    assert bool(np.all(np.asarray(is_tail_biting(states, K))))
    np.testing.assert_array_equal(np.asarray(decode_states(states, codebook)), values)
    # and the packed words carry exactly these states
    np.testing.assert_array_equal(np.asarray(unpack_states(pack_codes(states, K), K)), states)


def numpy_viterbi_cost(tile, K, codebook):
    """Independent reference: the two-pass tail-biting Viterbi written with explicit predecessor
    indices (np.minimum.at), returning the total squared error of its codeword."""
    table = np.asarray(codebook_table(codebook), np.float64)
    w = tile.astype(np.float16).astype(np.float64)
    s = np.arange(1 << 16)
    pred, succ = s >> K, s & ((1 << (16 - K)) - 1)
    # group the states by successor edge explicitly: row e lists the 2^K states ending in edge e
    by_succ = np.argsort(succ, kind="stable").reshape(1 << (16 - K), 1 << K)
    assert np.all(succ[by_succ] == np.arange(1 << (16 - K))[:, None])

    def forward(order, start_cost):
        cost, back = start_cost, []
        for t in order:
            cand = (cost[pred] + (table - w[t]) ** 2)[by_succ]
            pick = np.argmin(cand, axis=1)
            back.append(by_succ[np.arange(1 << (16 - K)), pick])     # best state per edge
            cost = cand[np.arange(1 << (16 - K)), pick]
        return cost, back

    def backtrack(back, edge):
        states = []
        for best_state in reversed(back):
            st = best_state[edge]
            states.append(st)
            edge = st >> K
        return states[::-1]

    order = list(range(128, 256)) + list(range(128))
    cost, back = forward(order, np.zeros(1 << (16 - K)))
    rolled = backtrack(back, int(np.argmin(cost)))
    edge0 = rolled[127] & ((1 << (16 - K)) - 1)
    start = np.full(1 << (16 - K), np.inf)
    start[edge0] = 0.0
    cost, _ = forward(range(256), start)
    return float(cost[edge0])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("K,codebook", [pytest.param(4, "3inst", marks=slow), (6, "mcg")])
def test_exact_matches_independent_numpy_viterbi(rng, K, codebook, backend):
    tiles = gaussian_tiles(rng, 1, codebook)
    states, values = encode_tiles(tiles, K, codebook, mode="exact", backend=backend)
    check_codeword(states, values, K, codebook)
    w16 = tiles.astype(np.float16).astype(np.float64)
    for i in range(1):
        ours = float(np.sum((values[i].astype(np.float64) - w16[i]) ** 2))
        assert ours == pytest.approx(numpy_viterbi_cost(tiles[i], K, codebook), rel=1e-4)


# 48 tiles: one 5-sigma Gaussian value beyond the codebook's range can cost a tile 4x the mean
# error, which moved a 16-tile mean outside the 10% window (seed 1907714653: +22%).
@pytest.mark.parametrize("K,codebook,n", [(2, "mcg", 32), (3, "mul1", 48), (4, "3inst", 48)])
def test_exact_mse_matches_reference_table(rng, K, codebook, n):
    tiles = gaussian_tiles(rng, n, codebook)
    states, values = encode_tiles(tiles, K, codebook, mode="exact")
    check_codeword(states, values, K, codebook)
    mse = rel_mse(values, tiles)
    assert mse < MSE_BOUND[K]
    # no worse than the reference encoder by more than 10% (it accumulates costs in fp16; we use
    # fp32, so we may be slightly better), and not implausibly better (a broken trellis would be)
    assert 0.8 * MSE_MEASURED[K] < mse < 1.1 * MSE_MEASURED[K], mse


@pytest.mark.parametrize("K,codebook,n", [pytest.param(1, "mcg", 6, marks=slow), (2, "3inst", 8),
                                          (3, "mcg", 8), pytest.param(4, "mul1", 8, marks=slow)])
def test_fast_mode_within_1p5x_of_exact(rng, K, codebook, n):
    tiles = gaussian_tiles(rng, n, codebook)
    _, exact = encode_tiles(tiles, K, codebook, mode="exact")
    states, fast = encode_tiles(tiles, K, codebook, mode="fast")
    check_codeword(states, fast, K, codebook)
    mse_exact, mse_fast = rel_mse(exact, tiles), rel_mse(fast, tiles)
    # the upstream bound is for the exact encoder; at K=1 (mean 0.27) allow the fast mode 10%
    assert mse_fast < MSE_BOUND[K] * (1.1 if K == 1 else 1.0)
    assert mse_exact <= mse_fast * 1.02          # exact is (near-)optimal for the same start
    # the issue allows 1.5x; the windowed pass 1 measures 1.000-1.011 (K1-K8), so a regression
    # shows well before that
    assert mse_fast < 1.1 * mse_exact, (mse_fast, mse_exact)


@pytest.mark.parametrize("K,codebook", [(5, "mcg"), pytest.param(6, "3inst", marks=slow),
                                        pytest.param(7, "mul1", marks=slow),
                                        pytest.param(8, "mcg", marks=slow)])
def test_fast_mode_high_K_bounds(rng, K, codebook):
    tiles = gaussian_tiles(rng, 3, codebook)
    states, values = encode_tiles(tiles, K, codebook, mode="fast")
    check_codeword(states, values, K, codebook)
    mse = rel_mse(values, tiles)
    assert mse < MSE_BOUND[K]
    # At high K the relative MSE is dominated by a few tail values and varies ~2x between sets of
    # 16 tiles (measured K6 0.0005..0.001, K8 0.0001..0.00023), so this is a sanity bound (a
    # broken search is off by orders of magnitude), not a 10% match.
    assert mse < 5.0 * MSE_MEASURED.get(K, 0.0002), mse


def random_codewords(rng, n, K, codebook):
    """Values of random tail-biting codewords: random ring bits -> their states -> decoded."""
    width = 16 * int(K) + (8 if K != int(K) else 0)
    words = rng.integers(0, 1 << 16, (n, width), dtype=np.uint16).view(np.int16)
    return np.asarray(decode_states(unpack_states(words, K), codebook)).astype(np.float32)


@pytest.mark.parametrize("K,codebook,mode", [(2, "mcg", "exact"), (5, "mul1", "exact"),
                                             pytest.param(2.5, "mul1", "exact", marks=slow),
                                             (2, "mcg", "fast"), (2.5, "mul1", "fast"),
                                             (4, "mcg", "fast")])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_valid_codeword_reencodes_losslessly(rng, mode, K, codebook, backend):
    # A zero-error path exists and is found. In the fast mode pass 1 sees only a window, but the
    # codeword's own path is the only zero-cost one through it in practice (measured: 16 of 16
    # tiles exact at K2 mcg, K2.5/K3 mul1, whose 913 distinct values tie more often, and K4 mcg).
    target = random_codewords(rng, 8, K, codebook)
    states, values = encode_tiles(target, K, codebook, mode=mode, backend=backend)
    check_codeword(states, values, K, codebook)
    np.testing.assert_allclose(values.astype(np.float32), target, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("mode,K", [("exact", 3), ("fast", 2)])
def test_batch_independence(rng, mode, K, backend):
    tiles = gaussian_tiles(rng, 3)
    s_all, v_all = encode_tiles(tiles, K, "mcg", mode=mode, batch=3, backend=backend)
    s_two, v_two = encode_tiles(tiles, K, "mcg", mode=mode, batch=2, backend=backend)  # padded
    s_one, v_one = encode_tiles(tiles[1:2], K, "mcg", mode=mode, batch=1, backend=backend)
    np.testing.assert_array_equal(s_all, s_two)
    np.testing.assert_array_equal(v_all, v_two)
    np.testing.assert_array_equal(s_all[1:2], s_one)


@pytest.mark.parametrize("mode", [pytest.param("exact", marks=slow), "fast"])
def test_half_rates(rng, mode):
    tiles = gaussian_tiles(rng, 4, "mul1")
    states, values = encode_tiles(tiles, 2.5, "mul1", mode=mode)
    check_codeword(states, values, 2.5, "mul1")
    mse = rel_mse(values, tiles)
    # 2.5 bits per weight must land strictly between the integer rates' reference MSEs
    assert MSE_MEASURED[3] < mse < MSE_MEASURED[2], mse


@pytest.mark.parametrize("K", [pytest.param(1.5, marks=slow), pytest.param(3.5, marks=slow)])
def test_half_rates_slow(rng, K):
    tiles = gaussian_tiles(rng, 4, "mul1")
    states, values = encode_tiles(tiles, K, "mul1", mode="fast")
    check_codeword(states, values, K, "mul1")
    lo, hi = {1.5: (MSE_MEASURED[2], MSE_MEASURED[1]), 3.5: (MSE_MEASURED[4], MSE_MEASURED[3])}[K]
    assert lo < rel_mse(values, tiles) < hi


# every lane spread of viterbi_cpu's step (2^D(t) = 2: K1; 4 and 8: both phases of K2.5; 8: K3;
# >= 16: K4, K6, K8); exact and fast pass-1 windows
@pytest.mark.parametrize("K,codebook,mode", [(1, "mcg", "fast"), (3, "3inst", "exact"),
                                             (4, "mcg", "fast"), (6, "mcg", "fast"),
                                             (8, "mul1", "exact"), (2.5, "mul1", "fast"),
                                             pytest.param(3.5, "mul1", "exact", marks=slow)])
@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
def test_numba_and_jax_backends_find_equally_good_codewords(rng, K, codebook, mode):
    """The two backends run the same search with the same fp32 operations, so they find paths of
    the same cost; a last-ulp difference in XLA's arithmetic may break a near-tie the other way,
    so states are compared through their cost (measured: identical states on 64 tiles per K)."""
    tiles = gaussian_tiles(rng, 6, codebook)
    w16 = tiles.astype(np.float16).astype(np.float64)
    costs = {}
    for backend in BACKENDS:
        states, values = encode_tiles(tiles, K, codebook, mode=mode, backend=backend)
        check_codeword(states, values, K, codebook)
        costs[backend] = np.sum((values.astype(np.float64) - w16) ** 2, axis=1)
    np.testing.assert_allclose(costs["numba"], costs["jax"], rtol=1e-5)


def test_rejects_bad_arguments():
    tiles = np.zeros((1, TILE_WEIGHTS), np.float32)
    with pytest.raises(ValueError, match="mul1"):
        encode_tiles(tiles, 2.5, "mcg")
    with pytest.raises(ValueError):
        encode_tiles(tiles, 9, "mcg")
    with pytest.raises(ValueError, match="mode"):
        encode_tiles(tiles, 2, "mcg", mode="greedy")
    with pytest.raises(ValueError, match="backend"):
        encode_tiles(tiles, 2, "mcg", backend="cuda")
    with pytest.raises(ValueError):
        encode_tiles(np.zeros((1, 255), np.float32), 2, "mcg")
