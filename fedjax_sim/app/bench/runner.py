"""One measurement -> one result row (in the current process).

`measure_engine` times our compiled round, `measure_loop` the per-client jitted loop,
`measure_torch` the PyTorch per-client loop, `measure_venv_peer` pfl-research's simulator or
fedjax's FedAvg (each in its own venv's python), `measure_rounds_memory` the peak memory of a
scanned multi-round run. Each row carries the matmul peak measured in the same process
(`peak`, measured here if not given) and the machine info. Peak memory is process-wide:
run each measurement in its own process when it matters (`fedjax_sim.app.bench.suites`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
from jax import lax

from fedjax_sim.app.bench import baselines, measure
from fedjax_sim.app.bench.workloads import Workload, build, make_algorithm, model_flops
from fedjax_sim.core import extras


def _clients_per_step(metrics: dict[str, Any], w: Workload) -> float:
    """Clients that trained in the step: `participants` (synchronous rounds) or `fired`
    (asynchronous event iterations), else the whole cohort."""
    for name in ("participants", "fired"):
        if name in metrics:
            return float(np.asarray(metrics[name]))
    return float(w.clients)


def _client_steps(metrics: dict[str, Any], w: Workload) -> float:
    """Local steps done in the step: trained clients x their mean `local_steps` metric (e.g.
    1 for FedSGD, fewer for stragglers), else `w.local_steps` each."""
    steps = float(np.asarray(metrics["local_steps"])) if "local_steps" in metrics else None
    return _clients_per_step(metrics, w) * (w.local_steps if steps is None else steps)


def _sig(t: float) -> float:
    """Six significant digits (times from microseconds to minutes)."""
    return float(f"{t:.6g}")


def round_row(
    *,
    suite: str,
    label: str,
    engine: str,
    w: Workload,
    repeats: int,
    times: list[float],
    first_round_s: float,
    peak: dict[str, float],
    compile_s: float | None = None,
    flops: float | None = None,
    flops_method: str | None = None,
    xla_memory: int | None = None,
    extra: dict[str, Any] | None = None,
    client_steps: float | None = None,
) -> dict[str, Any]:
    """A `kind="round"` row (see `fedjax_sim.app.bench.results`). `client_steps`: local steps
    done per round (default: the workload's clients x local steps)."""
    med = statistics.median(times)
    client_steps = w.client_steps if client_steps is None else client_steps
    mem, source = measure.peak_memory()
    achieved = flops / med if flops is not None else None
    row = {
        "kind": "round",
        "suite": suite,
        "label": label,
        "engine": engine,
        "workload": w.describe(),
        "algorithm": w.algorithm,
        "mode": w.mode_label if engine == "fedjax_sim" else engine,
        "clients": w.clients,
        "local_steps": w.local_steps,
        "batch_size": w.batch_size,
        "repeats": repeats,
        "compile_s": None if compile_s is None else _sig(compile_s),
        "first_round_s": _sig(first_round_s),
        "round_s": [_sig(t) for t in times],
        "round_s_median": _sig(med),
        "round_s_min": _sig(min(times)),
        "client_steps_per_s": round(client_steps / med, 2),
        "examples_per_s": round(client_steps * w.batch_size / med, 2),
        "flops_xla": flops,
        "flops_method": flops_method,
        "flops_model": model_flops(w),
        "achieved_flops_per_s": achieved,
        "peak_flops_per_s": peak["peak_flops_per_s"],
        "matmul_n": peak.get("matmul_n"),
        "roofline_ratio": None
        if achieved is None
        else round(achieved / peak["peak_flops_per_s"], 4),
        "model_flops_ratio": round(model_flops(w) / med / peak["peak_flops_per_s"], 4),
        "peak_memory_bytes": int(mem),
        "memory_source": source,
        "xla_memory_bytes": xla_memory,
        "time": measure.now(),
        "machine": measure.machine_info(),
    }
    row.update(extra or {})
    return row


def skipped_row(suite: str, label: str, w: Workload | None, reason: str, **extra) -> dict:
    return {
        "kind": "skipped",
        "suite": suite,
        "label": label,
        "workload": None if w is None else w.describe(),
        "reason": reason,
        "time": measure.now(),
        "machine": measure.machine_info(),
        **extra,
    }


def peer_missing(task: str, python: str | None = None) -> str | None:
    """Why a peer cannot run here (its runtime is missing), else None: `task` "torch" (the
    optional extra `peers`) or a venv peer of `baselines.VENV_PEERS` (its venv; `python` as
    `measure_venv_peer` takes it)."""
    if task == "torch" and not extras.installed("peers"):
        return extras.message("peers", "the PyTorch baseline")
    peer = baselines.VENV_PEERS.get(task)
    if peer is not None and peer.python(python) is None:
        return f"no {peer.title} venv ({python or peer.venv_python} missing): run {peer.recipe}"
    return None


def measure_engine(
    w: Workload,
    *,
    repeats: int = 3,
    suite: str = "round",
    label: str | None = None,
    peak: dict[str, float] | None = None,
    flops: bool = True,
) -> dict[str, Any]:
    """Times `jit(algorithm.step)` on the workload: compile, first round, `repeats` rounds."""
    peak = peak or measure.matmul_peak()
    b = build(w)
    rss_before = measure.current_rss_bytes()
    t = measure.time_round(b.algorithm.step, b.state, b.data, b.key, repeats)
    count, method = None, None
    if flops and w.devices > 1:
        # sharding does not change the arithmetic; scan bodies inside a shard_map cannot be
        # compiled on their own (unbound axis name), so count the unsharded program
        step = make_algorithm(w.replace(devices=1), b.data).step
        count, method = measure.loop_aware_flops(step, b.state, b.data, b.key)
        method += "; counted on the unsharded program"
    elif flops:
        count, method = measure.loop_aware_flops(
            b.algorithm.step, b.state, b.data, b.key, compiled=t["compiled"]
        )
    return round_row(
        suite=suite,
        label=label or f"{w.algorithm} {w.mode_label}",
        engine="fedjax_sim",
        w=w,
        repeats=repeats,
        times=t["times"],
        first_round_s=t["first_round_s"],
        compile_s=t["compile_s"],
        peak=peak,
        flops=count,
        flops_method=method,
        xla_memory=measure.xla_memory_bytes(t["compiled"]),
        client_steps=_client_steps(t["metrics"], w),
        extra={
            "rss_before_bytes": rss_before,
            "clients_per_step": _clients_per_step(t["metrics"], w),
        },
    )


def measure_loop(
    w: Workload,
    *,
    repeats: int = 3,
    suite: str = "baselines",
    label: str = "per-client python loop (jit client update)",
    peak: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The per-client Python loop over a jitted client update (FedAvg only)."""
    peak = peak or measure.matmul_peak()
    b = build(w.replace(algorithm="fedavg", devices=1))
    run = baselines.loop_round(b.model, b.data, b.state.params, b.key, w)
    t = measure.time_calls(run, repeats)
    return round_row(
        suite=suite,
        label=label,
        engine="python-loop",
        w=w,
        repeats=repeats,
        times=t["times"],
        first_round_s=t["first_round_s"],
        peak=peak,
    )


def measure_torch(
    w: Workload,
    *,
    repeats: int = 3,
    suite: str = "baselines",
    label: str = "PyTorch per-client loop",
    peak: dict[str, float] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The plain PyTorch per-client FedAvg loop (skipped row if torch is missing)."""
    missing = peer_missing("torch")
    if missing:
        return skipped_row(suite, label, w, missing)
    peak = peak or measure.matmul_peak()
    b = build(w.replace(algorithm="fedavg", devices=1))
    x, y, counts = (np.asarray(a) for a in (b.data.x, b.data.y, b.data.counts))
    peer = baselines.TorchFedAvg(w, jax.device_get(b.state.params), x, y, counts, threads=threads)
    del b, x, y
    t = measure.time_calls(peer.round, repeats)
    import torch

    return round_row(
        suite=suite,
        label=label,
        engine="torch-loop",
        w=w,
        repeats=repeats,
        times=t["times"],
        first_round_s=t["first_round_s"],
        peak=peak,
        extra={
            "torch": torch.__version__,
            "torch_threads": peer.threads,
            "torch_device": str(peer.device),
        },
    )


def measure_venv_peer(
    name: str,
    w: Workload,
    *,
    repeats: int = 3,
    suite: str = "baselines",
    label: str | None = None,
    peak: dict[str, float] | None = None,
    threads: int | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """FedAvg in the venv peer `name` of `baselines.VENV_PEERS` (pfl-research, fedjax):
    `repeats + 1` rounds in one process of the venv's python, the first reported as
    `first_round_s`; peak memory is that process's. Skipped row if the venv is missing."""
    peer = baselines.VENV_PEERS[name]
    label = label or peer.title
    missing = peer_missing(name, python)
    if missing:
        return skipped_row(suite, label, w, missing)
    peak = peak or measure.matmul_peak()
    out = peer.run(baselines.peer_spec(w, repeats + 1, threads), peer.python(python))
    laps = out["round_s"]
    row = round_row(
        suite=suite,
        label=label,
        engine=name,
        w=w,
        repeats=repeats,
        times=laps[1:],
        first_round_s=laps[0],
        peak=peak,
        extra={key: out[key] for key in peer.fields},
    )
    row.update(
        peak_memory_bytes=int(out["peak_rss_bytes"]), memory_source=f"{name}_process_peak_rss"
    )
    return row


def measure_rounds_memory(
    w: Workload, rounds: int, *, suite: str = "memory", peak: dict | None = None
) -> dict[str, Any]:
    """Peak memory of `rounds` rounds under one jitted `lax.scan` (metrics stacked, as
    `simulate` does between evaluations): it should not grow with the number of rounds."""
    peak = peak or measure.matmul_peak()
    b = build(w)

    @jax.jit
    def run(state):
        return lax.scan(lambda s, _: b.algorithm.step(s, b.data, b.key), state, None, length=rounds)

    t0 = time.perf_counter()
    compiled = run.lower(b.state).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(b.state))
    total = time.perf_counter() - t0
    return round_row(
        suite=suite,
        label=f"{rounds} rounds (one scan)",
        engine="fedjax_sim",
        w=w,
        repeats=1,
        times=[total / rounds],
        first_round_s=total / rounds,
        compile_s=compile_s,
        peak=peak,
        xla_memory=measure.xla_memory_bytes(compiled),
        extra={"rounds": rounds, "run_s": round(total, 4)},
    )
