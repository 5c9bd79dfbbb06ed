"""Records and measures the golden pins of `golden_cases.py` (every case run in float64).

    PYTHONPATH=. python tests/algorithms/record_golden.py current      # golden/current.{npz,json}
    PYTHONPATH=. python tests/algorithms/record_golden.py ulps FILE    # max ulps vs FILE per case

`presets.npz` was recorded once, at the commit named in `golden/README.md` (the
implementations before the composable layer); never re-record it. `current` pins today's code
on this machine and writes the machine's fingerprint beside it (`test_golden.py` asserts bit
equality on a machine with the same fingerprint). `ulps` prints how many units in the last
place the current code differs from a pin file, per case: run it under
`XLA_FLAGS=--xla_cpu_max_isa=AVX2` (or AVX, SSE4_2) to measure what another instruction set
changes (`golden/README.md` records the measurements behind `CROSS_MACHINE_ULPS`).
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")  # as in tests/conftest.py
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import golden_cases  # noqa: E402
import machine  # noqa: E402

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def pinned_arrays() -> dict[str, np.ndarray]:
    """`{case/param/i: ..., case/metric/k: ...}` of every case, run with the current code."""
    out = {}
    for name in golden_cases.case_names():
        params, metrics = golden_cases.run_case(name)
        for i, p in enumerate(params):
            out[f"{name}/param/{i}"] = p
        for k, v in metrics.items():
            out[f"{name}/metric/{k}"] = v
    return out


def max_ulps(new: np.ndarray, old: np.ndarray) -> int:
    """Largest distance in units in the last place between two float arrays (0 if equal)."""
    if not np.issubdtype(old.dtype, np.floating):
        np.testing.assert_array_equal(new, old)
        return 0
    ulps = np.testing.assert_array_max_ulp(new.astype(old.dtype), old, maxulp=2**62)
    return int(np.max(ulps, initial=0))


def record_current() -> None:
    arrays = pinned_arrays()
    np.savez_compressed(os.path.join(GOLDEN_DIR, "current.npz"), **arrays)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    record = {"fingerprint": machine.fingerprint(), "commit": commit}
    with open(os.path.join(GOLDEN_DIR, "current.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote golden/current.npz", len(arrays), "arrays;", record)


def print_ulps(path: str) -> None:
    new = pinned_arrays()
    with np.load(path) as z:
        per_case: dict[str, int] = {}
        for k in z.files:
            case = k.split("/")[0]
            per_case[case] = max(per_case.get(case, 0), max_ulps(new[k], z[k]))
    print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "max_ulps": per_case}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["current"]:
        record_current()
    elif sys.argv[1:2] == ["ulps"] and len(sys.argv) == 3:
        print_ulps(sys.argv[2])
    else:
        sys.exit(__doc__)
