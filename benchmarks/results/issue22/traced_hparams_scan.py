import dataclasses, inspect, sys, traceback
from fedjax_sim import algorithms
from fedjax_sim.cli import RunConfig, UsageError
from fedjax_sim.sweep_cli import build_sweep, check_grid, _known_names, grid_kwargs
from fedjax_sim.sweep import abstract_run
known = _known_names()
cfg0 = RunConfig(num_clients=20, cohort_size=5, local_steps=2)
for alg in sorted(algorithms.ALGORITHMS):
    cfg = dataclasses.replace(cfg0, algorithm=alg)
    acc = algorithms.accepted_kwargs(alg) or set()
    names = sorted(n for n in known if set(grid_kwargs(cfg, n, 0.1)) & acc and n not in ("client_optimizer", "server_optimizer", "learning_rate", "batch_size", "inner_steps", "delta"))
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
