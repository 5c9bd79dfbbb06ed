"""Cost of gradients through rounds (issue 36): time and memory of value-and-gradient
(w.r.t. the client and server learning rates and the initial model) vs the forward value
only, after T rounds of the default job (`RunConfig()`: FedAvg, digits, MLP 64, 100 clients,
cohort 10, 10 local steps of batch 16), objective the central test loss, with and without
rematerialisation (`remat="sqrt"`: chunks of ceil(sqrt(T)) rounds under `jax.checkpoint`);
and the gradient w.r.t. the two learning rates alone (what the tuner needs) in reverse mode
and in forward mode (`mode="forward"`: one `jax.jvp` per learning rate, vmapped).

Per configuration: compile seconds, run seconds (median of `--repeats`, after the compiled
first call), and XLA's buffer assignment of the compiled program (`memory_analysis()`: temp
bytes, the working set besides inputs and outputs; its peak is what the backward pass's
residuals cost). One row per (T, variant) in benchmarks/results/hypergradient_cost.jsonl
(`--out` elsewhere; a re-run replaces the rows it measures again).

    PYTHONPATH=$PWD nice -n 5 python benchmarks/hypergradient_cost.py --rounds 10 100 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")  # the static ClientMap rule: no timing noise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fedjax_sim.app.bench.results import Recorder  # noqa: E402
from fedjax_sim.app.config import RunConfig  # noqa: E402
from fedjax_sim.app.sweep_cli import build_sweep  # noqa: E402
from fedjax_sim.run.differentiate import (  # noqa: E402
    central_loss,
    differentiable_run,
    initial_params,
    remat_length,
)

VARIANTS = {  # label -> (gradient?, remat, differentiable_run keywords)
    "forward": (False, None, {}),
    "value_and_grad": (True, None, {}),
    "value_and_grad remat=sqrt": (True, "sqrt", {}),
    # the (client lr, server lr) gradient alone: reverse mode vs two vmapped jvps
    "lr grad reverse": (True, None, {"wrt": "hparams"}),
    "lr grad reverse remat=sqrt": (True, "sqrt", {"wrt": "hparams"}),
    # every round under jax.checkpoint: under load (T = 40, CPU seconds) cheaper than storing
    # the rounds' residuals (3.9x forward vs 5.9x; their zero-filled stacks, writes and reads)
    "lr grad reverse remat=1": (True, 1, {"wrt": "hparams"}),
    "value_and_grad remat=1": (True, 1, {}),
    "lr grad forward": (True, None, {"wrt": "hparams", "mode": "forward"}),
}


def measure(fn, args, repeats: int) -> tuple[float, float, list[float], float, int | None]:
    """(compile s, median s, all s, median process CPU s, XLA temp bytes) of `jit`ted
    `fn(*args)`. CPU seconds (all threads) count work, not waiting: on a loaded machine
    their ratios are steadier than the wall-clock ones."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without memory analysis
        temp = None
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return compile_s, statistics.median(times), times, statistics.median(cpu), temp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="default benchmarks/results/hypergradient_cost.jsonl")
    p.add_argument(
        "--client-map", choices=["auto", "vmap", "map"], default="auto",
        help="the cohort's client map (RunConfig.client_map; labels get a suffix if not auto)",
    )  # fmt: skip
    args = p.parse_args()
    rec = Recorder("hypergradient_cost", args.out)
    cfg = RunConfig(client_map=args.client_map)
    suffix = "" if args.client_map == "auto" else f" client_map={args.client_map}"
    grid = {"client_lr": [cfg.client_lr], "server_lr": [cfg.server_lr]}
    dataset, model, make_algorithm, client_map = build_sweep(cfg, grid, explicit=set())
    key = jax.random.key(cfg.seed)
    params = initial_params(model, key)
    hparams = {"client_lr": jnp.float32(cfg.client_lr), "server_lr": jnp.float32(cfg.server_lr)}
    objective = central_loss(model, dataset.test)
    for rounds in args.rounds:
        forward_s = forward_cpu = None
        for label in args.variants:
            grad, remat, kw = VARIANTS[label]
            run = differentiable_run(
                make_algorithm, objective, num_rounds=rounds, remat=remat, **kw
            )
            fn = run._value_and_grad if grad else run._value
            compile_s, median, all_s, cpu_s, temp = measure(
                fn, (hparams, params, dataset.train, key), args.repeats
            )
            if not grad:
                forward_s, forward_cpu = median, cpu_s
            row = {
                "rounds": rounds,
                "variant": label + suffix,
                "gradient": grad,
                "remat_rounds": remat_length(remat, rounds),
                "wrt": list(run.wrt) if grad else [],
                "mode": run.mode if grad else None,
                "compile_s": compile_s,
                "run_s": median,
                "run_s_all": all_s,
                "s_per_round": median / rounds,
                "ratio_to_forward": None if forward_s is None else median / forward_s,
                "cpu_s": cpu_s,
                "cpu_ratio_to_forward": None if forward_s is None else cpu_s / forward_cpu,
                "xla_temp_bytes": temp,
                "client_map": str(client_map),
                "job": "RunConfig() defaults: fedavg, digits, mlp (64,), 100 clients, cohort "
                "10, 10 local steps, batch 16; objective: central test loss",
            }
            print({k: v for k, v in row.items() if k != "job"}, flush=True)
            rec.add(f"T={rounds} {label}{suffix}", **row)
            rec.write()


if __name__ == "__main__":
    main()
