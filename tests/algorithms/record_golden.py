"""Records `golden/presets.npz`: every case of `golden_cases.py`, run in float64.

    PYTHONPATH=. python tests/algorithms/record_golden.py

Run once at the commit named in `golden/README.md` (the implementations before the
composable layer); re-running it with the current code would pin the current behaviour.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import golden_cases  # noqa: E402


def main() -> None:
    out = {}
    for name in golden_cases.case_names():
        params, metrics = golden_cases.run_case(name)
        for i, p in enumerate(params):
            out[f"{name}/param/{i}"] = p
        for k, v in metrics.items():
            out[f"{name}/metric/{k}"] = v
        print(name, [float(np.abs(p).sum()) for p in params], flush=True)
    path = os.path.join(os.path.dirname(__file__), "golden", "presets.npz")
    np.savez_compressed(path, **out)
    print("wrote", path, len(out), "arrays")


if __name__ == "__main__":
    main()
