"""PROJECTION (not a measurement): W1 and the 10^6-client logistic round on one H100.

No accelerator is available here. This script compiles each round from shapes only (no data
is allocated) and reads XLA's cost analysis of the compiled round: FLOPs and bytes accessed,
with every `lax.scan` body multiplied by its trip count (XLA counts loop bodies once; same
correction as `fedjax_sim.app.bench.measure.loop_aware_flops`). The round time on one H100 SXM is
then bounded below by the roofline `max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)` with
NVIDIA's published peaks (FP32 non-tensor 67 TFLOP/s, TF32 tensor 495 TFLOP/s dense, HBM3
3.35 TB/s, 80 GB). Caveats: the cost analysis is XLA:CPU's (FLOPs do not depend on the
backend; bytes accessed depend on fusion, which differs on GPU); a real round also pays
kernel launches and the sequential local-step loop (10 dependent steps per client), so the
bound is optimistic.

Memory plan: per-client working memory = slope of XLA's temporary + output buffers of the
vmapped round between cohorts of 2 and 4 (`bench.suites.per_client_bytes`); the largest
cohort per mode in 80 GB (10 % headroom) with the data on device, and with the data
streamed (`simulate_streamed`: only the cohort's rows, 3 copies in flight).

Usage: nice python benchmarks/h100_projection.py  # -> benchmarks/results/h100_projection.jsonl
"""

from __future__ import annotations

import argparse

import jax
from jax.extend import core as jex

from fedjax_sim.app.bench import measure, suites, workloads
from fedjax_sim.app.bench.results import Recorder

H100 = {
    "name": "NVIDIA H100 SXM5 80GB (published peaks)",
    "fp32_flops": 67e12,
    "tf32_tensor_flops": 495e12,
    "hbm_bytes_per_s": 3.35e12,
    "memory_bytes": 80e9,
}
HEADROOM = 0.9
MEASURED_CPU = {  # seconds per round measured on this project's 2-core CPU machine
    "W1": (3.83, "benchmarks/README.md, W1 one device, map(1)"),
    "LR-1e6": (76.0, "benchmarks/README.md, LR cohort sweep at 10^6 clients"),
}


def _true_cost(closed: jex.ClosedJaxpr, key: str, x: float | None = None) -> float:
    if x is None:
        x = float(measure._cost(measure._compile_closed(closed)).get(key, 0.0))
    total = x
    for body, length in measure._loops(closed.jaxpr)[0]:
        if length == 1:
            continue
        xb = float(measure._cost(measure._compile_closed(body)).get(key, 0.0))
        total += length * _true_cost(body, key, xb) - xb
    return total


def project(w: workloads.Workload, label: str) -> dict:
    w = w.replace(mode="vmap", map_batch=None)
    model, alg = workloads.make_model(w), workloads.make_algorithm(w)
    key = jax.random.key(0)
    state = jax.eval_shape(alg.init, jax.eval_shape(model.init, key), key)
    data = workloads.abstract_data(w)
    closed = jax.make_jaxpr(alg.step)(state, data, key)
    compiled = jax.jit(alg.step).lower(state, data, key).compile()
    top = measure._cost(compiled)
    flops = _true_cost(closed, "flops", float(top.get("flops", 0.0)))
    nbytes = _true_cost(closed, "bytes accessed", float(top.get("bytes accessed", 0.0)))
    t_fp32 = max(flops / H100["fp32_flops"], nbytes / H100["hbm_bytes_per_s"])
    t_tf32 = max(flops / H100["tf32_tensor_flops"], nbytes / H100["hbm_bytes_per_s"])
    pcb = suites.per_client_bytes(w)
    data_pc = workloads.data_bytes(w) / w.clients
    params_bytes = 4 * sum(a * b + b for a, b in zip(w.widths[:-1], w.widths[1:], strict=True))
    budget = HEADROOM * H100["memory_bytes"] - 4 * params_bytes
    plan = {
        "vmap, data on device": int(budget // (pcb + data_pc)),
        "map(8), data on device": int((budget - 8 * pcb) // data_pc),
        "vmap, data streamed": int(budget // (pcb + 3 * data_pc)),
        "map(8), data streamed": int((budget - 8 * pcb) // (3 * data_pc)),
    }
    cpu, cpu_src = MEASURED_CPU[label]
    return {
        "label": label,
        "workload": w.describe(),
        "flops": flops,
        "bytes_accessed": nbytes,
        "arithmetic_intensity": flops / max(nbytes, 1.0),
        "bound_seconds_fp32": t_fp32,
        "bound_seconds_tf32": t_tf32,
        "bound_by": "memory"
        if nbytes / H100["hbm_bytes_per_s"] > flops / H100["fp32_flops"]
        else "compute (fp32)",
        "per_client_work_bytes": pcb,
        "per_client_data_bytes": data_pc,
        "largest_cohort_in_80GB": plan,
        "measured_cpu_seconds": cpu,
        "measured_cpu_source": cpu_src,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="JSON lines (default benchmarks/results/h100_projection.jsonl)")
    args = p.parse_args()
    rec = Recorder("h100_projection", args.out)
    rows = [
        project(workloads.preset("W1"), "W1"),
        project(workloads.preset("LR").replace(clients=1_000_000), "LR-1e6"),
    ]
    for r in rows:
        print(
            f"{r['label']}: {r['flops'] / 1e9:.1f} GFLOP, {r['bytes_accessed'] / 1e9:.1f} GB "
            f"accessed, bound {r['bound_seconds_fp32'] * 1e3:.1f} ms (fp32) / "
            f"{r['bound_seconds_tf32'] * 1e3:.1f} ms (tf32), {r['bound_by']}; cohort plan "
            f"{r['largest_cohort_in_80GB']}"
        )
        fields = {k: v for k, v in r.items() if k != "label"}
        rec.add(r["label"], projection=True, device=H100, **fields)
    rec.write()


if __name__ == "__main__":
    main()
