"""Benchmark suites behind `fedjax-sim bench` and `benchmarks/*.py`.

Each measurement runs in its own process (`fedjax_sim.app.bench.worker`) so that its peak RSS is
its own, a crash or an out-of-memory kill stays contained, and no measurement can take the
machine down: before launching, the memory of the configuration is estimated
(`estimate_bytes`: data + chunk x per-client working set from XLA's buffer assignment + the
process baseline) and configurations above the budget are skipped with the reason; while it
runs a watchdog kills it at 1.25x the budget. Results go to `<out>/<suite>.jsonl`, a PNG
plot and a markdown table per suite. Each row is written as soon as it is measured
(`Session.keep`), so a run stopped by a time cap or an interrupt keeps every finished row.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

import fedjax_sim
from fedjax_sim import algorithms
from fedjax_sim.app import validate
from fedjax_sim.app.bench import baselines, measure, plots, report, runner, worker
from fedjax_sim.app.bench.config import SUITES, BenchConfig
from fedjax_sim.app.bench.results import finish, replace_rows, stamp, validate_row
from fedjax_sim.app.bench.workloads import (
    Workload,
    abstract_data,
    data_bytes,
    make_algorithm,
    make_model,
    model_flops,
    preset,
)
from fedjax_sim.runtime import distributed
from fedjax_sim.runtime.memory import GiB, default_budget_bytes
from fedjax_sim.runtime.parallel import fit_client_map

BASE_RSS = 700 * 2**20  # resident set of a worker process with jax loaded and a round compiled
MARGIN = 1.15
KILL_FACTOR = 1.25


# ------------------------------------------------------------------------------ memory
@functools.lru_cache(maxsize=64)
def per_client_bytes(w: Workload) -> int:
    """Working memory of one vmapped client of `w`: the slope of XLA's temporary + output
    buffers between cohorts of 2 and 4 (compiled from shapes only); an analytic bound
    (4 model copies + the client's data + 2 x activations of a batch) if XLA has no
    memory analysis or the algorithm cannot be built without data."""
    try:
        return max(
            1, (_round_buffers(w.replace(clients=4)) - _round_buffers(w.replace(clients=2))) // 2
        )
    except Exception:
        sizes = [a * b + b for a, b in zip(w.widths[:-1], w.widths[1:], strict=True)]
        acts = w.batch_size * sum(w.widths)
        return 4 * (4 * sum(sizes) + w.per_client * (w.input_dim + 1) + 2 * acts)


def _round_buffers(w: Workload) -> int:
    w = w.replace(mode="vmap")
    model, alg = make_model(w), make_algorithm(w)
    key = jax.random.key(0)
    state = jax.eval_shape(alg.init, jax.eval_shape(model.init, key), key)
    m = jax.jit(alg.step).lower(state, abstract_data(w), key).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)


def estimate_bytes(w: Workload, pcb: int) -> int:
    """Estimated peak RSS of measuring `w`: process baseline + data + live clients."""
    live = w.clients if w.mode == "vmap" else min(w.clients, w.map_batch or 8)
    return int(MARGIN * (BASE_RSS + data_bytes(w) + live * pcb))


def fit(w: Workload, budget: int) -> Workload:
    """`w` with the mode/chunk chosen by `parallel.fit_client_map` for the budget."""
    pcb = per_client_bytes(w)
    left = int(budget / MARGIN) - BASE_RSS - data_bytes(w)
    if left <= 0:
        raise ValueError(
            f"the data ({data_bytes(w) / GiB:.2f} GiB) and the process baseline "
            f"({BASE_RSS / GiB:.2f} GiB) alone exceed the budget {budget / GiB:.2f} GiB / {MARGIN}"
        )
    cmap = fit_client_map(w.clients, pcb, left)
    return w.replace(mode=cmap.mode, map_batch=cmap.batch_size)


# ------------------------------------------------------------------------------ running
def rss_of(pid: int) -> int:
    """Resident set of a process in bytes (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children_of(pid: int) -> list[int]:
    """Child process ids (Linux /proc; none where unavailable)."""
    children: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return children


def tree_rss(pid: int) -> int:
    """Resident set of a process and all its descendants (the pfl worker runs pfl in a child
    process of its own), in bytes."""
    return rss_of(pid) + sum(tree_rss(c) for c in children_of(pid))


def kill_tree(pid: int) -> None:
    """SIGKILL to a process's descendants, then to it."""
    for child in children_of(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


COMPETING_JOB = (
    "import numpy as np\na = np.ones((2048, 2048), np.float32)\nwhile True:\n    a @ a\n"
)


def autogroup_nice(pid: int | str = "self") -> str | None:
    """The nice value of process `pid`'s autogroup (its session's scheduling weight with
    `sched_autogroup`), None on a kernel without autogroups or for a process outside one (the
    kernel then prints an empty file: a process in a cpu cgroup, as on some CI machines)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            text = f.read()
    except OSError:
        return None
    return text.split("nice")[-1].strip() if "nice" in text else None


def same_weight_as_this_job(pid: int) -> None:
    """Gives process `pid`'s autogroup this process's autogroup nice value, so that the
    scheduler weighs the two jobs equally even where this one was started from a raised or
    lowered session. No-op without autogroups."""
    nice = autogroup_nice()
    if nice is None:
        return
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(nice)
    except OSError:
        pass


@contextlib.contextmanager
def competing_job(threads: int) -> Iterator[str | None]:
    """With `threads` > 0, one competing job until the block ends: a NumPy f32 2048^2 matmul
    loop with `threads` BLAS threads, in its own process session (with `sched_autogroup` the
    kernel then shares the cores between it and the measurements as between two users' jobs).
    Yields the description the rows carry as `competing_job` (None without one)."""
    if not threads:
        yield None
        return
    env = dict(os.environ)
    env.update(
        {v: str(threads) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", COMPETING_JOB],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        same_weight_as_this_job(proc.pid)
        time.sleep(1.0)  # NumPy imported and the loop running before the first measurement
        if proc.poll() is not None:
            raise RuntimeError(f"the competing job exited: {proc.stderr.read().decode()[-300:]}")
        yield f"numpy f32 2048x2048 matmul loop, {threads} BLAS thread{'s' * (threads > 1)}"
    finally:
        kill_tree(proc.pid)
        proc.wait()


def run_isolated(spec: dict[str, Any], kill_bytes: int, timeout_s: float) -> dict[str, Any]:
    """Runs `worker.run_spec(spec)` in a child process under an RSS (of its process tree)
    and time watchdog."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fedjax_sim.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    devices = int(spec["workload"].get("devices", 1))
    if env.get("JAX_PLATFORMS", "cpu") == "cpu":  # host devices: a start-up flag of XLA:CPU
        env["XLA_FLAGS"] = distributed.host_device_flags(devices, env.get("XLA_FLAGS", ""))
    cmd = [sys.executable, "-m", "fedjax_sim.app.bench.worker", json.dumps(spec)]
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
            t0, peak, reason = time.monotonic(), 0, None
            while proc.poll() is None:
                rss = tree_rss(proc.pid)
                peak = max(peak, rss)
                if rss > kill_bytes:
                    reason = (
                        f"killed by the watchdog: RSS {rss / GiB:.2f} GiB > "
                        f"{kill_bytes / GiB:.2f} GiB"
                    )
                elif time.monotonic() - t0 > timeout_s:
                    reason = f"killed by the watchdog: running longer than {timeout_s:.0f} s"
                if reason:
                    kill_tree(proc.pid)
                    proc.wait()
                    break
                time.sleep(0.1)
        with open(out_path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
        with open(err_path) as f:
            err_tail = f.read().strip().splitlines()[-3:]
    w = worker.workload_from(spec["workload"])
    if reason or not lines:
        reason = reason or f"worker failed (exit {proc.returncode}): {' | '.join(err_tail)}"
        return runner.skipped_row(spec["suite"], spec.get("label") or spec["task"], w, reason)
    row = json.loads(lines[-1])
    row["watchdog_peak_rss_bytes"] = peak
    return row


class Session:
    """Runs measurements for the suites of one `fedjax-sim bench` call. With `stamped` (the
    run's `results.stamp()`), every row is written to `<out>/<suite>.jsonl` when measured."""

    def __init__(
        self,
        cfg: BenchConfig,
        log: Callable[[str], None] = print,
        stamped: dict[str, Any] | None = None,
    ):
        validate.check_fields(cfg)  # e.g. --repeats >= 3 (median and min over >= 3)
        self.cfg = cfg
        self.log = log
        self.stamped = stamped
        self.budget = (
            int(cfg.memory_budget_gb * GiB) if cfg.memory_budget_gb else default_budget_bytes()
        )

    def keep(self, *rows: dict) -> None:
        """Writes `rows` now, stamped, into `<out>/<suite>.jsonl` (replacing the rows of their
        labels, keeping the others): a run stopped before its end keeps every row it finished.
        `run` writes them again at the end with what the suite derives from them (ratios,
        summaries). Nothing is written by a session without a stamp."""
        if self.stamped is None:
            return
        for suite in dict.fromkeys(r["suite"] for r in rows):
            mine = [r for r in rows if r["suite"] == suite]
            replace_rows(os.path.join(self.cfg.out, f"{suite}.jsonl"), finish(mine, self.stamped))

    def not_run(self, task: str, w: Workload) -> str | None:
        """Why a peer is not measured, decided without starting its process (which would
        import JAX and hold the accelerator for nothing): a cohort above
        `--peer-max-cohort`, or a missing runtime (torch, a venv peer's venv)."""
        if task != "torch" and task not in baselines.VENV_PEERS:
            return None
        cap = self.cfg.peer_max_cohort
        if cap is not None and w.clients > cap:
            return f"not run: cohort {w.clients} > --peer-max-cohort {cap}"
        return runner.peer_missing(task, self.cfg.peer_python(task))

    def measure(
        self,
        task: str,
        w: Workload,
        suite: str,
        label: str,
        tags: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict:
        """One measurement (in its own process with `--isolate`) -> its row, logged and
        written; `tags` are fields added to the row, `extra` goes to the worker's spec."""
        cfg = self.cfg
        spec = {
            "task": task,
            "workload": w.describe(),
            "suite": suite,
            "label": label,
            "repeats": cfg.repeats,
            "flops": cfg.flops,
            "peak_n": cfg.peak_n,
            **extra,
        }
        est = estimate_bytes(w, per_client_bytes(w)) if task in ("engine", "rounds") else 0
        reason = self.not_run(task, w)
        if reason:
            row = runner.skipped_row(suite, label, w, reason)
        elif est > self.budget:
            row = runner.skipped_row(
                suite,
                label,
                w,
                f"estimated memory {est / GiB:.2f} GiB > budget {self.budget / GiB:.2f} GiB",
                estimated_bytes=est,
            )
        elif cfg.isolate:
            timeout = 600 + 3 * (cfg.repeats + 2) * cfg.max_round_s
            row = run_isolated(spec, int(KILL_FACTOR * self.budget), timeout)
        else:
            row = worker.run_spec(spec)
        if est:
            row["estimated_bytes"] = est
        row["isolated"] = cfg.isolate
        row.update(tags or {})
        return self.done(row)

    def done(self, row: dict) -> dict:
        """A finished row: validated, written (`keep`), then logged (a printed row is on
        disk)."""
        validate_row(row, stamped=False)
        self.keep(row)
        self.log(report.one_line(row))
        return row

    # ---------------------------------------------------------------- workloads
    def main_workload(self) -> Workload:
        cfg = self.cfg
        w = preset(cfg.workload)
        overrides = {
            k: getattr(cfg, k)
            for k in (
                "algorithm",
                "model",
                "hidden",
                "clients",
                "local_steps",
                "batch_size",
                "per_client",
                "map_batch",
                "devices",
            )
            if getattr(cfg, k) is not None
        }
        if cfg.hparams:
            from fedjax_sim.app.config import parse_hparams

            overrides["hparams"] = tuple(sorted(parse_hparams(cfg.hparams).items()))
        w = w.replace(**overrides)
        return self.with_mode(w)

    def with_mode(self, w: Workload, mode: str | None = None) -> Workload:
        mode = mode or self.cfg.mode
        if mode == "preset":
            return w
        if mode == "fit":
            return fit(w, self.budget)
        return w.replace(mode=mode, map_batch=self.cfg.map_batch if mode == "map" else None)


# ------------------------------------------------------------------------------ suites
def suite_round(s: Session) -> list[dict]:
    w = s.main_workload()
    return [s.measure("engine", w, "round", f"{w.name} {w.algorithm} {w.mode_label}")]


System = tuple[str, Workload, str, dict[str, Any]]  # task, workload, label, spec extras


def baseline_systems(s: Session, w: Workload) -> list[System]:
    """The engine (sharded over `w.devices`, on one device, memory-fitted) and the peers on
    `w`: the per-client jitted loop, fedjax 0.0.17 (XLA's threads, like the loop), the
    PyTorch loop and pfl-research (each with one torch thread and with torch's default, or
    with `--torch-threads`)."""
    systems: list[System] = [("engine", w, f"fedjax_sim {w.mode_label}", {})]
    if w.devices > 1:  # the same engine on one device, side by side
        one = w.replace(devices=1)
        systems.append(("engine", one, f"fedjax_sim {one.mode_label}", {}))
    fitted = fit(w, s.budget)
    if fitted.mode_label != w.mode_label:
        systems.append(("engine", fitted, f"fedjax_sim fit: {fitted.mode_label}", {}))
    systems.append(("loop", w, "per-client python loop (jit client update)", {}))
    fedjax = baselines.VENV_PEERS["fedjax"]
    systems.append(("fedjax", w, fedjax.title, {"python": s.cfg.peer_python("fedjax")}))
    # torch with one thread and with its default (all cores): on a loaded machine OpenMP
    # threads that wait on each other can make the multi-threaded loop far slower
    threads = [s.cfg.torch_threads] if s.cfg.torch_threads else [1, None]
    for name, task in (("PyTorch per-client loop", "torch"), ("pfl-research", "pfl")):
        for t in threads:
            label = f"{name} ({t or 'default'} thread{'s' if t != 1 else ''})"
            extra: dict[str, Any] = {"torch_threads": t}
            if task == "pfl":
                extra["python"] = s.cfg.peer_python(task)
            systems.append((task, w, label, extra))
    return systems


def suite_baselines(s: Session) -> list[dict]:
    """Every system of `baseline_systems` at each cohort size (`--baseline-cohorts`, default
    the workload's), each measurement in its own process; the order of the systems is
    reversed at every other cohort so that a drift of the machine's speed during the run
    does not favour the systems measured first. A `speedups` summary per cohort. With
    cohorts, labels end in ` <workload> M=<cohort>` (rows of several workloads and cohorts
    share one file), each row names its `system` (the label without that tag) and every row
    of the run, summaries included, its `cohort_run` (`<workload> M=<cohort>`)."""
    base = s.main_workload().replace(algorithm="fedavg")
    cohorts = s.cfg.baseline_cohorts or (base.clients,)
    rows: list[dict] = []
    for i, c in enumerate(cohorts):
        run = f"{base.name} M={c}" if s.cfg.baseline_cohorts else None
        tag = f" {run}" if run else ""
        systems = baseline_systems(s, base.replace(clients=c))
        order = list(range(len(systems)))[:: -1 if i % 2 else 1]
        measured: dict[int, dict] = {}
        for j in order:
            task, w, label, extra = systems[j]
            tags = {"cohort_run": run, "system": label} if run else None
            measured[j] = s.measure(task, w, "baselines", label + tag, tags=tags, **extra)
        cohort_rows = [measured[j] for j in range(len(systems))]
        summary = _summary(speedups(cohort_rows, f"speedups{tag}"))
        if run:
            summary["cohort_run"] = run
        s.keep(summary)
        rows += [*cohort_rows, summary]
    return rows


def speedups(rows: list[dict], label: str) -> dict[str, Any]:
    """The best engine row's median over each peer's (`speedup_vs`, by label)."""
    summary: dict[str, Any] = {"kind": "summary", "suite": "baselines", "label": label}
    measured = [r for r in rows if r["kind"] == "round"]
    ours = [r for r in measured if r["engine"] == "fedjax_sim"]
    if ours:
        best = min(ours, key=lambda r: r["round_s_median"])
        summary["best"] = best["label"]
        summary["speedup_vs"] = {
            r["label"]: round(r["round_s_median"] / best["round_s_median"], 3)
            for r in measured
            if r["engine"] != "fedjax_sim"
        }
        torch_rows = [r for r in measured if r["engine"] == "torch-loop"]
        if torch_rows:
            fastest = min(r["round_s_median"] for r in torch_rows)
            summary["speedup_vs_fastest_torch"] = round(fastest / best["round_s_median"], 3)
    return summary


def suite_modes(s: Session) -> list[dict]:
    w = s.main_workload()
    variants = [w.replace(mode="vmap", map_batch=None)]
    variants += [w.replace(mode="map", map_batch=b) for b in s.cfg.map_batches]
    rows = [s.measure("engine", v, "modes", v.mode_label) for v in variants]
    fitted = fit(w, s.budget)
    rows.append(s.measure("engine", fitted, "modes", f"fit: {fitted.mode_label}"))
    ok = [r for r in rows if r["kind"] == "round"]
    summary: dict[str, Any] = {"kind": "summary", "suite": "modes", "label": "best mode"}
    if ok:
        best = min(ok, key=lambda r: r["round_s_median"])
        summary.update(best=best["label"], best_round_s=best["round_s_median"])
        fit_row = [r for r in ok if r["label"].startswith("fit")]
        if fit_row:
            summary["fit_vs_best"] = round(fit_row[0]["round_s_median"] / best["round_s_median"], 3)
    return rows + [_summary(summary)]


Point = tuple[str, Workload, str | None]  # label, workload, reason not to run it


def _sweep(s: Session, suite: str, points: list[Point], *, scale: Callable) -> list[dict]:
    """Measures points in order (increasing size); once one does not fit the budget or is
    predicted (from the last measured point, linearly in `scale(w)`) to exceed
    `max_round_s`, it and the rest are skipped with that reason."""
    rows: list[dict] = []
    last: tuple[float, float] | None = None
    stop: str | None = None
    for label, w, reason in points:
        if stop is None and reason is not None:
            stop = reason
        if stop is None and last is not None:
            predicted = last[1] * scale(w) / last[0]
            if predicted > s.cfg.max_round_s:
                stop = f"predicted {predicted:.0f} s/round > max_round_s {s.cfg.max_round_s:.0f}"
        if stop is not None:
            row = runner.skipped_row(suite, label, w, f"not run: {stop}")
            row["isolated"] = s.cfg.isolate
            rows.append(s.done(row))
            continue
        row = s.measure("engine", w, suite, label)
        rows.append(row)
        if row["kind"] == "round":
            last = (scale(w), row["round_s_median"])
        elif row["kind"] == "skipped":
            stop = f"a smaller configuration was skipped ({row['reason']})"
    return rows


def suite_cohort(s: Session) -> list[dict]:
    rows = []
    for name in s.cfg.cohort_workloads:
        base = preset(name)
        if s.cfg.local_steps:
            base = base.replace(local_steps=s.cfg.local_steps)
        points: list[Point] = []
        for c in sorted(s.cfg.cohorts):
            w = base.replace(clients=c)
            try:
                w = s.with_mode(w, "fit" if s.cfg.mode == "preset" else None)
            except ValueError as e:  # not even one client fits next to the data
                points.append((f"{name} M={c}", w, f"does not fit the memory budget: {e}"))
                continue
            points.append((f"{name} M={c} {w.mode_label}", w, None))
        sweep = _sweep(s, "cohort", points, scale=lambda w: w.client_steps)
        rows += sweep
        measured = [r for r in sweep if r["kind"] == "round"]
        rows.append(
            _summary(
                {
                    "kind": "summary",
                    "suite": "cohort",
                    "label": f"{name} largest cohort",
                    "workload_name": name,
                    "largest_measured": max((r["clients"] for r in measured), default=0),
                    "stopped_because": next(
                        (r["reason"] for r in sweep if r["kind"] == "skipped"), None
                    ),
                }
            )
        )
    return rows


def suite_steps(s: Session) -> list[dict]:
    base = s.main_workload()
    points = [(f"K={k}", base.replace(local_steps=k), None) for k in sorted(s.cfg.steps_list)]
    return _sweep(s, "steps", points, scale=lambda w: w.client_steps)


def suite_width(s: Session) -> list[dict]:
    base = s.main_workload().replace(model="mlp")
    points: list[Point] = []
    for width in sorted(s.cfg.widths):
        w = base.replace(hidden=(width, width))
        w = fit(w, s.budget) if s.cfg.mode == "fit" else w
        points.append((f"width {width}", w, None))
    return _sweep(s, "width", points, scale=model_flops)


def suite_algorithms(s: Session) -> list[dict]:
    base = s.main_workload()
    names = list(s.cfg.algorithms) or sorted(algorithms.ALGORITHMS)
    if "fedavg" in names:
        names.remove("fedavg")
    rows = []
    for name in ["fedavg", *names]:
        w = base.replace(algorithm=name)
        if name not in algorithms.ALGORITHMS:
            row = runner.skipped_row("algorithms", name, w, "not registered")
        else:
            row = s.measure("engine", w, "algorithms", name)
        rows.append(row)
    # FedAvg again at the end: on a shared machine the load drifts during a long table, and
    # the change of FedAvg's time between the two measurements bounds what the ratios mean
    end = s.measure("engine", base.replace(algorithm="fedavg"), "algorithms", "fedavg (end)")
    ref = rows[0] if rows[0]["kind"] == "round" else None
    drift = None
    if ref is not None and end["kind"] == "round":
        drift = round(end["round_s_median"] / ref["round_s_median"], 3)
    rows.append(end)
    for row in rows:
        if row["kind"] == "round" and ref is not None:
            row["ratio_to_fedavg"] = round(row["round_s_median"] / ref["round_s_median"], 3)
            per_client = row["round_s_median"] / max(row.get("clients_per_step", 1.0), 1.0)
            ref_per_client = ref["round_s_median"] / max(ref.get("clients_per_step", 1.0), 1.0)
            row["ratio_to_fedavg_per_client"] = round(per_client / ref_per_client, 3)
    skipped = {r["label"]: r["reason"] for r in rows if r["kind"] == "skipped"}
    return rows + [
        _summary(
            {
                "kind": "summary",
                "suite": "algorithms",
                "label": "kernel table",
                "measured": [r["label"] for r in rows if r["kind"] == "round"],
                "skipped": skipped,
                "fedavg_end_to_start": drift,
            }
        )
    ]


def suite_memory(s: Session) -> list[dict]:
    w = s.main_workload()
    rows = [s.measure("rounds", w, "memory", f"{r} rounds", rounds=r) for r in s.cfg.memory_rounds]
    ok = [r for r in rows if r["kind"] == "round"]
    summary: dict[str, Any] = {"kind": "summary", "suite": "memory", "label": "peak vs rounds"}
    if len(ok) >= 2:
        summary["peak_ratio_last_to_first"] = round(
            ok[-1]["peak_memory_bytes"] / ok[0]["peak_memory_bytes"], 4
        )
        summary["rounds"] = [r["rounds"] for r in ok]
    return rows + [_summary(summary)]


SUITE_FNS: dict[str, Callable[[Session], list[dict]]] = {
    "round": suite_round,
    "baselines": suite_baselines,
    "modes": suite_modes,
    "cohort": suite_cohort,
    "steps": suite_steps,
    "width": suite_width,
    "algorithms": suite_algorithms,
    "memory": suite_memory,
}
assert tuple(SUITE_FNS) == SUITES


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    row.update(time=measure.now(), machine=measure.machine_info())
    validate_row(row, stamped=False)
    return row


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Runs the configured suites; writes `<out>/<suite>.jsonl` (rows stamped with commit,
    machine, load and command; each row as soon as it is measured, all of them again when the
    suite ends; a re-run replaces the rows of the labels it measures again), `.md` and
    `.png`."""
    stamped = stamp()
    with competing_job(cfg.competing_threads) as job:
        if job:
            stamped["competing_job"] = job
        return _run_suites(cfg, log, stamped)


def _run_suites(
    cfg: BenchConfig, log: Callable[[str], None], stamped: dict[str, Any]
) -> dict[str, list[dict]]:
    session = Session(cfg, log, stamped)
    job = (
        f"; beside one competing job ({stamped['competing_job']})"
        if "competing_job" in stamped
        else ""
    )
    log(
        f"fedjax-sim bench: suites {', '.join(cfg.suite)}; memory budget "
        f"{session.budget / GiB:.1f} GiB; machine {json.dumps(measure.machine_info())}{job}"
    )
    results = {}
    for name in cfg.suite:
        rows = finish(SUITE_FNS[name](session), stamped)
        results[name] = rows
        replace_rows(os.path.join(cfg.out, f"{name}.jsonl"), rows)
        table = report.markdown(rows)
        with open(os.path.join(cfg.out, f"{name}.md"), "w") as f:
            f.write(table + "\n")
        log(table)
        if cfg.plots:
            path = plots.plot_suite(name, rows, os.path.join(cfg.out, f"{name}.png"))
            if path:
                log(f"plot: {path}")
    return results
