"""The paper's graph analysis (Appendix C.6, Figs. 6-7) at CPU scale: how the misalignment
distribution and the Laplacian spectrum of the similarity graph move with class imbalance a
and data imbalance b.

    nice -n 10 python experiments/fedlps_graph.py

writes experiments/results/fedlps/graph_analysis.json (fedlps_report.py prints the table).
Messages are computed on the paper's per-pixel standardised features and, for comparison, on
the raw [0, 1] pixels.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from fedlps_table1 import RESULTS, load_pool  # noqa: E402

from fedjax_sim.algorithms.similarity import graph_from_data  # noqa: E402
from fedjax_sim.data.unseen import federate_unseen  # noqa: E402


def main() -> None:
    rows = []
    for dataset, pool, clients in [("digits", None, 20), ("fashion_mnist", 20000, 50)]:
        xtr, ytr, xte, yte = load_pool(dataset, pool, 0)
        for standardise, b, a in itertools.product(
            (True, False), (0.0, 1.0), (0.0, 1.0, 10.0, 100.0)
        ):
            ds = federate_unseen(
                xtr, ytr, xte, yte, num_clients=clients, num_classes=10, seed=0,
                class_imbalance=a, data_imbalance=b, standardise=standardise,
            )  # fmt: skip
            t0 = time.perf_counter()
            g = graph_from_data(ds.train)
            off = g.misalignment[~np.eye(clients, dtype=bool)]
            lap = np.linalg.eigvalsh(g.laplacian)
            rows.append(
                {
                    "dataset": dataset,
                    "standardised": standardise,
                    "a": a,
                    "b": b,
                    "mis_median": float(np.median(off)),
                    "mis_mean": float(off.mean()),
                    "mis_quartiles": np.quantile(off, [0.25, 0.75]).tolist(),
                    "opposite_fraction": float(np.mean(off > 0.5)),  # m_i.m_n < 0
                    "lap_l2": float(lap[1]),
                    "lap_max": float(lap[-1]),
                    "degree_ratio": float(g.degrees.max() / g.degrees.min()),
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(rows[-1], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "graph_analysis.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
