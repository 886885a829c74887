"""Shared fixtures: a fresh random generator per test whose seed is printed (shown on failure)."""

import secrets

import numpy as np
import pytest


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)
