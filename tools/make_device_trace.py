"""Writes the bundled device trace `fedjax_sim/algorithms/device_traces/small.csv`.

    python tools/make_device_trace.py            # 64 rows of ProceduralProfiles(seed=38)

The trace is the procedural profiles of clients 0..63 at their defaults (illustrative values,
not measurements), written in the CSV trace format of `fedjax_sim.algorithms.device_model`;
values are rounded to 4 significant digits so the file stays small and readable.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fedjax_sim.algorithms.device_model import ProceduralProfiles, Profile, save_trace  # noqa: E402

ROWS, SEED = 64, 38
OUT = pathlib.Path(__file__).resolve().parents[1] / "fedjax_sim/algorithms/device_traces/small.csv"


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    profile = ProceduralProfiles(seed=SEED)(np.arange(ROWS))
    rounded = Profile(*(np.array([float(f"{v:.4g}") for v in np.asarray(x)]) for x in profile))
    save_trace(
        rounded,
        OUT,
        comment=f"ProceduralProfiles(seed={SEED}) of clients 0..{ROWS - 1} at its defaults "
        "(tools/make_device_trace.py); illustrative, not measured",
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
