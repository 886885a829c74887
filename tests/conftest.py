"""Shared fixtures: a fresh random generator per test whose seed is printed (shown on failure),
and the opt-in for slow tests."""

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with EXL3_JAX_SLOW=1, so CI on 2 cores stays short."""
    if os.environ.get("EXL3_JAX_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: set EXL3_JAX_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
