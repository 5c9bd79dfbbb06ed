"""Shared fixtures. Tests run on CPU; float64 is enabled locally where exactness matters."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ClientMap("auto") uses its static rule in tests (measuring is timing-dependent; see
# fedjax_sim/runtime/autotune.py); tests/test_autotune.py turns it on explicitly.
os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Enable float64 for the duration of a test."""
    with jax.enable_x64(True):
        yield
