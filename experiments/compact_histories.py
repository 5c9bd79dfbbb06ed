"""Shrinks the sweep engine's per-run histories under experiments/results, losslessly.

    PYTHONPATH=. python experiments/compact_histories.py [DIR ...]   # default: results/

`SweepResult.save` writes each run's history twice, `histories.json` (floats as the float64
repr of float32 values, ~17 digits) and `runs.csv` (the same numbers, long format). This
keeps one copy: `histories.json`, same schema (`SweepResult.from_dict` reads it), every float
that is exactly a float32 written as its shortest float32 repr (`np.float32(x)` recovers the
stored value bit for bit), no indentation; `runs.csv` is deleted (regenerate it with
`SweepResult.from_dict(json.load(f)).runs_csv()`). Idempotent.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def shorten(x):
    """Floats that are float32 values -> their shortest float32 repr; others unchanged."""
    if isinstance(x, float):
        f = np.float32(x)
        return float(str(f)) if np.isfinite(f) and float(f) == x else x
    if isinstance(x, dict):
        return {k: shorten(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shorten(v) for v in x]
    return x


def compact(folder: str) -> None:
    path = os.path.join(folder, "histories.json")
    with open(path) as f:
        blob = json.load(f)
    with open(path, "w") as f:
        json.dump(shorten(blob), f, separators=(",", ":"))
    csv = os.path.join(folder, "runs.csv")
    if os.path.exists(csv):
        os.remove(csv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="*", default=[RESULTS])
    for top in ap.parse_args().dirs:
        for folder, _, files in sorted(os.walk(top)):
            if "histories.json" in files:
                compact(folder)


if __name__ == "__main__":
    main()
