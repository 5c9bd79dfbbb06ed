"""Which registered algorithms accept traced numeric hyper-parameters (issue 22 -> 18)?

For every algorithm and every numeric keyword it accepts (plus the CLI's client_lr /
server_lr, mapped by `sweep_cli.grid_kwargs`), builds the sweep's `make_algorithm` and
traces one run's init and step with that hyper-parameter as a tracer (`sweep.abstract_run`,
no compilation). Output: benchmarks/results/issue22/traced_hparams_scan.txt

    PYTHONPATH=$PWD nice -n 10 python benchmarks/traced_hparams_scan.py
"""

import dataclasses
import inspect

from fedjax_sim import algorithms
from fedjax_sim.cli import RunConfig
from fedjax_sim.sweep import abstract_run
from fedjax_sim.sweep_cli import _known_names, build_sweep, grid_kwargs

SKIP = ("client_optimizer", "server_optimizer", "learning_rate", "batch_size", "inner_steps")
known = _known_names()
cfg0 = RunConfig(num_clients=20, cohort_size=5, local_steps=2)
for alg in sorted(algorithms.ALGORITHMS):
    cfg = dataclasses.replace(cfg0, algorithm=alg)
    acc = algorithms.accepted_kwargs(alg) or set()
    names = sorted(n for n in known if set(grid_kwargs(cfg, n, 0.1)) & acc and n not in SKIP)
    ok, bad = [], []
    for n in names:
        d = inspect.signature(algorithms.ALGORITHMS[alg]).parameters.get(n)
        v = d.default if d is not None and isinstance(d.default, float) and d.default > 0 else 0.1
        try:
            ds, model, make, _ = build_sweep(cfg, {n: [v]})
            abstract_run(make, model, ds.train, {n: v})
            ok.append(n)
        except Exception as e:
            bad.append(f"{n} ({type(e).__name__}: {str(e).splitlines()[0][:110]})")
    print(f"{alg}: traced OK {ok}; REFUSED {bad}", flush=True)
