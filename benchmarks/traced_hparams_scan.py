"""Which registered algorithms accept traced numeric hyper-parameters (issues 18 / 22)?

For every algorithm and every numeric keyword it accepts (plus the sweepable run flags
`client_lr`, `server_lr`, `mu`, mapped by `sweep_cli.grid_kwargs`), builds the sweep's
`make_algorithm` and traces one run's init and step with that hyper-parameter as a tracer
(`sweep.abstract_run`, no compilation). One row per algorithm (`traced_ok`, `refused` with
the first line of each error) in benchmarks/results/traced_hparams_scan.jsonl (`--out`
elsewhere).

    PYTHONPATH=$PWD nice -n 10 python benchmarks/traced_hparams_scan.py
"""

import argparse
import dataclasses
import inspect

from fedjax_sim import algorithms
from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.app.config import RunConfig, hyper_parameters
from fedjax_sim.app.sweep_cli import GRID_FLAGS, build_sweep
from fedjax_sim.run.sweep import abstract_run

STATIC = ("batch_size", "inner_steps", "num_clients", "k", "buffer_size")  # shapes / counts


def scan(alg: str, cfg0: RunConfig) -> tuple[list[str], list[str]]:
    """(hyper-parameters traced, `name (error)` of those refused) of one algorithm."""
    cfg = dataclasses.replace(cfg0, algorithm=alg)
    takes = hyper_parameters(algorithms.ALGORITHMS[alg])
    numeric = [
        n
        for n, p in takes.items()
        if isinstance(p.default, int | float) and not isinstance(p.default, bool)
    ]
    flags = [f for f, c in GRID_FLAGS.items() if c in takes and f != "client_lr_decay"]
    names = sorted(set(numeric + flags) - set(STATIC))
    ok, bad = [], []
    for n in names:
        d = inspect.signature(algorithms.ALGORITHMS[alg]).parameters.get(n)
        v = d.default if d is not None and isinstance(d.default, float) and d.default > 0 else 0.1
        try:
            ds, model, make, _ = build_sweep(cfg, {n: [v]}, explicit=set())
            abstract_run(make, model, ds.train, {n: v})
            ok.append(n)
        except Exception as e:
            bad.append(f"{n} ({type(e).__name__}: {str(e).splitlines()[0][:110]})")
    return ok, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="default benchmarks/results/traced_hparams_scan.jsonl")
    args = ap.parse_args()
    rec = Recorder("traced_hparams_scan", args.out)
    cfg0 = RunConfig(num_clients=20, cohort_size=5, local_steps=2)
    for alg in sorted(algorithms.ALGORITHMS):
        ok, bad = scan(alg, cfg0)
        print(f"{alg}: traced OK {ok}; REFUSED {bad}", flush=True)
        rec.add(alg, algorithm=alg, traced_ok=ok, refused=bad)
    rec.write()


if __name__ == "__main__":
    main()
