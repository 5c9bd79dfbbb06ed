"""Scaling of a FedAvg round with the number of devices the client axis is sharded over.

Each device count runs in its own subprocess (virtual CPU devices are an XLA flag fixed at
start-up; on a GPU/TPU host the real devices are used). Reports seconds/round, client-steps/s
and the scaling efficiency `t(1) / (n * t(n))`: rows in benchmarks/results/device_scaling.jsonl
(`--out` elsewhere), one per device count.

    python benchmarks/device_scaling.py --devices 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> None:
    import jax

    from fedjax_sim.algorithms import LocalSpec, fedavg
    from fedjax_sim.app.bench.measure import machine_info
    from fedjax_sim.runtime.parallel import ClientMap, client_mesh

    sys.path.insert(0, os.path.dirname(__file__))
    from round_throughput import make_data

    from fedjax_sim.models import mlp

    data = make_data(args.clients, args.per_client)
    model = mlp((784,), 10, hidden=tuple(args.hidden))
    mesh = client_mesh(args.worker_devices) if args.worker_devices > 1 else None
    cmap = ClientMap(args.mode, args.map_batch, mesh=mesh)
    alg = fedavg(
        model.loss,
        client_optimizer=0.05,
        local=LocalSpec(steps=args.steps, batch_size=args.batch),
        client_map=cmap,
    )
    key = jax.random.key(0)
    state = alg.init(model.init(key), key)
    step = jax.jit(alg.step)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, data, key))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, data, key))
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(
        json.dumps(
            {
                "devices": args.worker_devices,
                "machine": machine_info(),
                "clients": args.clients,
                "steps": args.steps,
                "batch": args.batch,
                "mode": args.mode,
                "map_batch": args.map_batch,
                "compile_s": compile_s,
                "round_s_median": med,
                "round_s_min": min(times),
                "round_s": times,
                "client_steps_per_s": args.clients * args.steps / med,
            }
        )
    )


def main() -> None:
    from fedjax_sim.app.bench.results import Recorder
    from fedjax_sim.runtime.distributed import host_device_flags  # JAX starts in the children

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-client", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, nargs="+", default=[200, 200])
    parser.add_argument("--mode", default="map")
    parser.add_argument("--map-batch", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="default benchmarks/results/device_scaling.jsonl")
    parser.add_argument("--worker-devices", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_devices:
        worker(args)
        return
    rec = Recorder("device_scaling", args.out, machine=False)
    rows = []
    for n in args.devices:
        env = dict(os.environ)
        if env.get("JAX_PLATFORMS", "cpu") == "cpu":
            env["XLA_FLAGS"] = host_device_flags(n, env.get("XLA_FLAGS", ""))
        cmd = [sys.executable, __file__, "--worker-devices", str(n), *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
    base = rows[0]["round_s_median"] * rows[0]["devices"]
    for row in rows:
        row["efficiency"] = base / (row["devices"] * row["round_s_median"])
        print(json.dumps(row), flush=True)
        rec.add(f"{row['devices']} devices", **row)
    rec.write()


if __name__ == "__main__":
    main()
