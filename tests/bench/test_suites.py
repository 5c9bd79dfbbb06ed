"""`fedjax-sim bench` end to end on tiny workloads: files written, rows valid, the kernel
table's skip-with-reason for algorithms that cannot run on the generic workload, the
memory-budget skip and the watchdog that kills a measurement over its memory cap."""

import json
import os
import subprocess
import sys
import time
from unittest import mock

import pytest

from fedjax_sim import algorithms
from fedjax_sim.algorithms import fedavg
from fedjax_sim.app.bench import baselines, results, runner, suites
from fedjax_sim.app.bench.config import BenchConfig
from fedjax_sim.app.bench.results import read_rows, replace_rows, validate_row
from fedjax_sim.app.bench.workloads import (
    Workload,
    algorithm_kwargs,
    make_algorithm,
    make_data,
    missing_required,
    preset,
)
from fedjax_sim.app.cli import main
from fedjax_sim.runtime.distributed import host_device_flags

PEAK = {"matmul_n": 8, "peak_flops_per_s": 1e9}


@pytest.fixture
def cheap(monkeypatch):
    """Skip the two compilations of the per-client memory estimate (tested in the sweeps
    with real numbers elsewhere); tests also use a small matmul for the peak."""
    monkeypatch.setattr(suites, "per_client_bytes", lambda w: 10**4)


def test_cli_bench_round_writes_rows_table_and_plot(tmp_path, capsys, cheap):
    out = tmp_path / "res"
    code = main(["bench", "--workload", "tiny-lr", "--no-isolate", "--no-flops", "--out", str(out)])
    assert code == 0
    rows = read_rows(str(out / "round.jsonl"))
    assert [r["kind"] for r in rows] == ["round"]
    validate_row(rows[0])
    assert rows[0]["workload"]["name"] == "tiny-lr" and rows[0]["flops_xla"] is None
    assert (out / "round.png").stat().st_size > 1000
    assert "s/round (median)" in (out / "round.md").read_text()
    assert "client-steps/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope"], "unknown workload"),
        (["--algorithm", "nope"], "unknown algorithm"),
        (["--repeats", "2", "--workload", "tiny-lr"], "repeats must be >= 3"),
        (["--competing-threads", "-1", "--workload", "tiny-lr"], "competing-threads must be"),
    ],
)
def test_cli_bench_usage_errors(argv, message, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def _needs_foo(loss_fn, *, foo, client_map=None):
    """Needs a hyper-parameter the generic workload does not offer."""
    return fedavg(loss_fn)


def _broken(loss_fn, *, local=None):
    """Builds, but its step fails on the workload."""
    alg = fedavg(loss_fn)

    def step(state, data, key):
        raise ValueError("needs a similarity graph")

    return alg._replace(step=step)


def test_algorithm_table_ratios_and_skips(tmp_path, monkeypatch, cheap):
    monkeypatch.setitem(algorithms.ALGORITHMS, "needs_foo", _needs_foo)
    monkeypatch.setitem(algorithms.ALGORITHMS, "broken", _broken)
    assert missing_required("needs_foo", algorithm_kwargs(preset("tiny-lr"))) == ["foo"]
    cfg = BenchConfig(
        suite=("algorithms",),
        workload="tiny-lr",
        isolate=False,
        flops=False,
        plots=False,
        peak_n=64,
        algorithms=("fedprox", "needs_foo", "broken", "unknown"),
        out=str(tmp_path),
    )
    rows = suites.run(cfg, log=lambda s: None)["algorithms"]
    by = {r["label"]: r for r in rows}
    assert by["fedavg"]["ratio_to_fedavg"] == 1.0
    assert by["fedprox"]["kind"] == "round" and by["fedprox"]["ratio_to_fedavg"] > 0
    assert by["fedprox"]["ratio_to_fedavg"] == pytest.approx(
        by["fedprox"]["round_s_median"] / by["fedavg"]["round_s_median"], rel=1e-2
    )
    assert "requires hyper-parameters ['foo']" in by["needs_foo"]["reason"]
    assert "needs a similarity graph" in by["broken"]["reason"]
    assert by["unknown"]["reason"] == "not registered"
    summary = rows[-1]
    assert summary["kind"] == "summary"
    assert set(summary["skipped"]) == {"needs_foo", "broken", "unknown"}
    assert summary["measured"] == ["fedavg", "fedprox", "fedavg (end)"]
    assert summary["fedavg_end_to_start"] == pytest.approx(
        by["fedavg (end)"]["round_s_median"] / by["fedavg"]["round_s_median"], rel=1e-2
    )
    for row in read_rows(str(tmp_path / "algorithms.jsonl")):
        validate_row(row)


def test_budget_skips_and_stops_the_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "per_client_bytes", lambda w: 10**5)
    cfg = BenchConfig(
        suite=("cohort",),
        cohort_workloads=("tiny-lr",),
        mode="vmap",
        cohorts=(10**5, 10**6),
        isolate=False,
        plots=False,
        memory_budget_gb=1.5,
        out=str(tmp_path),
    )
    rows = suites.run(cfg, log=lambda s: None)["cohort"]
    assert [r["kind"] for r in rows] == ["skipped", "skipped", "summary"]
    assert "estimated memory 1" in rows[0]["reason"] and "> budget 1.50 GiB" in rows[0]["reason"]
    assert "a smaller configuration was skipped" in rows[1]["reason"]
    assert rows[2]["largest_measured"] == 0 and "estimated memory" in rows[2]["stopped_because"]
    # fitted mode: the heuristic refuses a cohort whose data alone exceeds the budget
    cfg.mode, cfg.cohorts = "preset", (10**7,)
    rows = suites.run(cfg, log=lambda s: None)["cohort"]
    assert rows[0]["kind"] == "skipped" and "does not fit the memory budget" in rows[0]["reason"]
    assert "alone exceed the budget 1.50 GiB" in rows[0]["reason"]


def test_watchdog_kills_a_measurement_over_its_memory_cap():
    spec = {"task": "engine", "workload": Workload().describe(), "suite": "t", "label": "big"}
    row = suites.run_isolated(spec, kill_bytes=40 * 2**20, timeout_s=120)
    assert row["kind"] == "skipped" and "killed by the watchdog: RSS" in row["reason"]


def test_watchdog_counts_and_kills_the_children_of_a_measurement():
    """A parent holding little memory whose child holds 200 MiB (the pfl worker and pfl):
    counted in the tree's RSS, and killed with it."""
    child = "b = bytearray(200 * 2**20); import time; time.sleep(60)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while suites.tree_rss(proc.pid) < 200 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert suites.tree_rss(proc.pid) >= 200 * 2**20 > suites.rss_of(proc.pid)
        (child,) = suites.children_of(proc.pid)
    finally:
        suites.kill_tree(proc.pid)
        proc.wait()
    time.sleep(0.5)
    try:  # gone, or a zombie nobody has reaped yet
        with open(f"/proc/{child}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        pass


def test_estimate_grows_with_cohort_and_chunk():
    w = preset("LR")
    small = suites.estimate_bytes(w.replace(clients=10**3), 10**4)
    big = suites.estimate_bytes(w.replace(clients=10**6), 10**4)
    assert big - small == pytest.approx(suites.MARGIN * 999_000 * (20 * 61 * 4 + 4), rel=1e-6)
    vmap = suites.estimate_bytes(w.replace(clients=10**6, mode="vmap"), 10**4)
    assert vmap - big == pytest.approx(suites.MARGIN * (10**6 - 256) * 10**4, rel=1e-6)


def test_json_lines_are_plain_json(tmp_path):
    path = os.path.join(tmp_path, "x.jsonl")
    from fedjax_sim.app.bench.results import write_rows

    write_rows(path, [{"a": 1}, {"b": [1, 2]}])
    assert [json.loads(line) for line in open(path)] == [{"a": 1}, {"b": [1, 2]}]


def test_kernel_table_is_driven_by_the_registry(tmp_path, monkeypatch):
    """With no --algorithms the table lists FedAvg first, then every registered algorithm
    (so a newly registered one joins it), then FedAvg again (load drift); each registered
    algorithm builds from the generic workload."""
    monkeypatch.setitem(algorithms.ALGORITHMS, "zz_new", _needs_foo)
    seen = []

    def fake_measure(self, task, w, suite, label, **extra):
        seen.append((label, w.algorithm))
        return {"kind": "skipped", "suite": suite, "label": label, "reason": "fake"}

    monkeypatch.setattr(suites.Session, "measure", fake_measure)
    monkeypatch.setattr(suites, "_summary", lambda row: row)
    cfg = BenchConfig(suite=("algorithms",), workload="tiny-lr", out=str(tmp_path))
    suites.suite_algorithms(suites.Session(cfg, log=lambda s: None))
    names = sorted(n for n in algorithms.ALGORITHMS if n != "fedavg")
    expected = [(n, n) for n in ["fedavg", *names]] + [("fedavg (end)", "fedavg")]
    assert seen == expected and "zz_new" in names
    w = preset("tiny-lr")
    data = make_data(w)
    for name in names:
        if name != "zz_new":
            make_algorithm(w.replace(algorithm=name), data)  # no missing hyper-parameter


def test_devices_shard_the_engine_in_its_own_process_and_baselines_stay_on_one():
    """`devices=2` on CPU: the measurement's process is started with two host devices and the
    engine's client axis is sharded over them; in a one-device process the same workload is
    refused with the fix named."""
    w = preset("tiny-lr").replace(devices=2)
    spec = {"task": "engine", "workload": w.describe(), "suite": "t", "label": "s", "peak_n": 64}
    row = suites.run_isolated(spec, kill_bytes=4 * 2**30, timeout_s=300)
    assert row["kind"] == "round", row.get("reason")
    assert row["machine"]["device_count"] == 2
    assert row["mode"].endswith("over 2 devices") and row["workload"]["devices"] == 2
    assert row["flops_method"].endswith("counted on the unsharded program")
    with pytest.raises(ValueError, match="needs 2 devices.*xla_force_host_platform"):
        make_algorithm(w)
    assert host_device_flags(2, "--a") == "--a --xla_force_host_platform_device_count=2"
    assert host_device_flags(1, "--a") == "--a"


def test_client_steps_count_the_local_steps_actually_taken():
    """FedSGD takes one gradient per client whatever the workload's `local_steps`, so its
    client-steps/s is clients / (s/round), not clients x local_steps / (s/round)."""
    w = preset("tiny-lr").replace(algorithm="fedsgd", local_steps=7)
    row = runner.measure_engine(w, repeats=3, suite="t", flops=False, peak=PEAK)
    assert row["clients_per_step"] == w.clients
    assert row["client_steps_per_s"] == pytest.approx(w.clients / row["round_s_median"], rel=1e-3)


# a stand-in for benchmarks/peers/{pfl,fedjax}_fedavg.py (same argument and result line), so
# that the plumbing of the venv peers' rows runs on CI, where their venvs are not built
FAKE_PEER = """import json, sys
spec = json.loads(sys.argv[1])
print("a log line of the peer")
laps = [0.5] + [0.1 * (i + 1) for i in range(spec["rounds"] - 1)]
print(json.dumps({"round_s": laps, "pfl": "fake", "torch": "-", "torch_threads":
    spec["threads"], "fedjax": "fake", "jax": "-", "haiku": "-", "peak_rss_bytes": 12345,
    "local": spec["model"]}))
"""


def test_baselines_suite_runs_every_system_per_cohort_in_alternating_order(
    tmp_path, monkeypatch, cheap
):
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(baselines.VenvPeer, "script", property(lambda peer: str(script)))
    calls = []
    measure = suites.Session.measure

    def spy(self, task, w, suite, label, **extra):
        calls.append((task, w.clients))
        return measure(self, task, w, suite, label, **extra)

    monkeypatch.setattr(suites.Session, "measure", spy)
    monkeypatch.setattr(suites, "fit", lambda w, budget: w)  # no memory-fitted engine row
    cfg = BenchConfig(
        suite=("baselines",),
        workload="tiny-mlp",
        baseline_cohorts=(2, 3),
        torch_threads=1,
        pfl_python=sys.executable,
        fedjax_python=sys.executable,
        isolate=False,
        flops=False,
        plots=False,
        peak_n=64,
        out=str(tmp_path / "res"),
    )
    rows = suites.run(cfg, log=lambda line: None)["baselines"]
    systems = ["engine", "loop", "fedjax", "torch", "pfl"]
    assert calls == [(t, 2) for t in systems] + [(t, 3) for t in reversed(systems)]
    # rows stay in system order, each cohort followed by its speedups
    kinds = [r.get("engine", r["label"]) for r in rows]
    per_cohort = ["fedjax_sim", "python-loop", "fedjax", "torch-loop", "pfl"]
    assert kinds == per_cohort + ["speedups tiny-mlp M=2"] + per_cohort + ["speedups tiny-mlp M=3"]
    fedjax, pfl = rows[2], rows[4]
    assert fedjax["label"] == "fedjax 0.0.17 tiny-mlp M=2" and fedjax["fedjax"] == "fake"
    assert fedjax["round_s"] == [0.1, 0.2, 0.3] and fedjax["peak_memory_bytes"] == 12345
    assert fedjax["memory_source"] == "fedjax_process_peak_rss"
    assert pfl["label"] == "pfl-research (1 thread) tiny-mlp M=2" and pfl["clients"] == 2
    assert pfl["system"] == "pfl-research (1 thread)"
    assert [r["cohort_run"] for r in rows] == ["tiny-mlp M=2"] * 6 + ["tiny-mlp M=3"] * 6
    assert pfl["round_s"] == [0.1, 0.2, 0.3] and pfl["first_round_s"] == 0.5  # laps[1:]
    assert pfl["peak_memory_bytes"] == 12345 and pfl["torch_threads"] == 1
    w = preset("tiny-mlp")
    assert pfl["client_steps_per_s"] == pytest.approx(2 * w.local_steps / 0.2)
    summary = rows[5]
    assert set(summary["speedup_vs"]) == {r["label"] for r in rows[1:5]}
    assert summary["speedup_vs"][pfl["label"]] == pytest.approx(
        0.2 / rows[0]["round_s_median"], rel=2e-3
    )
    assert [r["clients"] for r in read_rows(os.path.join(cfg.out, "baselines.jsonl"))[6:11]] == [
        3
    ] * 5


@pytest.mark.parametrize("peer", ["pfl", "fedjax"])
def test_venv_peer_row_is_skipped_naming_the_venv_recipe(peer):
    row = runner.measure_venv_peer(
        peer, preset("tiny-mlp"), python="/nonexistent/python", peak=PEAK
    )
    assert row["kind"] == "skipped" and f"benchmarks/peers/{peer}_venv.sh" in row["reason"]
    assert row["reason"].startswith(f"no {baselines.VENV_PEERS[peer].title} venv")
    validate_row(row, stamped=False)


def test_venv_peers_each_have_an_option_a_script_and_a_recipe():
    """Every venv peer has its `--<name>-python` option and its two files in benchmarks/."""
    assert set(BenchConfig.VENV_PEER_FLAGS) == set(baselines.VENV_PEERS)
    for name, peer in baselines.VENV_PEERS.items():
        assert BenchConfig(**{f"{name}_python": "p"}).peer_python(name) == "p"
        assert os.path.isfile(peer.script)
        assert os.path.isfile(os.path.join(results.REPO, peer.recipe))


def test_rows_are_written_as_they_are_measured(tmp_path, cheap):
    """A run stopped after its second measurement (here by the log, as a time cap or ^C would
    stop it) keeps both rows on disk, stamped and valid: the one of an old row's label
    replaces it in place, the old row of another label stays."""
    path = tmp_path / "cohort.jsonl"
    old = {"kind": "skipped", "suite": "cohort", "time": "t", "commit": "old", "reason": "x"}
    old.update(machine=results.UNKNOWN, load=results.UNKNOWN, command="python old")
    replace_rows(str(path), [{**old, "label": "tiny-lr M=2 vmap"}, {**old, "label": "other"}])
    printed = []

    def log(line):
        printed.append(line)
        if len([p for p in printed if p.startswith("[cohort]")]) == 2:
            raise KeyboardInterrupt

    cfg = BenchConfig(
        suite=("cohort",),
        cohort_workloads=("tiny-lr",),
        mode="vmap",
        cohorts=(2, 3, 4),
        isolate=False,
        flops=False,
        plots=False,
        peak_n=64,
        out=str(tmp_path),
    )
    with pytest.raises(KeyboardInterrupt):
        suites.run(cfg, log=log)
    rows = read_rows(str(path))
    assert [r["label"] for r in rows] == ["tiny-lr M=2 vmap", "other", "tiny-lr M=3 vmap"]
    assert [r["kind"] for r in rows] == ["round", "skipped", "round"]
    assert rows[1]["commit"] == "old" and rows[0]["commit"] != "old"
    for row in rows:
        validate_row(row)
    assert [r["clients"] for r in rows if r["kind"] == "round"] == [2, 3]


def test_peers_over_the_cap_or_without_runtime_are_skipped_without_a_process(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(suites, "run_isolated", no_process)
    cfg = BenchConfig(
        peer_max_cohort=2,
        pfl_python="/nonexistent/python",
        fedjax_python="/nonexistent/python",
        out=str(tmp_path),
    )
    s = suites.Session(cfg, log=lambda line: None)
    w = preset("tiny-mlp").replace(algorithm="fedavg")
    torch = s.measure("torch", w.replace(clients=3), "baselines", "torch M=3")
    assert torch["kind"] == "skipped"
    assert torch["reason"] == "not run: cohort 3 > --peer-max-cohort 2"
    pfl = s.measure("pfl", w.replace(clients=2), "baselines", "pfl M=2", tags={"system": "p"})
    assert pfl["kind"] == "skipped" and "benchmarks/peers/pfl_venv.sh" in pfl["reason"]
    assert pfl["system"] == "p"
    fedjax = s.measure("fedjax", w.replace(clients=2), "baselines", "fedjax M=2")
    assert fedjax["kind"] == "skipped" and "benchmarks/peers/fedjax_venv.sh" in fedjax["reason"]
    assert s.not_run("engine", w.replace(clients=3)) is None
    assert s.not_run("loop", w.replace(clients=3)) is None


def _matmul_children() -> list[int]:
    """This process's children running the competing job's matmul loop."""
    out = []
    for pid in suites.children_of(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"a @ a" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("interrupt", [False, True])
def test_competing_job_runs_beside_every_measurement_and_stops_with_the_run(
    tmp_path, cheap, interrupt
):
    """`--competing-threads 1`: one matmul process, in its own session, alive while the suite
    measures (seen from the log of each row), gone after the run, even one stopped by ^C;
    every row names it."""
    seen = []

    def log(line):
        if line.startswith("[round]"):
            pids = _matmul_children()
            seen.append([(pid, os.getsid(pid), suites.autogroup_nice(pid)) for pid in pids])
            if interrupt:
                raise KeyboardInterrupt

    cfg = BenchConfig(
        workload="tiny-lr", competing_threads=1, isolate=False, flops=False, plots=False,
        peak_n=64, out=str(tmp_path),
    )  # fmt: skip
    if interrupt:
        with pytest.raises(KeyboardInterrupt):
            suites.run(cfg, log=log)
    else:
        suites.run(cfg, log=log)
    ((pid, session, nice),) = seen[0]
    assert session == pid  # its own session: the kernel shares cores as between two jobs
    ours = suites.autogroup_nice()
    if ours is not None:
        assert nice == ours  # ... of equal weight
    else:  # this job is in no autogroup (a cpu cgroup, as on the CI machine): nothing to copy
        assert nice in (None, "0")  # the new session keeps the kernel's default weight
    assert _matmul_children() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    (row,) = read_rows(str(tmp_path / "round.jsonl"))
    assert row["competing_job"] == "numpy f32 2048x2048 matmul loop, 1 BLAS thread"
    validate_row(row)


def test_no_competing_job_by_default(tmp_path, cheap):
    cfg = BenchConfig(
        workload="tiny-lr", isolate=False, flops=False, plots=False, peak_n=64, out=str(tmp_path)
    )
    suites.run(cfg, log=lambda line: None)
    assert "competing_job" not in read_rows(str(tmp_path / "round.jsonl"))[0]


@pytest.mark.parametrize(
    "text, nice", [("/autogroup-105 nice -3\n", "-3"), ("", None)]
)  # a process in an autogroup; one outside any (the kernel prints nothing)
def test_autogroup_nice_reads_both_forms_of_the_kernels_file(text, nice):
    with mock.patch("builtins.open", mock.mock_open(read_data=text)):
        assert suites.autogroup_nice(1) == nice
