"""Where one vmapped FedAvg round of `lora_cohort.py`'s LoRA transformer spends its time on
XLA:CPU: a per-op profile (`jax.profiler` trace of `--rounds` rounds after two warm-up
rounds), printed as fractions of the executed ops' time, by op kind and for the top ops with
their HLO shapes. Fractions, not timings: nothing here is a result row.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/profile_lora_step.py --cohort 64

Found at M = 64 (2 cores under load, 2 rounds), with `models.transformer.lora_dense` (session
42): YNNPACK fusions (the base's GEMMs, the attention) ~64 %, XLA:CPU's generic dots ~4 %,
transposes ~6 %, element-wise fusions (GELU, layer norm, softmax) the rest. Before it, plain
autodiff's adapter-gradient dots (`dA = x^T (g B^T)`, `dB = (x A)^T g`, contracting the
activations' rows) ran on the generic dot, ~14-25 % of the round for < 1 % of its FLOPs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import lora_cohort  # noqa: E402
from round_profile import hlo_op_times  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cohort", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", choices=("lora", "full"), default="lora")
    p.add_argument("--client-map", choices=("vmap", "map"), default="vmap")
    p.add_argument("--map-batch", type=int, default=1)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    client_map, _ = lora_cohort.make_client_map(args.client_map, args.map_batch, devices=1)
    step, state, data, _ = lora_cohort.compiled(
        args.variant, args.cohort, lora_cohort.problem(), client_map
    )
    for r in range(2):
        state, _ = step(state, data, jax.random.key(r))
    jax.block_until_ready(state)

    def run():
        s = state
        for r in range(args.rounds):
            s, _ = step(s, data, jax.random.key(10 + r))
            jax.block_until_ready(s)

    hlo = step.as_text()
    ops = hlo_op_times(run, hlo)
    total = sum(ops.values())
    kinds = collections.Counter()
    for name, us in ops.items():
        kinds[name.rstrip("0123456789").rstrip(".")] += us
    print(f"{len(ops)} ops, {total / 1e3:.0f} ms over {args.rounds} rounds; by kind:")
    for kind, us in kinds.most_common(10):
        print(f"  {100 * us / total:5.1f} %  {kind}")
    print("top ops:")
    for name, us in ops.most_common(args.top):
        line = re.search(rf"^\s*(?:ROOT )?%?{re.escape(name)} = (\S+ \w+)", hlo, re.M).group(1)
        print(f"  {100 * us / total:5.1f} %  {name}: {line}")


if __name__ == "__main__":
    main()
