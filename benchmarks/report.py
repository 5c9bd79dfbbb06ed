"""Regenerates the tables of benchmarks/README.md from the rows in benchmarks/results/.

Each table sits between `<!-- table:SUITE:begin -->` and `<!-- table:SUITE:end -->` and is
rendered from `benchmarks/results/SUITE.jsonl` by `TABLES[SUITE]`, followed by the record
line (commit, machine, load, command of the rows). Numbers are rounded here, once; nothing
in the tables is typed by hand. `tests/bench/test_report.py` fails when the README differs.

    PYTHONPATH=$PWD python benchmarks/report.py          # rewrite the README tables
    PYTHONPATH=$PWD python benchmarks/report.py --check  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from fedjax_sim.bench.results import RESULTS, read_rows

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
Row = dict[str, Any]
Column = tuple[str, Callable[[Row], Any]]


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
    return "–" if v is None else f"{v:.2f}x"


def key(name: str, fmt: Callable[[Any], str] = num) -> Callable[[Row], str]:
    return lambda r: fmt(r.get(name))


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


def by_cores(r: Row) -> str:
    cores = r.get("train_autodiff_cores_vs_sequential")
    return "–" if cores is None else times(cores)


TABLES: dict[str, list[Column]] = {
    "round_throughput": BENCH,
    "baselines": BENCH,
    "modes": BENCH,
    "cohort": BENCH,
    "steps": [*BENCH[:1], ("K", key("local_steps")), *BENCH[1:]],
    "width": BENCH,
    "memory": [*BENCH, ("rounds", key("memory_rounds"))],
    "algorithms": [*BENCH, ("ratio to FedAvg (medians)", key("ratio_to_fedavg"))],
    "device_scaling": [
        ("devices", key("devices")),
        ("s/round median", key("round_s_median")),
        ("client-steps/s", key("client_steps_per_s")),
        ("efficiency t(1) / (n t(n))", key("efficiency")),
    ],
    "partition_scaling": [
        ("measurement", lambda r: r["label"]),
        ("first s", lambda r: num(r.get("first_call_s", r.get("seconds", r.get("first_load_s"))))),
        ("warm s", lambda r: num(r.get("warm_s_median"))),
        ("N_max", key("n_max")),
        ("empty clients", key("empty_clients")),
        ("waste, 1 array", key("padding_waste")),
        ("4 buckets", key("waste_4_buckets")),
        ("8 buckets", key("waste_8_buckets")),
        ("16 buckets", key("waste_16_buckets")),
    ],
    "per_client_state": [
        ("algorithm", key("algorithm")),
        ("mode", key("mode")),
        ("C", key("clients")),
        ("ms/round median", lambda r: num(r["median_s"] * 1e3, 4)),
        ("ms/round min", lambda r: num(r["min_s"] * 1e3, 4)),
    ],
    "async_throughput": [
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
    "history_scaling": [
        ("rounds", key("rounds")),
        ("`simulate` s", key("simulate_s")),
        ("wall s (incl. start-up, data, compile)", key("wall_s")),
        (
            "last VmRSS sample MiB",
            lambda r: num(r["samples"][-1][1] / 2**20 if r["samples"] else None),
        ),
    ],
    "sweep_throughput": [
        ("workload", key("workload")),
        ("R", key("R")),
        ("mode", key("mode")),
        ("runs/s", key("runs_per_s")),
        ("x sequential", key("speedup_vs_sequential", times)),
        ("training GFLOP/s", key("train_gflops")),
        ("runs per group", key("runs_per_group")),
        ("peak RSS GiB", key("peak_rss_gib")),
        ("training alone over the cores, x sequential", by_cores),
        ("2048^2 matmul GFLOP/s", key("peak_gflops")),
    ],
    "population_scaling": [
        ("source", key("source")),
        ("population C", key("clients")),
        ("s/round (median of passes)", key("seconds_per_round")),
        ("peak RSS GiB", key("peak_rss_gib")),
        ("prefetch s/round (hidden)", key("prefetch_seconds_per_round")),
        ("overlap", key("overlap", pct)),
    ],
    "population_pairs": [
        ("population C", key("clients")),
        ("device s/round", key("device_seconds_per_round")),
        ("disk s/round", key("disk_seconds_per_round")),
        ("disk / device", key("ratio", times)),
        ("prefetch s/round", key("prefetch_seconds_per_round")),
        ("wait for data s/round", key("stall_seconds_per_round")),
    ],
    "state_rows": [
        ("configuration", lambda r: r["label"]),
        ("rows on device s/round", key("median_device")),
        ("rows on host s/round", key("median_host")),
        ("host / device", key("host_over_device", times)),
        ("row MB per round sent", key("row_mb_sent_per_round")),
        ("write-back s/round", key("writeback_s_per_round")),
        ("wait for rows s/round", key("stall_s_per_round")),
        ("overlap", key("overlap", pct)),
    ],
    "client_map_auto": [
        ("workload", key("workload")),
        *[
            (m, lambda r, m=m: num(r["median_seconds"].get(m)))
            for m in ("map(1)", "map(2)", "map(4)", "map(8)", "map(16)", "vmap")
        ],
        ("best", key("best_mode")),
        (
            "auto's choice",
            lambda r: f"{r['auto_choice'].get('mode')}({r['auto_choice'].get('batch_size')})",
        ),
        ("auto", lambda r: num(r["median_seconds"].get("auto"))),
        ("auto / best", key("auto_over_best")),
        ("measuring took s", key("autotune_seconds")),
    ],
    "aggregators": [
        ("d", key("d")),
        ("M", key("M")),
        ("aggregator", key("aggregator")),
        ("ms / reduce", lambda r: r.get("skipped") or num(r["seconds"] * 1e3)),
        ("updates/s", key("updates_per_s")),
        ("peak RSS GiB", key("peak_rss_gib")),
    ],
    "h100_projection": [
        ("round", lambda r: r["label"]),
        ("GFLOP", lambda r: num(r["flops"] / 1e9)),
        ("GB accessed", lambda r: num(r["bytes_accessed"] / 1e9)),
        ("FLOP/byte", key("arithmetic_intensity")),
        ("FP32 compute bound ms", lambda r: num(r["bound_seconds_fp32"] * 1e3)),
        (
            "projected round >= ms",
            lambda r: num(
                max(r["bound_seconds_fp32"], r["bytes_accessed"] / r["device"]["hbm_bytes_per_s"])
                * 1e3
            ),
        ),
        ("bound by", key("bound_by")),
        ("measured here s", key("measured_cpu_seconds")),
    ],
    "traced_hparams_scan": [
        ("algorithm", key("algorithm")),
        ("traced", lambda r: ", ".join(r["traced_ok"]) or "–"),
        ("refused", lambda r: "; ".join(x.split(" (")[0] for x in r["refused"]) or "–"),
    ],
}


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


def table(suite: str, rows: list[Row] | None = None) -> str:
    rows = read_rows(os.path.join(RESULTS, f"{suite}.jsonl")) if rows is None else rows
    cols = TABLES[suite]
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    notes = []
    for r in rows:
        if r["kind"] == "skipped":
            notes.append(f"- {r['label']}: skipped ({r['reason']})")
        elif r["kind"] == "summary":
            body = {k: v for k, v in r.items() if k not in SKIP}
            notes.append(f"- {r['label']}: " + ", ".join(f"{k} {num(v)}" for k, v in body.items()))
        else:
            lines.append("| " + " | ".join(str(f(r)) for _, f in cols) + " |")
    return "\n".join([*lines, "", *notes, *([""] if notes else []), record(rows)])


SKIP = {"kind", "suite", "label", "time", "commit", "machine", "load", "command", "isolated"}
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
