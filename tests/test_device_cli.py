"""The device model on the command line (issue 38 item 6): flags refused up front with one
line naming the flag (before any data or JAX work), assembled into a `DeviceModel`, shown in
the run summary with the total virtual hours, and the virtual-hours plot panel."""

import dataclasses
import json
import math
import os
import struct

import jax
import numpy as np
import pytest

from fedjax_sim.algorithms.device_model import (
    PROFILES,
    DeviceModel,
    ProceduralProfiles,
    TraceProfiles,
)
from fedjax_sim.app.cli import main
from fedjax_sim.app.config import RunConfig, algorithm_kwargs

BAD_TRACE = "client,speed,uplink,downlink,period,session,phase,dropout\n0,-1,1,1,1,1,0,0\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--deadline", "30"], "--deadline needs --device-model"),
        (["--late", "partial"], "--late needs --device-model"),
        (["--over-selection", "1.3"], "--over-selection needs --device-model"),
        (["--no-availability"], "--availability needs --device-model"),
        (["--device-model", "tablets"], "--device-model 'tablets' is neither a profile name"),
        (["--device-model", "BAD"], "--device-model BAD, line 3, column 'speed'"),
        (["--device-model", "phones", "--deadline", "0"], "--deadline must be > 0"),
        (["--device-model", "phones", "--deadline", "nan"], "--deadline must be a finite"),
        (["--device-model", "phones", "--over-selection", "0.9"], "--over-selection must be >= 1"),
        (["--device-model", "phones", "--late", "partial"], "--late partial needs --deadline"),
        (["--device-model", "phones", "--late", "wait"], "--late"),
        (
            ["--device-model", "phones", "--over-selection", "1.5", "--cohort-size", "70"],
            "--over-selection 1.5 draws 105 clients, more than --num-clients 100",
        ),
        (
            ["--device-model", "phones", "--over-selection", "1.5", "--cohort-sampling"]
            + ["bernoulli", "--cohort-probability", "0.1"],
            "--over-selection needs --cohort-size",
        ),
        (
            ["--device-model", "phones", "--round-trip-latency", "0.2"],
            "--round-trip-latency is paid by --secure-aggregation",
        ),
        (
            ["--device-model", "phones", "--secure-aggregation", "clip=1"]
            + ["--round-trip-latency", "-1"],
            "--round-trip-latency must be >= 0",
        ),
        (
            ["--algorithm", "fedbuff", "--device-model", "phones", "--deadline", "30"],
            "--deadline is not used by fedbuff (asynchronous: no rounds to wait for",
        ),
        (
            ["--algorithm", "area", "--device-model", "phones", "--over-selection", "1.3"],
            "--over-selection is not used by area (asynchronous",
        ),
        (
            ["--algorithm", "fedbuff", "--device-model", "phones", "--local-epochs", "1"],
            "--device-model with fedbuff needs --local-steps",
        ),
        (
            ["--algorithm", "fedbuff", "--device-model", "phones"]
            + ["--hparams", "firing_probability=0.2"],
            "--hparams firing_probability is not used with --device-model",
        ),
        (["--available-cohorts"], "--available-cohorts needs --device-model"),
        (
            ["--device-model", "phones", "--cohort-candidates", "2"],
            "--cohort-candidates is used by --available-cohorts only",
        ),
        (
            ["--device-model", "phones", "--available-cohorts", "--cohort-sampling"]
            + ["bernoulli", "--cohort-probability", "0.1"],
            "--available-cohorts needs --cohort-size",
        ),
        (
            ["--device-model", "phones", "--available-cohorts", "--cohort-size", "10"]
            + ["--cohort-candidates", "0.5"],
            "--cohort-candidates must be >= 1",
        ),
        (
            ["--device-model", "phones", "--available-cohorts", "--cohort-size", "10"]
            + ["--no-availability"],
            "--available-cohorts needs availability",
        ),
        (
            ["--device-model", "phones", "--available-cohorts", "--cohort-size", "10"]
            + ["--population", "uniform"],
            "--available-cohorts is not supported with --population",
        ),
        (
            ["--algorithm", "fedbuff", "--device-model", "phones", "--available-cohorts"],
            "--available-cohorts is not used by fedbuff (asynchronous",
        ),
        (["--algorithm", "fedbuff", "--concurrency", "4"], "--concurrency needs --device-model"),
        (
            ["--device-model", "phones", "--concurrency", "4"],
            "--concurrency caps an asynchronous preset's training clients; fedavg trains",
        ),
        (
            ["--algorithm", "fedbuff", "--device-model", "phones", "--concurrency", "0"],
            "--concurrency must be",
        ),
        (
            ["--algorithm", "area", "--device-model", "phones", "--concurrency", "500"],
            "--concurrency 500 exceeds --num-clients 100",
        ),
    ],
)
def test_bad_device_flags_refused_up_front(tmp_path, monkeypatch, capsys, args, message):
    trace = tmp_path / "bad.csv"
    trace.write_text("# a trace\n" + BAD_TRACE)
    args = [str(trace) if a == "BAD" else a for a in args]
    message = message.replace("BAD", str(trace))

    def no_data(*a, **k):  # refusals come before the data is loaded or anything compiled
        raise AssertionError("loaded data before refusing")

    monkeypatch.setattr("fedjax_sim.data.load", no_data)
    assert main(["run", "--rounds", "1", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_flags_assemble_the_device_model(tmp_path):
    cfg = RunConfig(
        device_model="homogeneous",
        deadline=40.0,
        late="partial",
        over_selection=1.5,
        availability=False,
        secure_aggregation=("clip=1",),
        round_trip_latency=0.3,
        seed=7,
    )
    explicit = {"device_model", "deadline", "late", "over_selection", "availability"}
    model = algorithm_kwargs(cfg, explicit | {"secure_aggregation", "round_trip_latency"})[
        "device_model"
    ]
    expected = DeviceModel(
        ProceduralProfiles(7, **PROFILES["homogeneous"]),
        deadline=40.0,
        late="partial",
        over_selection=1.5,
        availability=False,
        round_trip_latency=0.3,
    )
    assert dataclasses.asdict(model) == dataclasses.asdict(expected)  # DeviceModel: eq=False
    bundled = algorithm_kwargs(RunConfig(device_model="bundled"), {"device_model"})
    assert isinstance(bundled["device_model"].profiles, TraceProfiles)
    assert bundled["device_model"].profiles.rows == 64
    assert "device_model" not in algorithm_kwargs(RunConfig(), set())


def test_available_cohort_flags_assemble_the_device_model():
    cfg = RunConfig(
        device_model="phones", cohort_size=5, available_cohorts=True, cohort_candidates=3.0
    )
    explicit = {"device_model", "cohort_size", "available_cohorts", "cohort_candidates"}
    model = algorithm_kwargs(cfg, explicit)["device_model"]
    assert (model.cohort, model.candidates) == ("available", 3.0)
    plain = algorithm_kwargs(RunConfig(device_model="phones"), {"device_model"})
    assert plain["device_model"].cohort == "all"


def test_cli_run_with_available_cohorts(tmp_path, capsys):
    """`--available-cohorts` on the bundled trace: in the summary, and no selected client is
    offline at its round's start (64 candidates: all 20 clients in a random order)."""
    out = tmp_path / "run"
    args = ["run", "--rounds", "3", "--eval-every", "3", "--num-clients", "20", "--no-progress"]
    args += ["--cohort-size", "4", "--local-steps", "2", "--out", str(out)]
    args += ["--device-model", "bundled", "--available-cohorts", "--cohort-candidates", "16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "cohorts among online clients (16x candidates)" in printed
    history = json.loads((out / "history.json").read_text())
    assert history["metrics"]["unavailable"] == [0, 0, 0]


def _png_width(path):
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">I", head[16:20])[0]


def test_cli_run_summary_virtual_hours_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--rounds", "3", "--eval-every", "1", "--num-clients", "20"]
    args += ["--cohort-size", "4", "--local-steps", "2", "--no-progress", "--out", str(out)]
    clock = ["--device-model", "bundled", "--deadline", "30", "--over-selection", "1.5"]
    assert main([*args, *clock]) == 0
    printed = capsys.readouterr().out
    summary = "device model bundled (availability on, deadline 30 s, late clients dropped, "
    assert summary + "over-selection 1.5)" in printed
    history = json.loads((out / "history.json").read_text())
    times = np.array(history["metrics"]["virtual_time"], float)
    np.testing.assert_allclose(times, np.cumsum(history["metrics"]["round_time"]), rtol=1e-6)
    hours = times[-1] / 3600.0
    assert f"; {hours:.4g} virtual hours after 3 rounds" in printed
    assert np.all(np.array(history["metrics"]["round_time"]) <= 30.0 + 1e-4)
    assert history["meta"]["config"]["device_model"] == "bundled"
    wide = _png_width(out / "history.png")
    plain = tmp_path / "plain"
    assert main([*args[:-1], str(plain)]) == 0
    assert "virtual hours" not in capsys.readouterr().out
    assert wide == pytest.approx(1.5 * _png_width(plain / "history.png"), abs=2)  # 3rd panel
    assert os.path.isfile(plain / "history.png") and math.isfinite(hours)


def test_cli_streamed_population_with_over_selection(tmp_path, capsys):
    """A streamed run plans the drawn cohort (ceil(f M)) and runs on the clock."""
    out = tmp_path / "pop"
    args = ["run", "--population", "uniform", "--num-clients", "1000", "--rounds", "2"]
    args += ["--eval-every", "1", "--local-steps", "1", "--model", "logistic"]
    args += ["--device-model", "always_on", "--over-selection", "1.5", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    history = json.loads((out / "history.json").read_text())
    assert history["metrics"]["participants"] == [10, 10]
    assert "virtual hours" in capsys.readouterr().out


def test_cli_asynchronous_preset_fires_from_the_device_model(tmp_path, capsys):
    """FedBuff on the clock: its events are `event_model` of the flags' profiles (one model
    down and up per delivery, --local-steps, the preset's buffer), and History's
    virtual-time column is the event engine's time in seconds."""
    from fedjax_sim.algorithms.device_model import event_model, named_profiles
    from fedjax_sim.app.config import _model
    from fedjax_sim.data.federated import tree_size_bytes

    cfg = RunConfig(algorithm="fedbuff", device_model="bundled", local_steps=2, num_clients=20)
    explicit = {"algorithm", "device_model", "local_steps", "num_clients"}
    model = _model(cfg, (64,), 10)
    events = algorithm_kwargs(cfg, explicit, model=model)["events"]
    size = tree_size_bytes(model.init(jax.random.key(0)))
    expected = event_model(
        named_profiles("bundled", seed=cfg.seed), 20, steps=2, bytes_down=size, bytes_up=size
    )
    np.testing.assert_array_equal(events.arrivals.values, expected.arrivals.values)
    assert events.arrivals.dt == expected.arrivals.dt and events.virtual_clock
    assert events.aggregation.delta == 4  # fedbuff's buffer_size
    out = tmp_path / "async"
    args = ["run", "--algorithm", "fedbuff", "--rounds", "3", "--eval-every", "1"]
    args += ["--num-clients", "20", "--local-steps", "2", "--no-progress", "--out", str(out)]
    assert main([*args, "--device-model", "bundled"]) == 0
    history = json.loads((out / "history.json").read_text())
    times = np.array(history["metrics"]["virtual_time"], float)
    np.testing.assert_allclose(times, expected.arrivals.dt * np.arange(1, 4), rtol=1e-6)
    assert f"{times[-1] / 3600.0:.4g} virtual hours after 3 rounds" in capsys.readouterr().out


def test_cli_asynchronous_preset_with_a_concurrency_cap(tmp_path, capsys):
    """`--concurrency 3`: the events are `event_model(concurrency=3)` of the flags' profiles,
    and in the run exactly 3 clients train at every iteration (the `training` metric) while
    at most 3 deliver."""
    from fedjax_sim.app.config import _model

    cfg = RunConfig(algorithm="fedbuff", device_model="bundled", local_steps=2, num_clients=20,
                    concurrency=3)  # fmt: skip
    explicit = {"algorithm", "device_model", "local_steps", "num_clients", "concurrency"}
    events = algorithm_kwargs(cfg, explicit, model=_model(cfg, (64,), 10))["events"]
    assert events.concurrency == 3
    out = tmp_path / "capped"
    args = ["run", "--algorithm", "fedbuff", "--rounds", "4", "--eval-every", "2"]
    args += ["--num-clients", "20", "--local-steps", "2", "--no-progress", "--out", str(out)]
    assert main([*args, "--device-model", "bundled", "--concurrency", "3"]) == 0
    metrics = json.loads((out / "history.json").read_text())["metrics"]
    assert np.array_equal(np.asarray(metrics["training"], float), [3.0] * 4)
    assert "at most 3 clients training" in capsys.readouterr().out


def test_cli_sweep_on_the_clock(tmp_path):
    """`sweep` takes the device flags: a synchronous preset's clock (deadline 30 s) is the
    same at every grid point (a round's time depends on the cohort and the bytes, not on the
    learning rate), an asynchronous preset's is the event engine's `dt` per iteration."""
    from fedjax_sim.algorithms.device_model import event_model, named_profiles
    from fedjax_sim.app.config import _model
    from fedjax_sim.data.federated import tree_size_bytes

    base = ["--rounds", "2", "--eval-every", "1", "--num-clients", "20", "--local-steps", "2"]
    base += ["--no-progress", "--device-model", "bundled", "--seeds", "1"]
    base += ["--grid", "client_lr=0.05,0.1"]
    for algorithm, extra in (("fedavg", ["--cohort-size", "4", "--deadline", "30"]),
                             ("fedbuff", [])):  # fmt: skip
        out = tmp_path / algorithm
        assert main(["sweep", *base, "--algorithm", algorithm, *extra, "--out", str(out)]) == 0
        runs = json.loads((out / "histories.json").read_text())["runs"]
        times = np.array([r["history"]["metrics"]["virtual_time"] for r in runs], float)
        assert times.shape == (2, 2) and np.all(times > 0)
        np.testing.assert_array_equal(times[0], times[1])
    model = _model(RunConfig(), (64,), 10)  # the default MLP on digits
    size = tree_size_bytes(model.init(jax.random.key(0)))
    profiles = named_profiles("bundled", seed=0)
    dt = event_model(profiles, 20, steps=2, bytes_down=size, bytes_up=size).arrivals.dt
    np.testing.assert_allclose(times[0], dt * np.arange(1, 3), rtol=1e-6)
