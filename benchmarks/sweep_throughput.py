"""Sweeps as one program vs R sequential `simulate` calls (issue 22), side by side in one run.

For each workload and R: runs per second of `sweep` (R seeds on the runs axis, run groups
chosen by the memory planner, `--groups all` = one vmap over all runs, `--groups cores` =
runs sharded over one virtual CPU device per core, `sweep(mesh=runs_mesh())`) and of R
sequential `simulate` calls with the same algorithm (its compilation cached after the
first call; at most `--max-sequential` calls are timed, their rate is the sequential rate).
Every measurement runs in its own process (peak RSS is process-wide) after one untimed
warm-up call that compiles (compile seconds are reported apart) and is the fastest of
`REPEATS` timed calls, as the bounds are. Each row also gives its
training GFLOP/s (`train_flops`); with `--ceiling`, the same-run 2048^2 matmul rate bounds
every ratio: no sweep can beat the sequential rate by more than that peak over its GFLOP/s;
on digits it also times the local training alone (`training_ceiling`), a tighter bound.

Workloads: `digits` = the default job of `fedjax-sim run` (FedAvg, digits, 100 clients,
Dirichlet 0.5, MLP 64, cohort 10, 10 local steps of batch 16, evaluation every 20 rounds,
central + per-client test metrics) for `--rounds` rounds; `W1-100` = the W1 round
(MLP 784-200-200-10, 10 local steps of batch 32) with 100 clients, full participation.

    nice -n 5 python benchmarks/sweep_throughput.py --groups auto cores --ceiling

Rows (label `<workload> R=<R> <mode>`; a re-run replaces the rows it measures again) go to
benchmarks/results/sweep_throughput.jsonl (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_flops(model, examples_per_round: int) -> float:
    """Training FLOPs of one round: forward + backward of every dense kernel, counted as
    3 x (2 x in x out) per example (forward, weight gradient, input gradient); biases,
    activations, losses and evaluation are left out."""
    import jax

    params = model.init(jax.random.key(0))
    weights = sum(k.size for k in jax.tree.leaves(params) if k.ndim == 2)
    return 6.0 * weights * examples_per_round


def build(workload: str):
    """`(algorithm, data, test, model, eval spec, training FLOPs per round)`."""
    from fedjax_sim.run.simulate import EvalSpec

    if workload == "digits":
        from fedjax_sim.app.cli import RunConfig, build_run

        cfg = RunConfig()
        dataset, model, alg, _ = build_run(cfg)
        examples = cfg.cohort_size * cfg.local_steps * cfg.batch_size
        return (
            alg,
            dataset.train,
            dataset.test,
            model,
            EvalSpec(every=20),
            train_flops(model, examples),
        )
    from fedjax_sim.app.bench import workloads

    w = workloads.preset("W1").replace(clients=100)
    data = workloads.make_data(w)
    model = workloads.make_model(w)
    return (
        workloads.make_algorithm(w, data),
        data,
        None,
        model,
        EvalSpec(every=1000, clients=False),
        train_flops(model, w.clients * w.local_steps * w.batch_size),
    )


REPEATS = 5  # every figure is the fastest of this many timed calls, the bounds as the sweeps


def _fastest(f, *args, reps: int = REPEATS) -> float:
    """Fastest of `reps` timed calls of `f(*args)` (already compiled)."""
    import jax

    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t0)
    return min(out)


def _best(f, *args) -> float:
    """`_fastest` after one untimed (compiling) call."""
    import jax

    jax.block_until_ready(f(*args))
    return _fastest(f, *args)


def _best_over_cores(f, *args) -> float:
    """`_best` of `f` run per device on its slice of every argument's leading axis, over
    `runs_mesh()` (one device per core, as `--groups cores`)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fedjax_sim.run.sweep import RUNS_AXIS, runs_mesh

    mesh, spec = runs_mesh(), P(RUNS_AXIS)
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    return _best(sharded, *jax.device_put(args, NamedSharding(mesh, spec)))


def matmul_ceiling(runs: int) -> dict:
    """The digits job's dominant op, alone: a chain of 100 batched `[L, 16, 64] x [L, 64, 64]`
    matmuls (one hidden layer of a local step, batch 16) for L = 10 lanes (one run's cohort)
    and L = 10 R (R runs' cohorts; also sharded over one device per core when R divides),
    GFLOP/s of each and the same-run 2048^2 matmul peak. The
    sweep can only beat R sequential runs by the per-op overhead it removes and by any gain
    in this op's efficiency at L = 10 R."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    big = jnp.ones((2048, 2048), jnp.float32)
    row = {"peak_gflops": 2 * 2048**3 / _best(jax.jit(jnp.matmul), big, big) / 1e9}
    chain = jax.jit(
        lambda x, w: lax.fori_loop(
            0, 100, lambda i, x: jnp.tanh(jnp.einsum("lbi,lij->lbj", x, w)), x
        )
    )
    for lanes, name in ((10, "one_run"), (10 * runs, "R_runs")):
        x, w = jnp.ones((lanes, 16, 64)), jnp.full((lanes, 64, 64), 0.01)
        row[f"{name}_gflops"] = 100 * 2 * lanes * 16 * 64 * 64 / _best(chain, x, w) / 1e9
    n = len(jax.devices())
    if n > 1 and runs % n == 0:  # the same chain with the lanes sharded over the cores
        x, w = jnp.ones((10 * runs, 16, 64)), jnp.full((10 * runs, 64, 64), 0.01)
        row["R_runs_cores_gflops"] = (
            100 * 2 * 10 * runs * 16 * 64 * 64 / _best_over_cores(chain, x, w) / 1e9
        )
    return row


def training_ceiling(runs: int, rounds: int, local_steps: int = 10, batch: int = 16) -> dict:
    """An upper bound on a digits sweep's runs/s: the local training its rounds must do,
    alone. L = 10 R lanes (R runs' cohorts of 10 clients) each take `local_steps` SGD steps
    of batch `batch` through the job's model shape (ReLU MLP 64-64-10, softmax cross-entropy)
    on minibatches gathered beforehand, `rounds` times: no cohort or index draws, gathers,
    optimizer state, aggregation or evaluation, so no sweep of this job can run faster.
    Timed on one device and with the lanes sharded over one device per core, for two forms
    of the weight gradient: `autodiff` (`jax.grad` of `h @ w + b`, as in the package's flax
    models) and `transposed`
    (`x^T g` on an explicitly transposed `x` behind `lax.optimization_barrier`, the fastest
    dot form found on XLA:CPU; see the README)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    def dense_transposed_grad():
        @jax.custom_vjp
        def dense(h, w, b):
            return h @ w + b

        def backward(res, g):
            h, w = res
            return g @ w.T, lax.optimization_barrier(h.T) @ g, g.sum(0)

        dense.defvjp(lambda h, w, b: (h @ w + b, (h, w)), backward)
        return dense

    lanes = 10 * runs
    keys = jax.random.split(jax.random.key(0), 4)
    params = (  # [L, 64, 64], [L, 64], [L, 64, 10], [L, 10]
        0.1 * jax.random.normal(keys[0], (lanes, 64, 64)),
        jnp.zeros((lanes, 64)),
        0.1 * jax.random.normal(keys[1], (lanes, 64, 10)),
        jnp.zeros((lanes, 10)),
    )
    x = jax.random.normal(keys[2], (lanes, local_steps, batch, 64))  # [L, K, B, 64]
    y = jax.random.randint(keys[3], (lanes, local_steps, batch), 0, 10)  # [L, K, B]
    flops = 6.0 * (64 * 64 + 64 * 10) * lanes * local_steps * batch * rounds
    n = len(jax.devices())
    row = {}
    for form, dense in (
        ("autodiff", lambda h, w, b: h @ w + b),
        ("transposed", dense_transposed_grad()),
    ):

        def loss(p, xb, yb, dense=dense):
            w1, b1, w2, b2 = p
            logits = dense(jax.nn.relu(dense(xb, w1, b1)), w2, b2)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        def client(p, xs, ys, loss=loss):
            def sgd_step(p, minibatch):
                g = jax.grad(loss)(p, *minibatch)
                return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), None

            return lax.scan(sgd_step, p, (xs, ys))[0]

        def train(p, x, y, client=client):
            def training_round(p, _):
                return jax.vmap(client)(p, x, y), None

            return lax.scan(training_round, p, None, length=rounds)[0]

        seconds = _best(jax.jit(train), params, x, y)
        row[f"train_{form}_runs_per_s"] = runs / seconds
        row[f"train_{form}_gflops"] = flops / seconds / 1e9
        if n > 1 and lanes % n == 0:
            seconds = _best_over_cores(train, params, x, y)
            row[f"train_{form}_cores_runs_per_s"] = runs / seconds
            row[f"train_{form}_cores_gflops"] = flops / seconds / 1e9
    return row


def measure(workload: str, runs: int, mode: str, rounds: int, max_seq: int) -> dict:
    """One measurement (run in a child process)."""
    import jax

    from fedjax_sim.run.simulate import simulate
    from fedjax_sim.run.sweep import sweep

    if mode == "matmul":
        return {
            "workload": workload,
            "R": runs,
            "mode": mode,
            **matmul_ceiling(runs),
            **(training_ceiling(runs, rounds) if workload == "digits" else {}),
            "load_avg_1m": os.getloadavg()[0],
        }
    alg, train, test, model, spec, flops = build(workload)
    make = lambda hp: alg  # noqa: E731  one object: the compilation is reused
    if mode == "sequential":
        calls = min(runs, max_seq)

        def go(seed0):
            for s in range(calls):
                simulate(
                    alg,
                    train,
                    jax.random.key(seed0 + s),
                    model=model,
                    num_rounds=rounds,
                    test=test,
                    evaluation=spec,
                    progress=False,
                )
    else:
        from fedjax_sim.run.sweep import runs_mesh

        calls = runs
        group = runs if mode == "sweep-all" else None
        mesh = runs_mesh() if mode == "sweep-cores" else None

        def go(seed0):
            res = sweep(
                make,
                train,
                seeds=range(seed0, seed0 + runs),
                model=model,
                num_rounds=rounds,
                test=test,
                evaluation=spec,
                progress=False,
                runs_per_group=group,
                mesh=mesh,
            )
            jax.block_until_ready(res.states)
            go.group = res.meta["runs_per_group"]

    t0 = time.perf_counter()
    go(1000)  # warm-up: compiles
    first = time.perf_counter() - t0
    seconds = _fastest(go, 0)  # the statistic of the bounds (`_best`)
    return {
        "workload": workload,
        "R": runs,
        "mode": mode,
        "rounds": rounds,
        "timed_runs": calls,
        "timed_repeats": REPEATS,
        "seconds": seconds,
        "runs_per_s": calls / seconds,
        "train_gflops": calls * rounds * flops / seconds / 1e9,
        "warmup_s": first,
        "runs_per_group": getattr(go, "group", None),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "load_avg_1m": os.getloadavg()[0],
    }


def _measure_in_child(workload: str, runs: int, mode: str, args: argparse.Namespace) -> dict | None:
    """`measure` in a fresh process (one virtual CPU device per core for the sharded modes);
    None (after printing its error) if it failed."""
    cmd = [sys.executable, __file__, "--one", workload, str(runs), mode, "--rounds",
           str(args.rounds), "--w1-rounds", str(args.w1_rounds), "--max-sequential",
           str(args.max_sequential)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    if mode in ("sweep-cores", "matmul"):
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.cpu_count()}"
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_trial(rows: list[dict]) -> dict:
    """The trial with the median figure (runs/s; for the bounds, the training alone's runs/s
    over the cores, else the matmul peak), carrying every trial's figure as `trial_figures`."""
    key = next(
        k for k in ("runs_per_s", "train_autodiff_cores_runs_per_s", "peak_gflops") if k in rows[0]
    )
    ordered = sorted(rows, key=lambda row: row[key])
    return {**ordered[(len(ordered) - 1) // 2], "trial_figures": [row[key] for row in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["digits", "W1-100"])
    ap.add_argument("--runs", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=40, help="rounds per run (digits)")
    ap.add_argument("--w1-rounds", type=int, default=2, help="rounds per run (W1-100)")
    ap.add_argument("--max-sequential", type=int, default=8)
    ap.add_argument("--groups", nargs="+", default=["auto"], choices=["auto", "all", "cores"])
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also time the dominant op alone (matmul_ceiling) and, on digits, the training "
        "alone (training_ceiling)",
    )
    ap.add_argument(
        "--trials",
        type=int,
        default=1,
        help="measure every mode this many times, interleaved, each in a fresh process; rows "
        "keep the median trial (a process's speed varies by +-10 %% on a shared machine)",
    )
    ap.add_argument("--out", help="JSON lines (default benchmarks/results/sweep_throughput.jsonl)")
    ap.add_argument("--one", nargs=3, metavar=("WORKLOAD", "R", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        w, r, mode = args.one
        rounds = args.rounds if w == "digits" else args.w1_rounds
        print(json.dumps(measure(w, int(r), mode, rounds, args.max_sequential)))
        return 0
    modes = ["sequential"] + [f"sweep-{g}" for g in args.groups]
    if args.ceiling:
        modes.append("matmul")
    from fedjax_sim.app.bench.results import Recorder

    argv = sys.argv if argv is None else [sys.argv[0], *argv]
    rec = Recorder("sweep_throughput", args.out, argv=argv, machine=False)
    for w in args.workloads:
        for r in args.runs:
            trials = {mode: [] for mode in modes}
            for _ in range(args.trials):  # interleaved: a drift in the machine's speed hits all
                for mode in modes:
                    row = _measure_in_child(w, r, mode, args)
                    if row is None:
                        return 1
                    trials[mode].append(row)
            by_mode = {}
            for mode in modes:
                row = _median_trial(trials[mode])
                by_mode[mode] = row
                if mode == "matmul":
                    print(
                        f"{w:7s} R={r:3d} matmul      peak {row['peak_gflops']:.0f} GFLOP/s; "
                        f"[L,16,64]x[L,64,64] chain: L=10 {row['one_run_gflops']:.1f}, "
                        f"L={10 * r} {row['R_runs_gflops']:.1f}, "
                        f"sharded {row.get('R_runs_cores_gflops', float('nan')):.1f} GFLOP/s "
                        f"load {row['load_avg_1m']:.1f}",
                        flush=True,
                    )
                    seq = by_mode["sequential"]["runs_per_s"]
                    for form in ("autodiff", "transposed"):
                        cores = row.get(f"train_{form}_cores_runs_per_s")
                        if cores is None:  # W1-100, or the lanes do not divide over the cores
                            continue
                        row[f"train_{form}_cores_vs_sequential"] = cores / seq
                        print(
                            f"{w:7s} R={r:3d} training alone, {form} weight gradient: "
                            f"{row[f'train_{form}_runs_per_s']:.1f} runs/s, over the cores "
                            f"{cores:.1f} ({row[f'train_{form}_cores_gflops']:.0f} GFLOP/s) "
                            f"= x{cores / seq:.2f} the sequential rate",
                            flush=True,
                        )
                else:
                    if mode != "sequential":
                        row["speedup_vs_sequential"] = (
                            row["runs_per_s"] / by_mode["sequential"]["runs_per_s"]
                        )
                    print(
                        f"{w:7s} R={r:3d} {mode:11s} {row['runs_per_s']:8.3f} runs/s "
                        f"(x{row.get('speedup_vs_sequential', 1.0):.2f}) "
                        f"{row['train_gflops']:5.1f} GFLOP/s "
                        f"group={row['runs_per_group']} warm-up {row['warmup_s']:.1f} s  "
                        f"peak RSS {row['peak_rss_gib']:.2f} GiB  load {row['load_avg_1m']:.1f}",
                        flush=True,
                    )
                rec.add(f"{w} R={r} {mode}", **row)
                rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
