"""What the virtual clock costs (issue 38 item 5): round time of the default job with and
without a device model, and the clock's memory at 10^9 procedural clients.

    PYTHONPATH=$PWD python benchmarks/clock_cost.py --pairs 10 --rounds 200

- `time <profile>`: the default job of `fedjax-sim run` (FedAvg, digits, 100 clients,
  cohort 10, 10 local steps, MLP; `build_run(RunConfig())`) against the same job with
  `--device-model <profile>`, both as the run loop compiles them (one `lax.scan` of
  `--rounds` rounds that stacks every round's metrics). Both programs are compiled first,
  then timed alternately in one process (A B, B A, A B, ...: neither always runs first);
  the ratio is clock / no clock per pair, and its median is compared with the 10 % target;
  XLA's cost analysis of the two compiled programs (flops, bytes accessed; each loop body
  counted once) gives the same comparison without the machine's noise.
  `always_on` (every client online, no dropout) trains exactly the clients the run without
  a clock trains, so its ratio is the clock's own cost; `phones` (availability windows,
  dropout) and `bundled` (the 64-device trace) add the profile lookups of a realistic run
  (their unavailable clients still occupy their cohort slot: the same work).
- `memory C=.. M=..`: `DeviceModel(ProceduralProfiles(), deadline=60).plan` for a cohort of
  M ids drawn from C clients, compiled alone (XLA's memory analysis: arguments, outputs,
  temporaries) and run for 20 rounds of fresh ids in a fresh process (peak RSS, which
  includes the JAX runtime). Nothing of size C exists: at C = 10^9 the program is the one
  of C = 10^3, and it grows with M only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fedjax_sim.app.bench.results import Recorder  # noqa: E402

PROFILES = ("always_on", "phones", "bundled")


def _job(device_model: str | None, rounds: int):
    """`(compiled chunk, state, data, key)` of the default job (with `--device-model`)."""
    import jax
    from jax import lax

    from fedjax_sim.app.config import RunConfig, build_run

    cfg = RunConfig(device_model=device_model)
    explicit = {"device_model"} if device_model else set()
    dataset, model, alg, _ = build_run(cfg, None, explicit)
    key = jax.random.key(cfg.seed)
    state = alg.init(model.init(key), key)
    data = dataset.train

    def chunk(state, data, key):
        return lax.scan(lambda s, _: alg.step(s, data, key), state, None, length=rounds)

    run = jax.jit(chunk).lower(state, data, key).compile()
    jax.block_until_ready(run(state, data, key))  # warm-up
    return run, state, data, key


def xla_cost(run) -> dict:
    """XLA's cost analysis of a compiled chunk (flops, bytes accessed): noise-free."""
    cost = run.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def time_pairs(profile: str, pairs: int, rounds: int) -> dict:
    import jax

    jobs = {"plain": _job(None, rounds), "clock": _job(profile, rounds)}
    seconds: dict[str, list[float]] = {"plain": [], "clock": []}
    for pair in range(pairs):
        order = ["plain", "clock"] if pair % 2 == 0 else ["clock", "plain"]
        for name in order:
            run, state, data, key = jobs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, data, key))
            seconds[name].append((time.perf_counter() - t0) / rounds)
    ratios = [c / p for c, p in zip(seconds["clock"], seconds["plain"], strict=True)]
    median = statistics.median(ratios)
    plain, clock = xla_cost(jobs["plain"][0]), xla_cost(jobs["clock"][0])
    return dict(
        xla_flops_ratio=clock["flops"] / plain["flops"],
        xla_bytes_ratio=clock["bytes accessed"] / plain["bytes accessed"],
        profile=profile,
        rounds_per_measurement=rounds,
        s_per_round_plain=seconds["plain"],
        s_per_round_clock=seconds["clock"],
        ratios=ratios,
        ratio_median=median,
        within_10_percent=median <= 1.10,
    )


PLAN = """
import resource, sys
import jax, jax.numpy as jnp
from fedjax_sim.algorithms.device_model import DeviceModel, ProceduralProfiles
C, M = int(sys.argv[1]), int(sys.argv[2])
model = DeviceModel(ProceduralProfiles(), deadline=60.0)
def plan(clock, key, ids):
    w = jnp.ones(ids.shape)
    steps = jnp.full(ids.shape, 10, jnp.int32)
    return model.plan(clock, key, ids, w, steps, keep=M, bytes_down=4e5, bytes_up=4e5)
draw = jax.jit(lambda k: jax.random.randint(k, (M,), 0, C))
key = jax.random.key(0)
clock = model.init()
f = jax.jit(plan).lower(clock, key, draw(key)).compile()
ma = f.memory_analysis()
top = 0
for t in range(20):
    ids = draw(jax.random.fold_in(key, t))
    top = max(top, int(ids.max()))
    clock = f(clock, jax.random.fold_in(key, 1000 + t), ids).clock
jax.block_until_ready(clock)
print("MEM", ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, top)
"""


def plan_memory(num_clients: int, cohort: int) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", PLAN, str(num_clients), str(cohort)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MEM "))
    args, out, temp, rss, top = (int(v) for v in line.split()[1:])
    return dict(
        clients=num_clients,
        cohort=cohort,
        xla_argument_bytes=args,
        xla_output_bytes=out,
        xla_temp_bytes=temp,
        peak_rss_bytes=rss,
        largest_id_drawn=top,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=200, help="rounds per timed chunk (the job)")
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=None, help="rows file (default: the suite's file)")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.rounds < 1:
        p.error("--pairs and --rounds must be >= 1")
    rec = Recorder("clock_cost", args.out)
    for profile in args.profiles:
        row = time_pairs(profile, args.pairs, args.rounds)
        rec.add(f"time {profile}", **row)
        rec.write()
        print(f"{profile}: clock / no clock median {row['ratio_median']:.3f}", flush=True)
    if not args.no_memory:
        for c, m in ((10**3, 10**3), (10**9, 10**3), (10**9, 10**4)):
            row = plan_memory(c, m)
            rec.add(f"memory C=1e{len(str(c)) - 1} M=1e{len(str(m)) - 1}", **row)
            rec.write()
            print(row, flush=True)


if __name__ == "__main__":
    main()
