"""Shared fixtures. Tests run on CPU; float64 is enabled locally where exactness matters."""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ClientMap("auto") uses its static rule in tests (measuring is timing-dependent; see
# fedjax_sim/runtime/autotune.py); tests/test_autotune.py turns it on explicitly.
os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Enable float64 for the duration of a test."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def script_npz(tmp_path):
    """`run(script)`: a Python script's text in a fresh interpreter, given an output path as
    its argument, without this process's `XLA_FLAGS` (the script sets its own host devices);
    returns the `.npz` it wrote."""

    def run(script: str):
        out = str(tmp_path / "script_out.npz")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        proc = subprocess.run(
            [sys.executable, "-c", script, out], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return np.load(out)

    return run
