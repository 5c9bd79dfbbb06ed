"""Rows from the printed lines of the first GPU lease's `fedjax-sim bench` runs.

Both `fedjax-sim bench` runs of that lease (one H200; `benchmarks/results/gpu/h200_call1_log.txt`
and `h200_call2_log.txt`) were killed by their time caps before the suites wrote their JSON
lines (they wrote them only at the end then; now every row is written when measured), so only
the printed `[baselines] ...` / `[cohort] ...` lines exist. This turns them into rows, once:
`benchmarks/results/gpu/h200_baselines.jsonl` and `h200_cohort.jsonl` (kind `measurement`: the
printed line has the median and min seconds per round, compile seconds, client-steps/s and peak
memory, to the digits printed, not the rounds' list or the FLOPs). Each row keeps its line
(`printed`, `log`, `log_line`), the machine of its run's header line, the 1-minute load of that
header (the load at the end was not printed), the command from the log (call 1's parts:
`benchmarks/gpu_figures.sh` of c517a30, below) and the commit of the lease's own Recorder rows
(`h200_hypergradient_cost.jsonl`, `h200_lora_cohort.jsonl`). Where both calls measured a
configuration (same label), call 2's row is kept (call 1's are earlier in the same lease).

    PYTHONPATH=$PWD python benchmarks/gpu_log_rows.py          # (re)write the two files
    PYTHONPATH=$PWD python benchmarks/gpu_log_rows.py --check  # exit 1 if they differ
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from fedjax_sim.app.bench.results import RESULTS, read_rows, validate_row, write_rows
from fedjax_sim.app.bench.workloads import preset

GPU = os.path.join(RESULTS, "gpu")
LOGS = ("h200_call1_log.txt", "h200_call2_log.txt")  # in the order they ran
LEASE_ROWS = ("h200_hypergradient_cost.jsonl", "h200_lora_cohort.jsonl")
OUT = {"baselines": "h200_baselines.jsonl", "cohort": "h200_cohort.jsonl"}

# call 1 ran `benchmarks/gpu_figures.sh` of c517a30, whose log names each part and its cap
# but not its command: the bench parts' commands as that script had them
CALL1_PARTS = {
    "baselines": "python3 -m fedjax_sim bench --suite baselines --workload W1 --mode vmap "
    "--baseline-cohorts 10 100 1000 --no-flops --memory-budget-gb 60 --out $OUT",
    "cohort": "python3 -m fedjax_sim bench --suite cohort --mode vmap --no-flops "
    "--memory-budget-gb 60 --max-round-s 20 --out $OUT",
}

PART = re.compile(r"^=== (?P<name>\S+) \(cap (?P<cap>\d+)s\) (?P<clock>\d\d:\d\d:\d\d)$")
PART_END = re.compile(r"^=== \S+: rc ")
COMMAND = re.compile(r"^#\s+(?P<command>timeout \d+ python3 -m fedjax_sim bench .*)$")
HEADER = re.compile(r"^fedjax-sim bench: suites [^;]+; memory budget [^;]+; machine (?P<m>\{.*\})$")
ROW = re.compile(
    r"^\[(?P<suite>\w+)\] (?P<label>.+?): (?P<median>[\d.e+-]+) s/round "
    r"\(min (?P<min>[\d.e+-]+), compile (?P<compile>[\d.e+-]+|–) s\), "
    r"(?P<steps>[\d,]+) client-steps/s(?:, roofline [\d.]+%)?, peak mem (?P<gib>[\d.]+) GiB$"
)
BASELINE_LABEL = re.compile(r"^(?P<system>.+) (?P<workload>\S+) M=(?P<m>\d+)$")
COHORT_LABEL = re.compile(r"^(?P<workload>\S+) M=(?P<m>\d+) (?P<mode>.+)$")
ENGINES = {  # how a system's name starts -> `engine` (runner's names)
    "fedjax_sim": "fedjax_sim",
    "per-client python loop": "python-loop",
    "fedjax ": "fedjax",  # "fedjax 0.0.17" (after "fedjax_sim")
    "PyTorch": "torch-loop",
    "pfl-research": "pfl",
}
THREADS = re.compile(r"\((?P<n>\d+|default) threads?\)$")


def lease() -> tuple[str, str]:
    """(commit, date) of the lease's own Recorder rows (one commit, one day)."""
    rows = [r for name in LEASE_ROWS for r in read_rows(os.path.join(GPU, name))]
    commits = {r["commit"] for r in rows}
    days = {r["time"][:10] for r in rows}
    if len(commits) != 1 or len(days) != 1:
        raise ValueError(f"the lease's rows name {sorted(commits)} on {sorted(days)}")
    return commits.pop(), days.pop()


def configuration(suite: str, label: str) -> dict[str, Any]:
    """system, engine, workload (the preset's, vmap: what both runs measured) and cohort of
    a printed label (`suites.suite_baselines` / `suite_cohort` make them)."""
    m = (BASELINE_LABEL if suite == "baselines" else COHORT_LABEL).match(label)
    if m is None:
        raise ValueError(f"unexpected {suite} label {label!r}")
    system, mode = (m["system"], "vmap") if suite == "baselines" else (None, m["mode"])
    system = system or f"fedjax_sim {mode}"
    if mode != "vmap":
        raise ValueError(f"{label!r}: both runs measured vmap rounds, not {mode}")
    clients = int(m["m"])
    w = preset(m["workload"]).replace(clients=clients, mode="vmap", map_batch=None)
    engine = next(e for start, e in ENGINES.items() if system.startswith(start))
    out = {"engine": engine, "system": system, "workload": w.describe(), "clients": clients}
    if suite == "baselines":
        out["cohort_run"] = f"{m['workload']} M={clients}"
    threads = THREADS.search(system)
    if engine == "torch-loop" and threads:
        out["torch_threads"] = None if threads["n"] == "default" else int(threads["n"])
        out["torch_device"] = "cuda (baselines.torch_device: the GPU when JAX runs on one)"
    return out


def parse(name: str, commit: str, day: str) -> list[dict[str, Any]]:
    """The measured rows printed in one log (skipped lines are left out)."""
    path = os.path.join(GPU, name)
    rows, run, part, command = [], None, None, None
    with open(path) as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if p := PART.match(line):
            part = p
            continue
        if PART_END.match(line):
            part, run = None, None
            continue
        if c := COMMAND.match(line):
            command = c["command"]
            continue
        if h := HEADER.match(line):
            machine = json.loads(h["m"])
            if part is not None:
                cmd = f"timeout {part['cap']} {CALL1_PARTS[part['name']]}"
                when = f"{day}T{part['clock']}+00:00 (the start of the run; no row time printed)"
            else:
                cmd, when = command, f"{day} (no time printed)"
            load = {
                "start_1m": machine["load_avg_1m"],
                "end_1m": None,
                "note": "the load printed when the run started; its end was not printed",
            }
            run = {"machine": machine, "load": load, "command": cmd, "time": when}
            continue
        r = ROW.match(line)
        if r is None or run is None:
            continue
        compile_s = None if r["compile"] == "–" else float(r["compile"])
        rows.append(
            {
                "kind": "measurement",
                "suite": r["suite"],
                "label": r["label"],
                "time": run["time"],
                **configuration(r["suite"], r["label"]),
                "round_s_median": float(r["median"]),
                "round_s_min": float(r["min"]),
                "compile_s": compile_s,
                "client_steps_per_s": int(r["steps"].replace(",", "")),
                "peak_memory_gib": float(r["gib"]),
                "memory_source": "device_peak_bytes_in_use: JAX's allocator in the measuring "
                "process (torch's own allocations are not in it)",
                "printed": line,
                "log": f"benchmarks/results/gpu/{name}",
                "log_line": n,
                "commit": commit,
                "machine": run["machine"],
                "load": run["load"],
                "command": run["command"],
            }
        )
    return rows


def rows_by_suite() -> dict[str, list[dict[str, Any]]]:
    """Both logs' rows per suite; a label measured in both keeps call 2's row, in call 1's
    place."""
    commit, day = lease()
    merged: dict[str, dict[str, dict[str, Any]]] = {suite: {} for suite in OUT}
    for name in LOGS:
        for row in parse(name, commit, day):
            merged[row["suite"]][row["label"]] = row
    out = {suite: list(rows.values()) for suite, rows in merged.items()}
    for rows in out.values():
        for row in rows:
            validate_row(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ")
    args = ap.parse_args(argv)
    stale = []
    for suite, rows in rows_by_suite().items():
        path = os.path.join(GPU, OUT[suite])
        if args.check:
            if not os.path.exists(path) or read_rows(path) != rows:
                stale.append(path)
        else:
            write_rows(path, rows)
    for path in stale:
        print(f"{path} differs from the logs: run benchmarks/gpu_log_rows.py")
    return int(bool(stale))


if __name__ == "__main__":
    sys.exit(main())
