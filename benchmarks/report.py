"""Regenerates the tables of benchmarks/README.md from the rows in benchmarks/results/.

Each table sits between `<!-- table:NAME:begin -->` and `<!-- table:NAME:end -->` and is
rendered by `TABLES[NAME]` from the rows of its suites (`benchmarks/results/SUITE.jsonl`; by
default the suite NAME), followed by lines derived from the rows (summary rows, skipped
configurations, ratios the prose would otherwise restate) and the record line (commit,
machine, load, command of the rows). Numbers are rounded here, once; nothing in the tables
is typed by hand. `tests/bench/test_report.py` fails when the README differs.

    PYTHONPATH=$PWD python benchmarks/report.py          # rewrite the README tables + FIGURES
    PYTHONPATH=$PWD python benchmarks/report.py --check  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from fedjax_sim.app.bench.report import summary_text
from fedjax_sim.app.bench.results import RESULTS, read_rows

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
# figures of client-steps/s vs the cohort size, one line per system (`plots.plot_suite`'s
# baselines plot), from the rows of tables: path under benchmarks/ -> tables (a system's point
# at a cohort is taken from the first table that has it)
FIGURES: dict[str, tuple[str, ...]] = {
    "figures/peers.png": ("peers",),
    "figures/peers_under_load.png": ("peers_under_load",),
    "figures/h200_peers.png": ("gpu_peers", "gpu_cohort"),
}
Row = dict[str, Any]
Column = tuple[str, Callable[[Row], Any]]
MEASURED = ("round", "measurement")


def num(v: Any, digits: int = 3) -> str:
    """3 significant digits below 1000, thousands separators above; `–` for missing."""
    if v is None or v == "":
        return "–"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def pct(v: Any) -> str:
    return "–" if v is None else f"{v:.1%}"


def gib(b: Any) -> str:
    return "–" if not b else f"{b / 2**30:.2f}"


def times(v: Any) -> str:
    return "–" if v is None else f"{v:.2f}x" if v >= 0.1 else f"{v:.3g}x"


def key(name: str, fmt: Callable[[Any], str] = num) -> Callable[[Row], str]:
    return lambda r: fmt(r.get(name))


def ratio(a: Any, b: Any) -> float | None:
    return None if a is None or b is None or not b else a / b


class Table(NamedTuple):
    """How one README table is made: the `columns` of each row that `pivot` makes of the
    measured rows of `suites` (default: the table's own name; `where` keeps some of them),
    the line each summary row becomes (`summary(row, rows)`) and derived lines (`notes`)."""

    columns: list[Column]
    suites: tuple[str, ...] = ()
    where: Callable[[Row], bool] | None = None
    pivot: Callable[[list[Row]], list[Row]] | None = None
    summary: Callable[[Row, list[Row]], str] | None = None
    notes: Callable[[list[Row]], list[str]] | None = None


# fedjax-sim bench rows (kind "round"): the columns every suite shares
BENCH: list[Column] = [
    ("configuration", lambda r: r["label"]),
    ("compile s", key("compile_s")),
    ("s/round median", key("round_s_median")),
    ("min", key("round_s_min")),
    ("client-steps/s", key("client_steps_per_s")),
    ("roofline (same-run peak)", key("roofline_ratio", pct)),
    ("peak RSS GiB", key("peak_memory_bytes", gib)),
]
PEAK: Column = ("matmul peak GFLOP/s", lambda r: num(r.get("peak_flops_per_s", 0) / 1e9 or None))


def per_round_ms(name: str) -> Callable[[Row], str]:
    """`streaming[name]` (seconds over a run, its last repeat) in ms per round."""
    return lambda r: num(r["streaming"][name] / r["rounds"] * 1e3)


def find(rows: list[Row], label: str) -> Row | None:
    return next((r for r in rows if r["label"] == label), None)


# --- summaries and derived lines of the fedjax-sim bench suites -------------------------


def round_throughput_summary(s: Row, rows: list[Row]) -> str:
    best, loop = find(rows, s["best_mode"]), next(r for r in rows if r["engine"] != "fedjax_sim")
    on_min = ratio(loop["round_s_min"], best["round_s_min"])
    return (
        f"best engine mode {s['best_mode']}: **{times(s['speedup_vs_loop'])} the per-client "
        f"jitted loop** (medians; {times(on_min)} on each one's best round)"
    )


def baselines_summary(s: Row, rows: list[Row]) -> str:
    vs = "; ".join(f"**{times(x)}** {name}" for name, x in s["speedup_vs"].items())
    one = next(r for r in rows if r["engine"] == "fedjax_sim" and r["workload"]["devices"] == 1)
    loop = next(r for r in rows if r["engine"] == "python-loop")
    one_vs = ratio(loop["round_s_median"], one["round_s_median"])
    return (
        f"best row {s['best']} (medians) vs: {vs}. On one device ({one['label']}): "
        f"{times(one_vs)} the jitted loop."
    )


def modes_summary(s: Row, rows: list[Row]) -> str:
    fit = next((r["label"] for r in rows if r["label"].startswith("fit")), "fit")
    return (
        f"{s['best']} ({num(s['best_round_s'])} s/round); the memory fit's choice "
        f"({fit}) takes {times(s['fit_vs_best'])} its time"
    )


def algorithms_summary(s: Row, rows: list[Row]) -> str:
    skipped = ", ".join(f"{k} ({v})" for k, v in s["skipped"].items()) or "none"
    return (
        f"{len(s['measured'])} rows measured (every registered algorithm, FedAvg again at the "
        f"end), skipped: {skipped}; FedAvg at the end / at the start: "
        f"**{times(s['fedavg_end_to_start'])}** (the noise level of the ratio column)"
    )


def memory_summary(s: Row, rows: list[Row]) -> str:
    a, b = s["rounds"][0], s["rounds"][-1]
    return (
        f"peak RSS at {b} rounds / at {a} rounds: **{s['peak_ratio_last_to_first']:.3f}** "
        "(target: within 10 %)"
    )


def cohort_summary(s: Row, rows: list[Row]) -> str:
    stop = s["stopped_because"] or "the requested cohorts all ran"
    return f"largest cohort measured {num(s['largest_measured'])} ({stop})"


def client_bytes(w: Row) -> int:
    """Generated client data per client: `per_client` float32 rows of features + label,
    plus the int32 count."""
    return w["per_client"] * (w["input_dim"] + 1) * 4 + 4


def cohort_notes(rows: list[Row]) -> list[str]:
    out = []
    for name in dict.fromkeys(r["workload"]["name"] for r in rows):
        rs = sorted((r for r in rows if r["workload"]["name"] == name), key=lambda r: r["clients"])
        per = ", ".join(
            num(r["round_s_median"] / r["clients"] * 1e6) for r in rs if r["clients"] >= 100
        )
        a, b = rs[-2], rs[-1]
        slope = (b["peak_memory_bytes"] - a["peak_memory_bytes"]) / (b["clients"] - a["clients"])
        data = client_bytes(b["workload"])
        out.append(
            f"{name}: us per client-round (M >= 100): {per}; peak RSS slope between "
            f"M = {num(a['clients'])} and {num(b['clients'])}: **{num(round(slope))} bytes per "
            f"client**, client data {num(data)} bytes per client ({times(slope / data)})"
        )
    return out


def steps_width(rows: list[Row]) -> list[Row]:
    """Steps and width side by side, one row each."""
    steps = [r for r in rows if r["suite"] == "steps"]
    width = [r for r in rows if r["suite"] == "width"]
    out = []
    for i in range(max(len(steps), len(width))):
        s = steps[i] if i < len(steps) else {}
        w = width[i] if i < len(width) else {}
        out.append({"s": s, "w": w})
    return out


def side(part: str, name: str, fmt: Callable[[Any], str] = num) -> Callable[[Row], str]:
    return lambda r: fmt(r[part].get(name))


def width_of(r: Row) -> str:
    return num(r["w"]["workload"]["hidden"][0]) if r["w"] else "–"


def peak_of(part: str) -> Callable[[Row], str]:
    return lambda r: num(r[part].get("peak_flops_per_s", 0) / 1e9 or None)


# --- peers: the baselines suite over cohorts, with pfl-research and fedjax --------------
SYSTEM_ORDER = ("fedjax_sim", "python-loop", "fedjax", "torch-loop", "pfl")


def peers_rows(rows: list[Row]) -> list[Row]:
    """Rows by workload, cohort, then system (engine first); `vs_best_engine`: this row's
    median over the best engine row's of the same workload and cohort (> 1: the engine is
    faster)."""
    out = []
    for r in rows:
        same = [
            o
            for o in rows
            if o["engine"] == "fedjax_sim"
            and o["clients"] == r["clients"]
            and o["workload"]["name"] == r["workload"]["name"]
        ]
        best = min((o["round_s_median"] for o in same), default=None)
        out.append({**r, "vs_best_engine": ratio(r["round_s_median"], best)})
    order = {name: i for i, name in enumerate(dict.fromkeys(r["workload"]["name"] for r in rows))}
    return sorted(
        out,
        key=lambda r: (
            order[r["workload"]["name"]],
            r["clients"],
            SYSTEM_ORDER.index(r["engine"]),
        ),
    )


PEERS: list[Column] = [
    ("system", lambda r: r.get("system", r["label"])),
    ("workload", lambda r: r["workload"]["name"]),
    ("M", key("clients")),
    ("s/round median", key("round_s_median")),
    ("min", key("round_s_min")),
    ("client-steps/s", key("client_steps_per_s")),
    ("model FLOPs / matmul peak", key("model_flops_ratio", pct)),
    ("round time / best engine's", key("vs_best_engine", times)),
    ("peak RSS GiB", key("peak_memory_bytes", gib)),
]
UNDER_LOAD = "under_load/baselines"


def competing_notes(rows: list[Row]) -> list[str]:
    jobs = sorted({r["competing_job"] for r in rows})
    return [f"competing job (its own process session, the whole run): {'; '.join(jobs)}"]


def peers_summary(s: Row, rows: list[Row]) -> str:
    vs = "; ".join(f"**{times(x)}** {name}" for name, x in s.get("speedup_vs", {}).items())
    return f"best engine row {s.get('best', '–')} (medians) vs: {vs or 'nothing measured'}"


# --- benchmarks/*.py suites --------------------------------------------------------------


def ms(v: Any) -> str:
    return "–" if v is None else num(v * 1e3)


def first_s(r: Row) -> str:
    return num(r.get("first_call_s", r.get("seconds", r.get("first_load_s"))))


def warm_s(r: Row) -> str:
    """Median of the warm calls (for a dataset: of the loads from its cache)."""
    loads = r.get("cached_load_s")
    return num(statistics.median(loads) if loads else r.get("warm_s_median"))


def projected_s(r: Row) -> float:
    """Roofline: max(FLOPs / FP32 peak, bytes / HBM bandwidth)."""
    return max(r["bound_seconds_fp32"], r["bytes_accessed"] / r["device"]["hbm_bytes_per_s"])


def projected_ms(r: Row) -> str:
    return num(projected_s(r) * 1e3)


def device_speedup(r: Row) -> str:
    return times(r["efficiency"] * r["devices"])


def per_client_state_notes(rows: list[Row]) -> list[str]:
    lines = []
    for alg in dict.fromkeys(r["algorithm"] for r in rows):
        parts = []
        for mode in dict.fromkeys(r["mode"] for r in rows):
            cs = sorted((r for r in rows if (r["algorithm"], r["mode"]) == (alg, mode)),
                        key=lambda r: r["clients"])  # fmt: skip
            if len(cs) >= 2:
                parts.append(f"{mode} {times(cs[-1]['median_s'] / cs[0]['median_s'])}")
        if parts:
            lines.append(f"{alg}: {', '.join(parts)}")
    cs = sorted({r["clients"] for r in rows})
    return [f"median at C = {num(cs[-1])} / at C = {num(cs[0])}: " + "; ".join(lines)]


def async_notes(rows: list[Row]) -> list[str]:
    """Per-iteration time at the largest C over the smallest C at (about) equal E."""
    out = []
    lo, hi = min(r["clients"] for r in rows), max(r["clients"] for r in rows)
    for a in (r for r in rows if r["clients"] == hi):
        for b in (r for r in rows if r["clients"] == lo):
            if abs(a["expected_firings"] / b["expected_firings"] - 1) < 0.05:
                x = a["s_per_iteration_median"] / b["s_per_iteration_median"]
                out.append(
                    f"per-iteration time at C = {num(hi)} / at C = {num(lo)}, equal expected "
                    f"firings E = {num(a['expected_firings'])}: **{times(x)}** (target < 3x)"
                )
    return out


def rss_samples(r: Row) -> list[list[float]]:
    """(time s, VmRSS bytes, rounds) samples while the process lived (RSS 0: it had ended)."""
    return [s for s in r["samples"] if s[1]]


def history_notes(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        s = rss_samples(r)
        if len(s) < 3:
            continue
        (t0, m0, n0), (t1, m1, n1) = next(x for x in s if x[2]), s[-1]
        out.append(
            f"{r['label']}: {num((n1 - n0) / (t1 - t0))} rounds/s from the first sample after "
            f"round 0 to the last; VmRSS {num(m0 / 2**20)} MiB at round {num(n0)} -> "
            f"{num(m1 / 2**20)} MiB at round {num(n1)}: **{num((m1 - m0) / 2**20)} MiB, "
            f"{num((m1 - m0) / (n1 - n0) / 1e3)} kB per round**"
        )
    return out


def sweep_pivot(rows: list[Row]) -> list[Row]:
    """One line per (workload, R): the modes side by side."""
    out: dict[tuple[str, int], Row] = {}
    for r in rows:
        out.setdefault((r["workload"], r["R"]), {"workload": r["workload"], "R": r["R"]})[
            r["mode"]
        ] = r
    return list(out.values())


def runs_vs(mode: str, groups: bool = False) -> Callable[[Row], str]:
    def cell(p: Row) -> str:
        r = p.get(mode)
        if r is None:
            return "–"
        g = f", groups of {r['runs_per_group']}" if groups and r.get("runs_per_group") else ""
        return f"{num(r['runs_per_s'])} ({times(r['speedup_vs_sequential'])}{g})"

    return cell


def training_alone(form: str) -> Callable[[Row], str]:
    def cell(p: Row) -> str:
        m = p.get("matmul", {})
        if f"train_{form}_cores_runs_per_s" not in m:
            return "–"
        x = m[f"train_{form}_cores_vs_sequential"]
        return f"{num(m[f'train_{form}_cores_runs_per_s'])} ({times(x)})"

    return cell


def of_bound(p: Row) -> str:
    cores, m = p.get("sweep-cores"), p.get("matmul", {})
    bound = m.get("train_autodiff_cores_vs_sequential")
    return pct(ratio(cores and cores["speedup_vs_sequential"], bound))


def sweep_trials_notes(rows: list[Row]) -> list[str]:
    """The spread behind each median cell measured in several trials (`--trials`): the sweep
    over the cores and its autodiff bound in each trial, and their per-trial ratio."""
    out = []
    for p in sweep_pivot(rows):
        sweeps = p.get("sweep-cores", {}).get("trial_figures", [])
        bounds = p.get("matmul", {}).get("trial_figures", [])
        if len(sweeps) < 2 or len(bounds) != len(sweeps):  # one trial has no spread to show
            continue
        pairs = list(zip(sweeps, bounds, strict=True))
        out.append(
            f"{p['workload']} R = {p['R']}, {len(pairs)} trials (sweep over the cores / autodiff "
            "bound, runs/s): " + ", ".join(f"{num(a)} / {num(b)} = {pct(a / b)}" for a, b in pairs)
        )
    return out


def vs_mean(rows: list[Row]) -> list[Row]:
    """Adds `vs_mean`: the mean's time / this aggregator's (same d and M)."""
    means = {(r["d"], r["M"]): r["seconds"] for r in rows if r["aggregator"] == "mean"}
    out = []
    for r in rows:
        x = None if r.get("skipped") else ratio(means.get((r["d"], r["M"])), r["seconds"])
        out.append({**r, "vs_mean": x})
    return out


def aggregators_notes(rows: list[Row]) -> list[str]:
    peaks = sorted({round(r["matmul_gflops"]) for r in rows if r.get("matmul_gflops")})
    return [f"2048^2 f32 matmul in the same run: {', '.join(map(num, peaks))} GFLOP/s"]


def h100_plan(rows: list[Row]) -> list[Row]:
    """The memory plan: one line per mode, one column per workload."""
    modes = list(dict.fromkeys(m for r in rows for m in r["largest_cohort_in_80GB"]))
    return [{"mode": m, **{r["label"]: r["largest_cohort_in_80GB"].get(m) for r in rows}}
            for m in modes]  # fmt: skip


def h100_plan_notes(rows: list[Row]) -> list[str]:
    return [
        f"{r['label']}: working memory {num(r['per_client_work_bytes'] / 1e3)} kB per client "
        f"(slope of XLA's temporary + output buffers of the vmapped round between cohorts of 2 "
        f"and 4), data {num(r['per_client_data_bytes'] / 1e3)} kB per client"
        for r in rows
    ]


def auto_choice(r: Row) -> str:
    c = r["auto_choice"]
    return c["mode"] if c.get("batch_size") is None else f"{c['mode']}({c['batch_size']})"


def over_best(mode: str) -> Callable[[Row], str]:
    return lambda r: times(ratio(r["median_seconds"][mode], r["median_seconds"][r["best_mode"]]))


def donation(r: Row) -> bool:
    return r["args"].get("cohort") == 20


def hypergradient_notes(rows: list[Row]) -> list[str]:
    """How memory and time grow with T: the factor per 10x rounds of each variant."""
    by = {(r["variant"], r["rounds"]): r for r in rows}
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        ts = sorted(t for v, t in by if v == variant)

        def growth(field: str, a: int, b: int, variant: str = variant) -> str:
            return times(ratio(by[variant, b][field], by[variant, a][field]))

        steps = [
            f"T {a} -> {b}: memory {growth('xla_temp_bytes', a, b)}, time {growth('run_s', a, b)}"
            for a, b in zip(ts, ts[1:], strict=False)
        ]
        if steps:
            lines.append(f"{variant}: " + "; ".join(steps))
    return lines


def clock_memory_notes(rows: list[Row]) -> list[str]:
    """C = 10^9 against C = 10^3 at the same cohort: the compiled program's memory."""
    small = next((r for r in rows if r["clients"] == 10**3), None)
    big = next(
        (r for r in rows if r["clients"] == 10**9 and small and r["cohort"] == small["cohort"]),
        None,
    )
    if not (small and big):
        return []
    fields = ("xla_argument_bytes", "xla_output_bytes", "xla_temp_bytes")
    same = all(small[f] == big[f] for f in fields)
    return [
        f"C = 1e9 vs C = 1e3 (cohort {small['cohort']:,}): XLA memory "
        f"{'identical' if same else '**differs**'}; peak RSS ratio "
        f"{big['peak_rss_bytes'] / small['peak_rss_bytes']:.3f}"
    ]


def lora_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if "cohort" in r]


def lora_notes(rows: list[Row]) -> list[str]:
    """Same-run ratios: LoRA over full client-steps/s per client map and M, the memory slope,
    the best LoRA engine row over each PyTorch loop row."""
    ours = [r for r in rows if r.get("engine") == "fedjax_sim"]
    by = {(r["workload"]["client_map"], r["variant"], r["cohort"]): r for r in ours}
    lines = []
    for mode in dict.fromkeys(r["workload"]["client_map"] for r in ours):
        speed = [
            f"M={m}: {by[mode, 'lora', m]['client_steps_per_s'] / r['client_steps_per_s']:.2f}x"
            for (md, v, m), r in by.items()
            if md == mode and v == "full" and (mode, "lora", m) in by
        ]
        if speed:
            lines.append(
                f"LoRA / full fine-tuning client-steps/s, {mode} (same run): " + ", ".join(speed)
            )
    for slope in (r for r in rows if r["label"].startswith("memory slope")):
        lo, hi = slope["cohorts"]
        over = slope["full_over_lora"]
        ratio_s = f" (full / LoRA {over:.2f}x)" if over else ""
        lines.append(
            f"{slope['label']}, XLA argument + temp bytes per extra client (M {lo} -> {hi}): LoRA "
            f"{slope['lora_bytes_per_client'] / 1024:,.1f} KiB, full fine-tuning "
            f"{slope['full_bytes_per_client'] / 1024:,.1f} KiB{ratio_s}"
        )
    for loop in (r for r in rows if r.get("engine") == "torch-loop"):
        mine = [r for r in ours if r["variant"] == "lora" and r["cohort"] == loop["cohort"]]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["client_steps_per_s"])
        on = f", on {loop['torch_device']}" if loop.get("torch_device") else ""
        threads = loop["torch_threads"]
        lines.append(
            f"fedjax_sim LoRA ({best['workload']['client_map']}) / PyTorch per-client LoRA loop "
            f"({threads} thread{'s' * (threads > 1)}, torch {loop['torch']}{on}) at "
            f"M={loop['cohort']}: {best['client_steps_per_s'] / loop['client_steps_per_s']:.2f}x "
            "client-steps/s"
        )
    return lines


# --- one H200 GPU (benchmarks/results/gpu/: the lease's rows) ---------------------------
GPU_BASELINES, GPU_COHORT = "gpu/h200_baselines", "gpu/h200_cohort"


def peak_gib(r: Row) -> float:
    """Peak device memory in GiB: as printed (rows made from a log: two decimals), else the
    row's bytes rounded the same way."""
    if "peak_memory_gib" in r:
        return r["peak_memory_gib"]
    return round(r["peak_memory_bytes"] / 2**30, 2)


def device_gib(r: Row) -> str:
    """Peak of JAX's allocator in the measuring process; not the PyTorch loop's memory
    (torch's allocator is not read)."""
    return "–" if r.get("engine") == "torch-loop" else num(peak_gib(r))


def memory_floor_note(rows: list[Row]) -> str:
    floor = min(peak_gib(r) for r in rows)
    n = sum(peak_gib(r) == floor for r in rows)
    torch = any(r["engine"] == "torch-loop" for r in rows)
    return (
        f"peak device memory: JAX's allocator peak (`peak_bytes_in_use`) in the measuring "
        f"process, which also holds the same-process matmul-peak arrays: {num(floor)} GiB in "
        f"{n} of {len(rows)} rows is that floor, not the configuration"
        + ("; the PyTorch rows' is not torch's allocator (left out)" if torch else "")
    )


def missing_cells(rows: list[Row]) -> list[str]:
    """Systems not measured at every cohort of the table (a run stopped by its cap)."""
    cohorts = sorted({r["clients"] for r in rows})
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        have = {r["clients"] for r in rows if r["system"] == system}
        if missing := [c for c in cohorts if c not in have]:
            out.append(f"{system} at M = {', '.join(map(num, missing))}")
    return out


def gpu_peers_notes(rows: list[Row]) -> list[str]:
    """The engine over each peer per cohort (medians), against issue 41's >= 1.5x the loop."""
    lines = []
    for m in sorted({r["clients"] for r in rows}):
        at = [r for r in rows if r["clients"] == m]
        best = min(r["round_s_median"] for r in at if r["engine"] == "fedjax_sim")
        loop = next((r for r in at if r["engine"] == "python-loop"), None)
        torch = [r for r in at if r["engine"] == "torch-loop"]
        parts = []
        if loop:
            x = loop["round_s_median"] / best
            verdict = "meets" if x >= 1.5 else "misses"
            parts.append(f"**{times(x)} the per-client jitted loop** ({verdict} >= 1.5x)")
        if torch:
            fastest = min(r["round_s_median"] for r in torch)
            parts.append(f"**{times(fastest / best)} the fastest PyTorch loop** (CUDA)")
        lines.append(f"M = {num(m)}: the engine is " + ", ".join(parts))
    if missing := missing_cells(rows):
        lines.append("not measured (the run ended at its time cap first): " + "; ".join(missing))
    lines.append(memory_floor_note(rows))
    return lines


def gpu_cohort_notes(rows: list[Row]) -> list[str]:
    out = []
    for name in dict.fromkeys(r["workload"]["name"] for r in rows):
        rs = sorted((r for r in rows if r["workload"]["name"] == name), key=lambda r: r["clients"])
        if len(rs) < 2:
            out.append(f"{name}: measured at M = {num(rs[0]['clients'])} only")
            continue
        a, b = rs[-2], rs[-1]
        grown = (peak_gib(b) - peak_gib(a)) * 2**30
        slope = grown / (b["clients"] - a["clients"])
        data = client_bytes(b["workload"])
        out.append(
            f"{name}: client-steps/s at M = {num(b['clients'])} / at M = {num(rs[0]['clients'])}: "
            f"**{times(b['client_steps_per_s'] / rs[0]['client_steps_per_s'])}**; peak device "
            f"memory slope between M = {num(a['clients'])} and {num(b['clients'])}: **"
            f"{num(round(slope))} bytes per client**, client data {num(data)} bytes per client"
        )
    return [*out, memory_floor_note(rows)]


def marginal_ratio(rows: list[Row], field: str) -> float | None:
    """`field`'s bytes per added round over the last span of T over those of the span before
    (three smallest-to-largest T): 1 for memory linear in T, 10^-1/2 for sqrt(T) over decades,
    0 once it stops growing; None with fewer than three T, or no growth at all."""
    rs = sorted(rows, key=lambda r: r["rounds"])
    if len(rs) < 3:
        return None
    (a, b, c) = rs[-3:]
    before = (b[field] - a[field]) / (b["rounds"] - a["rounds"])
    last = (c[field] - b[field]) / (c["rounds"] - b["rounds"])
    return None if before <= 0 else last / before


def hypergradient_target_notes(rows: list[Row]) -> list[str]:
    """Issue 36's target, per gradient variant: time <= 4x the forward pass at every T, and
    XLA temp memory sublinear in T: constant, or its bytes per added round falling by more
    than 10 % from one span of T to the next (linear growth keeps them equal)."""
    lines = hypergradient_notes(rows)
    ts = sorted({r["rounds"] for r in rows})
    fast, sublinear = [], []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["gradient"]):
        rs = [r for r in rows if r["variant"] == variant]
        worst = max(r["ratio_to_forward"] for r in rs)
        span = f"T = {num(min(r['rounds'] for r in rs))}-{num(max(r['rounds'] for r in rs))}"
        constant = len({r["xla_temp_bytes"] for r in rs}) == 1 and len(rs) > 1
        x = marginal_ratio(rs, "xla_temp_bytes")
        if constant:
            memory = "XLA temp constant in T"
        elif x is None:
            memory = "XLA temp growth: too few T to tell"
        else:
            memory = f"XLA temp bytes per added round, last span / the one before: {times(x)}"
        lines.append(f"{variant}: at most **{times(worst)} forward** ({span}); {memory}")
        fast += [variant] if worst <= 4 else []
        sublinear += [variant] if constant or (x is not None and x < 0.9) else []
    both = [v for v in fast if v in sublinear]
    lines.append(
        f"issue 36 target (<= 4x forward, memory sublinear in T): within 4x: "
        f"{', '.join(fast) or 'none'}; memory sublinear: {', '.join(sublinear) or 'none'}; "
        f"**both: {', '.join(both) or 'none'}**"
    )
    have = {(r["variant"], r["rounds"]) for r in rows}
    missing = [f"T={t} {v}" for t in ts for v in dict.fromkeys(r["variant"] for r in rows)
               if (v, t) not in have]  # fmt: skip
    if missing:
        lines.append("not measured (the part ended at its time cap first): " + ", ".join(missing))
    return lines


def projected(r: Row) -> tuple[str, int] | None:
    """(workload, cohort) of a round the H100 projection bounds."""
    if r["suite"] != "h100_projection":
        return None
    return r["workload"]["name"], r["workload"]["clients"]


def h100_vs_h200_where(r: Row) -> bool:
    """The projection's rows and the H200 engine rows of the same (workload, cohort)."""
    if r["suite"] == "h100_projection":
        return True
    rounds = {projected(p) for p in read_rows(os.path.join(RESULTS, "h100_projection.jsonl"))}
    return r.get("engine") == "fedjax_sim" and (r["workload"]["name"], r["clients"]) in rounds


def h100_vs_h200(rows: list[Row]) -> list[Row]:
    """One line per projected round that was measured on the H200 (best engine row)."""
    out = []
    for p in (r for r in rows if r["suite"] == "h100_projection"):
        same = [r for r in rows if r["suite"] != "h100_projection"
                and (r["workload"]["name"], r["clients"]) == projected(p)]  # fmt: skip
        if same:
            best = min(same, key=lambda r: r["round_s_median"])
            per_client = p["per_client_work_bytes"] + p["per_client_data_bytes"]
            memory = p["workload"]["clients"] * per_client
            out.append({"p": p, "m": best, "bound_s": projected_s(p), "memory": memory})
    return out


TABLES: dict[str, Table] = {
    "round_throughput": Table(BENCH, summary=round_throughput_summary),
    # the baselines suite run once per workload (no --baseline-cohorts) ...
    "baselines": Table(BENCH, where=lambda r: "cohort_run" not in r, summary=baselines_summary),
    # ... and over cohorts, with pfl-research and fedjax (rows with `cohort_run`)
    "peers": Table(
        PEERS,
        suites=("baselines",),
        where=lambda r: "cohort_run" in r and "competing_job" not in r,
        pivot=peers_rows,
        summary=peers_summary,
    ),
    # the same over cohorts beside one competing job (`fedjax-sim bench --competing-threads`)
    "peers_under_load": Table(
        PEERS,
        suites=(UNDER_LOAD,),
        where=lambda r: "cohort_run" in r and "competing_job" in r,
        pivot=peers_rows,
        summary=peers_summary,
        notes=competing_notes,
    ),
    "modes": Table(BENCH, summary=modes_summary),
    "cohort": Table(BENCH, summary=cohort_summary, notes=cohort_notes),
    "steps_width": Table(
        [
            ("K", side("s", "local_steps")),
            ("s/round", side("s", "round_s_median")),
            ("client-steps/s", side("s", "client_steps_per_s")),
            ("roofline", side("s", "roofline_ratio", pct)),
            ("matmul peak GFLOP/s", peak_of("s")),
            ("", lambda r: ""),
            ("width", width_of),
            ("s/round", side("w", "round_s_median")),
            ("client-steps/s", side("w", "client_steps_per_s")),
            ("roofline", side("w", "roofline_ratio", pct)),
            ("matmul peak GFLOP/s", peak_of("w")),
        ],
        suites=("steps", "width"),
        pivot=steps_width,
    ),
    "memory": Table([*BENCH, PEAK], summary=memory_summary),
    "algorithms": Table(
        [*BENCH, ("ratio to FedAvg (medians)", key("ratio_to_fedavg"))], summary=algorithms_summary
    ),
    "device_scaling": Table(
        [
            ("devices", key("devices")),
            ("s/round median", key("round_s_median")),
            ("client-steps/s", key("client_steps_per_s")),
            ("speed-up t(1) / t(n)", device_speedup),
            ("efficiency t(1) / (n t(n))", key("efficiency")),
        ]
    ),
    "partition_scaling": Table(
        [
            ("measurement", lambda r: r["label"]),
            ("first s", first_s),
            ("warm s", warm_s),
            ("N_max", key("n_max")),
            ("empty clients", key("empty_clients")),
            ("waste, 1 array", key("padding_waste")),
            ("/ examples", lambda r: times(ratio(r.get("padding_waste"), r.get("examples")))),
            ("4 buckets", key("waste_4_buckets")),
            ("8 buckets", key("waste_8_buckets")),
            ("/ examples", lambda r: times(ratio(r.get("waste_8_buckets"), r.get("examples")))),
            ("16 buckets", key("waste_16_buckets")),
        ]
    ),
    "per_client_state": Table(
        [
            ("algorithm", key("algorithm")),
            ("mode", key("mode")),
            ("C", key("clients")),
            ("ms/round median", lambda r: num(r["median_s"] * 1e3, 4)),
            ("ms/round min", lambda r: num(r["min_s"] * 1e3, 4)),
        ],
        notes=per_client_state_notes,
    ),
    "async_throughput": Table(
        [
            ("C", key("clients")),
            ("mean p", key("p_mean")),
            ("E[firings]", key("expected_firings")),
            ("slots", key("slots")),
            ("ms / iteration (median)", lambda r: num(r["s_per_iteration_median"] * 1e3)),
            ("iterations/s", key("iterations_per_s")),
            ("client updates/s", key("client_updates_per_s")),
            ("per-client state MB", lambda r: num(r["per_client_state_bytes"] / 1e6)),
            ("peak RSS MB", key("peak_rss_mb")),
        ],
        notes=async_notes,
    ),
    "history_scaling": Table(
        [
            ("rounds", key("rounds")),
            ("`simulate` s", key("simulate_s")),
            ("wall s (incl. start-up, data, compile)", key("wall_s")),
            ("VmRSS samples", lambda r: num(len(rss_samples(r)))),
            ("last VmRSS sample MiB", lambda r: num(rss_samples(r)[-1][1] / 2**20)),
        ],
        notes=history_notes,
    ),
    "sweep_throughput": Table(
        [
            ("workload", key("workload")),
            ("R", key("R")),
            ("sequential runs/s", lambda p: num(p["sequential"]["runs_per_s"])),
            ("sweep, planner: runs/s (x sequential)", runs_vs("sweep-auto", groups=True)),
            ("sweep over the cores", runs_vs("sweep-cores")),
            ("training alone over the cores, autodiff", training_alone("autodiff")),
            ("same, transposed weight gradient", training_alone("transposed")),
            ("sweep over the cores / autodiff bound", of_bound),
            ("2048^2 matmul GFLOP/s", lambda p: num(p.get("matmul", {}).get("peak_gflops"))),
        ],
        pivot=sweep_pivot,
        notes=sweep_trials_notes,
    ),
    "population_scaling": Table(
        [
            ("source", key("source")),
            ("population C", key("clients")),
            ("s/round (median of passes)", key("seconds_per_round")),
            ("peak RSS GiB", key("peak_rss_gib")),
            ("prefetch s/round (hidden)", key("prefetch_seconds_per_round")),
            ("wait for data ms/round", key("stall_seconds_per_round", ms)),
            ("overlap", key("overlap", pct)),
        ]
    ),
    "population_pairs": Table(
        [
            ("population C", key("clients")),
            ("device s/round", key("device_seconds_per_round")),
            ("disk s/round", key("disk_seconds_per_round")),
            ("disk / device", key("ratio", times)),
            ("prefetch s/round", key("prefetch_seconds_per_round")),
            ("wait for data s/round", key("stall_seconds_per_round")),
        ]
    ),
    "state_rows": Table(
        [
            ("configuration", lambda r: r["label"]),
            ("rows on device s/round", key("median_device")),
            ("rows on host s/round", key("median_host")),
            ("host / device", key("host_over_device", times)),
            ("row MB per round sent", key("row_mb_sent_per_round")),
            ("prefetch s/round", key("prefetch_s_per_round")),
            ("write-back s/round", key("writeback_s_per_round")),
            ("wait for rows s/round", key("stall_s_per_round")),
            ("overlap", key("overlap", pct)),
        ],
        where=lambda r: not donation(r),
    ),
    "state_rows_donation": Table(
        [
            ("configuration", lambda r: r["label"]),
            ("rows on device s/round", key("median_device")),
            ("rows on host s/round", key("median_host")),
            ("host / device", key("host_over_device", times)),
        ],
        suites=("state_rows",),
        where=donation,
    ),
    "personal_rows_scale": Table(
        [
            ("population C", key("clients")),
            ("s/round (median chunk / 3)", key("s_per_round")),
            ("peak RSS MiB", key("peak_rss_mib")),
            ("RSS after imports MiB", key("rss_after_imports_mib")),
            ("rows on disk MB", lambda r: num(r["rows_bytes"] / 1e6)),
            ("first chunk s (compile)", key("first_chunk_s")),
            ("wait for data ms/round", per_round_ms("stall_seconds")),
            ("write-back ms/round (overlapped)", per_round_ms("writeback_seconds")),
        ],
        summary=lambda s, rows: (
            f"peak RSS {times(s['peak_rss_ratio'])}, s/round {times(s['s_per_round_ratio'])}, "
            f"rows on disk {times(s['rows_bytes_ratio'])}."
        ),
    ),
    "client_map_auto": Table(
        [
            ("workload", key("workload")),
            *[
                (m, lambda r, m=m: num(r["median_seconds"].get(m)))
                for m in ("map(1)", "map(2)", "map(4)", "map(8)", "map(16)", "vmap")
            ],
            ("best", key("best_mode")),
            ("auto's choice", auto_choice),
            ("auto", lambda r: num(r["median_seconds"].get("auto"))),
            ("auto / best", over_best("auto")),
            ("old static rule map(8) / best", over_best("map(8)")),
            ("measuring took s", key("autotune_seconds")),
        ]
    ),
    "aggregators": Table(
        [
            ("d", key("d")),
            ("M", key("M")),
            ("aggregator", key("aggregator")),
            ("ms / reduce", lambda r: r.get("skipped") or num(r["seconds"] * 1e3)),
            ("updates/s", key("updates_per_s")),
            ("vs mean", key("vs_mean", times)),
            ("peak RSS GiB", key("peak_rss_gib")),
        ],
        pivot=vs_mean,
        notes=aggregators_notes,
    ),
    "h100_projection": Table(
        [
            ("round", lambda r: r["label"]),
            ("GFLOP", lambda r: num(r["flops"] / 1e9)),
            ("GB accessed", lambda r: num(r["bytes_accessed"] / 1e9)),
            ("FLOP/byte", key("arithmetic_intensity")),
            ("FP32 compute bound ms", lambda r: num(r["bound_seconds_fp32"] * 1e3)),
            ("projected round >= ms", projected_ms),
            ("bound by", key("bound_by")),
            ("measured here s", key("measured_cpu_seconds")),
        ]
    ),
    "h100_memory_plan": Table(
        [
            ("largest cohort in 80 GB (90 % usable)", key("mode")),
            ("W1", key("W1")),
            ("LR-1e6", key("LR-1e6")),
        ],
        suites=("h100_projection",),
        pivot=h100_plan,
        notes=h100_plan_notes,
    ),
    "hypergradient_cost": Table(
        notes=hypergradient_target_notes,
        columns=[
            ("configuration", lambda r: r["label"]),
            ("compile s", key("compile_s")),
            ("run s (median)", key("run_s")),
            ("ms/round", lambda r: num(1000 * r["s_per_round"])),
            ("x forward", lambda r: times(r.get("ratio_to_forward"))),
            ("remat chunk", key("remat_rounds")),
            ("XLA temp MiB", lambda r: num((r.get("xla_temp_bytes") or 0) / 2**20)),
        ],
    ),
    "no_slower": Table(
        [
            ("workload", lambda r: r["label"]),
            ("what is timed", key("what")),
            ("before s (median)", lambda r: num(statistics.median(r["seconds_before"]))),
            ("after s (median)", lambda r: num(statistics.median(r["seconds_after"]))),
            ("after / before per pair", lambda r: ", ".join(f"{x:.3f}" for x in r["ratios"])),
            ("median ratio", lambda r: f"{r['ratio_median']:.3f}"),
            ("within 2 %", lambda r: "yes" if r["within_2_percent"] else "**no**"),
            (
                "same compiled program",
                lambda r: {True: "yes", False: "no"}.get(r.get("same_compiled_program"), "–"),
            ),
        ]
    ),
    "clock_cost": Table(
        [
            ("device model", key("profile")),
            ("clock / no clock per pair", lambda r: ", ".join(f"{x:.3f}" for x in r["ratios"])),
            ("median ratio", lambda r: f"{r['ratio_median']:.3f}"),
            ("within 10 %", lambda r: "yes" if r["within_10_percent"] else "**no**"),
            ("XLA flops ratio", lambda r: f"{r['xla_flops_ratio']:.4f}"),
            ("XLA bytes ratio", lambda r: f"{r['xla_bytes_ratio']:.4f}"),
        ],
        where=lambda r: r["label"].startswith("time "),
    ),
    "clock_memory": Table(
        [
            ("clients C", lambda r: f"{r['clients']:.0e}"),
            ("cohort M", lambda r: f"{r['cohort']:.0e}"),
            ("XLA arguments KiB", lambda r: num(r["xla_argument_bytes"] / 1024)),
            ("XLA outputs KiB", lambda r: num(r["xla_output_bytes"] / 1024)),
            ("XLA temporaries KiB", lambda r: num(r["xla_temp_bytes"] / 1024)),
            ("peak RSS MiB (with the JAX runtime)", lambda r: num(r["peak_rss_bytes"] / 2**20)),
            ("largest id drawn", lambda r: f"{r['largest_id_drawn']:,}"),
        ],
        suites=("clock_cost",),
        where=lambda r: r["label"].startswith("memory "),
        notes=clock_memory_notes,
    ),
    "lora_cohort": Table(
        [
            ("configuration", lambda r: r["label"]),
            ("cohort M", key("cohort")),
            ("compile s", key("compile_s")),
            ("s/round median", key("round_s_median")),
            ("client-steps/s", key("client_steps_per_s")),
            ("XLA arguments MiB", lambda r: num(r.get("xla_argument_bytes", 0) / 2**20 or None)),
            ("XLA temporaries MiB", lambda r: num(r.get("xla_temp_bytes", 0) / 2**20 or None)),
            ("sent KiB / client", lambda r: num(r.get("sent_bytes_per_client", 0) / 1024 or None)),
        ],
        pivot=lora_rows,
        notes=lora_notes,
    ),
    "traced_hparams_scan": Table(
        [
            ("algorithm", key("algorithm")),
            ("traced", lambda r: ", ".join(r["traced_ok"]) or "–"),
            ("refused", lambda r: "; ".join(x.split(" (")[0] for x in r["refused"]) or "–"),
        ]
    ),
}


TABLES.update(
    gpu_peers=Table(
        [
            ("system", key("system")),
            ("M", key("clients")),
            ("s/round median", key("round_s_median")),
            ("min", key("round_s_min")),
            ("client-steps/s", key("client_steps_per_s")),
            ("round time / best engine's", key("vs_best_engine", times)),
            ("compile s", key("compile_s")),
            ("peak device GiB", device_gib),
        ],
        suites=(GPU_BASELINES,),
        pivot=peers_rows,
        notes=gpu_peers_notes,
    ),
    gpu_cohort=Table(
        [
            ("workload", lambda r: r["workload"]["name"]),
            ("M", key("clients")),
            ("compile s", key("compile_s")),
            ("s/round median", key("round_s_median")),
            ("min", key("round_s_min")),
            ("client-steps/s", key("client_steps_per_s")),
            ("peak device GiB", device_gib),
        ],
        suites=(GPU_COHORT,),
        notes=gpu_cohort_notes,
    ),
    # the CPU tables' columns, on the lease's rows
    gpu_hypergradient=TABLES["hypergradient_cost"]._replace(
        suites=("gpu/h200_hypergradient_cost",), notes=hypergradient_target_notes
    ),
    gpu_lora=TABLES["lora_cohort"]._replace(suites=("gpu/h200_lora_cohort",)),
    h100_vs_h200=Table(
        [
            ("round", lambda x: x["p"]["label"]),
            ("cohort M", lambda x: num(x["m"]["clients"])),
            ("H100 projected round >= ms", lambda x: num(x["bound_s"] * 1e3)),
            ("H200 measured ms (median)", lambda x: num(x["m"]["round_s_median"] * 1e3)),
            ("measured / projected", lambda x: times(x["m"]["round_s_median"] / x["bound_s"])),
            (
                "XLA:CPU FLOP count / measured time, TFLOP/s",
                lambda x: num(x["p"]["flops"] / x["m"]["round_s_median"] / 1e12),
            ),
            ("projected memory GiB (M x (work + data))", lambda x: gib(x["memory"])),
            ("H200 peak device GiB", lambda x: num(peak_gib(x["m"]))),
        ],
        suites=("h100_projection", GPU_BASELINES, GPU_COHORT),
        where=h100_vs_h200_where,
        pivot=h100_vs_h200,
    ),
)


def record(rows: list[Row]) -> str:
    """One line per distinct (commit, command): where the numbers come from."""
    seen: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        seen.setdefault((r["commit"], r["command"]), []).append(r)
    lines = []
    for (commit, command), group in seen.items():
        m, load = group[0]["machine"], group[0]["load"]
        if isinstance(m, dict):
            parts = [m.get("cpu_model"), m.get("cpu_count") and f"{m['cpu_count']} cores"]
            parts += [m.get("memory_gib") and f"{m['memory_gib']} GiB"]
            parts += [m.get("device_kind") and f"device {m['device_kind']}"]
            parts += [m.get("jax") and f"jax {m['jax']}"]
            machine = ", ".join(str(p) for p in parts if p) or "unknown"
            machine += f" ({m['note']})" if m.get("note") else ""
        else:
            machine = m
        if isinstance(load, dict):
            span = f"{num(load['start_1m'])} -> {num(load['end_1m'])}"
            load_s = f"{span} ({load['note']})" if load.get("note") else span
        else:
            load_s = load
        lines.append(
            f"Rows {', '.join(r['label'] for r in group[:3])}{', ...' if len(group) > 3 else ''}"
            f": commit `{commit}`; machine: {machine}; load (1 min): {load_s}; "
            f"command: `{command}`."
        )
    return "\n".join(f"<sub>{line}</sub>\n" for line in lines).rstrip("\n")


def figure_rows(names: tuple[str, ...]) -> list[Row]:
    """The rows of the tables `names`, one per (workload, cohort, system): the first's."""
    seen, out = set(), []
    for r in (r for name in names for r in table_rows(name)):
        if r["kind"] in MEASURED:
            k = (r["workload"]["name"], r["clients"], r.get("system", r["label"]))
            if k not in seen:
                seen.add(k)
                out.append(r)
    return out


def sources(name: str) -> tuple[str, ...]:
    return TABLES[name].suites or (name,)


def table_rows(name: str) -> list[Row]:
    """The rows of the table's suites that it keeps (`where`)."""
    rows = [r for s in sources(name) for r in read_rows(os.path.join(RESULTS, f"{s}.jsonl"))]
    where = TABLES[name].where
    return [r for r in rows if where(r)] if where else rows


def table(name: str, rows: list[Row] | None = None) -> str:
    spec = TABLES[name]
    if rows is None:
        rows = table_rows(name)
    elif spec.where:
        rows = [r for r in rows if spec.where(r)]
    measured = [r for r in rows if r["kind"] in MEASURED]
    body = spec.pivot(measured) if spec.pivot else measured
    cols = spec.columns
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(f(r)) for _, f in cols) + " |" for r in body]
    notes = []
    for r in rows:
        if r["kind"] == "skipped":
            notes.append(f"- {r['label']}: skipped ({r['reason']})")
        elif r["kind"] == "summary":
            text = spec.summary(r, measured) if spec.summary else summary_text(r)
            notes.append(f"- {r['label']}: {text}")
    notes += [f"- {line}" for line in (spec.notes(measured) if spec.notes else [])]
    return "\n".join([*lines, "", *notes, *([""] if notes else []), record(rows)])


MARK = re.compile(r"(<!-- table:(\w+):begin -->\n)(.*?)(<!-- table:\2:end -->)", re.S)


def render(text: str) -> str:
    return MARK.sub(lambda m: f"{m[1]}{table(m[2])}\n{m[4]}", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = ap.parse_args(argv)
    with open(README) as f:
        text = f.read()
    new = render(text)
    if args.check:
        if new != text:
            print("benchmarks/README.md tables are stale: run benchmarks/report.py")
        return int(new != text)
    with open(README, "w") as f:
        f.write(new)
    from fedjax_sim.app.bench.plots import plot_suite  # matplotlib: only when writing

    for path, names in FIGURES.items():
        plot_suite("baselines", figure_rows(names), os.path.join(os.path.dirname(README), path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
