"""Where one engine round of a `fedjax-sim bench` workload spends its time on XLA:CPU: a
per-op profile (`jax.profiler` trace of `--rounds` rounds after one warm-up round), as
fractions of the executed ops' time, grouped by layer and pass (the `op_name` metadata XLA
keeps: `Conv_1`, `Dense_0`, forward or `transpose(jvp(...))` = backward) and for the top ops
with their HLO shapes. Fractions, not timings: nothing here is a result row.

    PYTHONPATH=$PWD python benchmarks/round_profile.py --workload cifar_pfl --map-batch 1 \\
        --devices 2

Found on `cifar_pfl` (pfl's CIFAR CNN, map(batch_size=1), 2 host devices, one round; 2
cores under heavy load, so memory-bound ops weigh more than on quiet cores). Before the
one-client chunk stopped vmapping: conv-2 GEMMs 38 % (forward 10, weight gradient 19 with
its g^T copy, input gradient 9), conv-2 patch extraction (9 slices + concatenate) 14 %, its
col2im 4 %, the dense layer 27 % (13 of it the strided transposed add of its kernel
gradient and a copy), conv 1 6 %, max-pool 4 %. After: conv-2 GEMMs 35 % (11, 13, 11),
patch extraction 18 %, col2im 4 %, dense 23 % (its update 6 %, the per-step kernel copy
3 %), conv 1 6 %, max-pool 5 %; sampling and aggregation < 3 % in both.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable


def hlo_op_times(run: Callable[[], None], hlo: str) -> collections.Counter:
    """Microseconds per HLO instruction of `hlo` (the compiled program's text) while `run()`
    executes under a `jax.profiler` trace: XLA:CPU names its op events after them."""
    import jax

    with tempfile.TemporaryDirectory() as log:
        jax.profiler.start_trace(log, create_perfetto_trace=True)
        run()
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(log, "**", "*perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    defined = set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", hlo, re.M))
    ops: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name in defined and not name.startswith(("while", "call")):
            ops[name] += e["dur"]
    return ops


def group(line: str) -> str:
    """`layer pass` of an HLO instruction line from its op_name metadata."""
    op = re.search(r'op_name="([^"]*)"', line)
    op = op.group(1) if op else ""
    layer = re.findall(r"(Conv_\d+|Dense_\d+|reduce_max|_randint|_threefry\w*|gather)", op)
    side = "backward" if "transpose(jvp" in op else "forward"
    if not layer and "jvp" in op:
        return f"model {side}"
    if not layer:  # the local step's optimizer and loss, or the round around local training
        return "local step, outside the model" if "while/body" in op else "round"
    name = {"reduce_max": "max-pool", "gather": "minibatch gather"}.get(layer[-1], layer[-1])
    return name if name.startswith(("_", "minibatch")) else f"{name} {side}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="cifar_pfl")
    p.add_argument("--mode", default="map", choices=("map", "vmap"))
    p.add_argument("--map-batch", type=int, default=1)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    from fedjax_sim.runtime.distributed import host_device_flags

    os.environ["XLA_FLAGS"] = host_device_flags(args.devices, os.environ.get("XLA_FLAGS", ""))
    import jax

    from fedjax_sim.app.bench.workloads import build, preset

    w = preset(args.workload).replace(
        mode=args.mode, map_batch=args.map_batch, devices=args.devices
    )
    b = build(w)
    step = jax.jit(b.algorithm.step).lower(b.state, b.data, b.key).compile()
    jax.block_until_ready(step(b.state, b.data, b.key))

    def run():
        for _ in range(args.rounds):
            jax.block_until_ready(step(b.state, b.data, b.key))

    hlo = step.as_text()
    ops = hlo_op_times(run, hlo)
    lines = {
        n: re.search(rf"^\s*(?:ROOT )?%?{re.escape(n)} = (.*)$", hlo, re.M).group(1) for n in ops
    }
    total = sum(ops.values())
    groups = collections.Counter()
    for name, us in ops.items():
        groups[group(lines[name])] += us
    head = f"{w.name} {w.mode_label}: {len(ops)} ops, {total / 1e3:.0f} ms"
    print(f"{head} over {args.rounds} rounds")
    for g, us in groups.most_common():
        print(f"  {100 * us / total:5.1f} %  {g}")
    print("top ops:")
    for name, us in ops.most_common(args.top):
        shape = lines[name].split(" ")[0]
        print(f"  {100 * us / total:5.1f} %  {name} {shape}  [{group(lines[name])}]")


if __name__ == "__main__":
    main()
