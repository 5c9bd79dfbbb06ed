"""sweep(): run r equals the single run, chunking, grid order/labels, summary statistics,
traced hyper-parameters, outputs and resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import (
    CohortSpec,
    LocalSpec,
    fedavg,
    fedbuff,
    fedper,
    fedprox,
    scaffold,
)
from fedjax_sim.app.cli import main
from fedjax_sim.data import load_digits
from fedjax_sim.models import mlp
from fedjax_sim.run.history import History
from fedjax_sim.run.sweep import SweepResult, expand_grid, mean_ci, sweep

L = LocalSpec(steps=2, batch_size=8)
EVAL = EvalSpec(every=2)


@pytest.fixture(scope="module")
def setup():
    ds = load_digits(num_clients=12)
    return ds, mlp(ds.feature_shape, 10, hidden=(8,))


def _single(alg, ds, model, seed, rounds=3, spec=EVAL):
    return simulate(
        alg,
        ds.train,
        jax.random.key(seed),
        model=model,
        num_rounds=rounds,
        test=ds.test,
        evaluation=spec,
        progress=False,
    )


def _same(h1: History, h2: History, rtol: float = 0.0, atol: float = 0.0):
    assert h1.rounds == h2.rounds
    assert set(h1.metrics) == set(h2.metrics)
    for k in h1.metrics:
        np.testing.assert_allclose(h1.metric(k), h2.metric(k), rtol=rtol, atol=atol, err_msg=k)
    assert [e["round"] for e in h1.evals] == [e["round"] for e in h2.evals]
    for e1, e2 in zip(h1.evals, h2.evals, strict=True):
        assert set(e1) == set(e2)
        for k in e1:
            np.testing.assert_allclose(e1[k], e2[k], rtol=rtol, atol=atol, err_msg=k)


def _algorithms(model, ds):
    return {
        "fedavg": fedavg(model.loss, client_optimizer=0.1, local=L, cohort=CohortSpec(size=4)),
        "scaffold": scaffold(
            model.loss, num_clients=12, client_optimizer=0.1, local=L, cohort=CohortSpec(size=4)
        ),
        "fedbuff": fedbuff(
            model.loss, num_clients=12, firing_probability=0.3, client_optimizer=0.1, local=L
        ),
        "fedper": fedper(
            model.loss, num_clients=12, client_optimizer=0.1, local=L, cohort=CohortSpec(size=4)
        ),
    }


# runs of a sweep equal the single run up to float32 round-off, not bitwise: XLA orders some
# reductions of the batched (vmapped / lax.mapped) round and evaluation differently (1-3 ulp
# per round, measured); wrong seeds, hyper-parameters or run order differ by >= 1e-3
VMAP_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedbuff", "fedper"])
def test_sweep_run_r_equals_the_single_run(setup, name):
    ds, model = setup
    alg = _algorithms(model, ds)[name]
    # fedavg: default planning and per-client evaluation; the others: central only
    spec = EVAL if name == "fedavg" else EvalSpec(every=2, clients=False)
    group = None if name == "fedavg" else 2
    kw = dict(seeds=[5, 6], model=model, num_rounds=3, test=ds.test, evaluation=spec)
    vmapped = sweep(lambda hp: alg, ds.train, progress=False, runs_per_group=group, **kw)
    assert vmapped.meta["runs_per_group"] == 2
    assert [r.seed for r in vmapped.runs] == [5, 6]
    for run in vmapped.runs:
        single = _single(alg, ds, model, run.seed, spec=spec)
        _same(vmapped.histories[run.index], single, **VMAP_TOL)
    if name == "scaffold":  # per-client state is stacked [R, C, ...]
        assert jax.tree.leaves(vmapped.states.rows["control_variates"])[0].shape[:2] == (2, 12)
    if name == "fedper":  # personal heads too
        assert jax.tree.leaves(vmapped.states.rows["personal"])[0].shape[:2] == (2, 12)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedbuff"])
def test_runs_mapped_one_at_a_time_train_bitwise_as_the_single_run(setup, name):
    """`runs_per_group=1` maps the unbatched step over runs: every per-round training metric
    is bitwise the single run's (the evaluation, compiled in another program, may differ
    in the last bit)."""
    ds, model = setup
    alg = _algorithms(model, ds)[name]
    spec = EvalSpec(every=3, clients=False)
    kw = dict(seeds=[5, 6], model=model, num_rounds=3, test=ds.test, evaluation=spec)
    mapped = sweep(lambda hp: alg, ds.train, progress=False, runs_per_group=1, **kw)
    for run in mapped.runs:
        single = _single(alg, ds, model, run.seed, spec=spec)
        for k in single.metrics:
            np.testing.assert_array_equal(mapped.histories[run.index].metric(k), single.metric(k))


def test_chunked_sweep_equals_unchunked(setup):
    ds, model = setup
    alg = _algorithms(model, ds)["fedavg"]
    kw = dict(seeds=3, model=model, num_rounds=3, test=ds.test, evaluation=EVAL, progress=False)
    full = sweep(lambda hp: alg, ds.train, runs_per_group=3, **kw)
    for group in (2,):  # a group of 2 and a last partial group of 1
        chunked = sweep(lambda hp: alg, ds.train, runs_per_group=group, **kw)
        assert chunked.meta["runs_per_group"] == group
        for h1, h2 in zip(full.histories, chunked.histories, strict=True):
            _same(h1, h2, **VMAP_TOL)


def test_run_groups_of_an_asynchronous_state_with_zero_size_leaves(setup):
    """AREA with categorical arrivals keeps a zero-size `[R, 0]` leaf: groups of 2 runs
    and a last group of 1 (`map_runs` groups them itself; `lax.map(batch_size=...)` failed
    on such leaves) equal the one-vmap sweep."""
    from fedjax_sim.algorithms.area import area
    from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events

    ds, model = setup
    events = Events(Arrivals.categorical(np.full(12, 1 / 12)), Aggregation.every(3))
    alg = area(model.loss, events=events, client_optimizer=0.1, local=L)
    kw = dict(seeds=3, model=model, num_rounds=4, evaluation=EvalSpec(every=4, clients=False))
    whole = sweep(lambda hp: alg, ds.train, progress=False, runs_per_group=3, **kw)
    grouped = sweep(lambda hp: alg, ds.train, progress=False, runs_per_group=2, **kw)
    assert any(0 in leaf.shape for leaf in jax.tree.leaves(grouped.states))
    for h1, h2 in zip(whole.histories, grouped.histories, strict=True):
        _same(h1, h2, **VMAP_TOL)


def _make_fedavg(model):
    def make(hp):
        return fedavg(
            model.loss,
            client_optimizer=optax.sgd(hp["lr"]),
            server_optimizer=optax.sgd(hp["slr"]),
            local=L,
            cohort=CohortSpec(size=4),
        )

    return make


def test_traced_hyper_parameter_changes_the_result_exactly_as_the_static_value(setup):
    ds, model = setup
    make = _make_fedavg(model)
    grid = {"lr": [0.05, 0.2], "slr": [0.5]}
    kw = dict(
        seeds=[1],
        grid=grid,
        model=model,
        num_rounds=3,
        test=ds.test,
        evaluation=EVAL,
        progress=False,
    )
    vmapped = sweep(make, ds.train, **kw)
    assert len(vmapped.runs) == 2 and vmapped.meta["runs_per_group"] == 2
    finals = set()
    for run in vmapped.runs:
        static = make({k: jnp.float32(v) for k, v in run.hparams.items()})
        single = _single(static, ds, model, run.seed)
        _same(vmapped.histories[run.index], single, **VMAP_TOL)
        finals.add(vmapped.histories[run.index].final()["test_loss"])
    assert len(finals) == 2  # every hyper-parameter value made a difference


def test_grid_expansion_order_and_labels():
    runs = expand_grid(2, {"lr": [0.1, 0.3], "mu": [0, 0.01]})
    assert [(r.index, r.config, r.seed) for r in runs] == [(i, i // 2, i % 2) for i in range(8)]
    assert [r.label for r in runs[::2]] == [
        "lr=0.1,mu=0",
        "lr=0.1,mu=0.01",
        "lr=0.3,mu=0",
        "lr=0.3,mu=0.01",
    ]
    assert runs[5].hparams == {"lr": 0.3, "mu": 0.0}
    assert [r.label for r in expand_grid([4], {})] == ["default"]
    for bad, msg in [
        ({"lr": []}, "no values"),
        ({"lr": ["a"]}, "non-numeric"),
        ({"lr": [float("nan")]}, "non-finite"),
    ]:
        with pytest.raises(ValueError, match=msg):
            expand_grid(1, bad)
    with pytest.raises(ValueError, match="distinct"):
        expand_grid([1, 1], {})


def test_summary_statistics_match_numpy_and_scipy():
    rng = np.random.default_rng(0)
    runs = expand_grid(5, {"lr": [0.1, 0.2, 0.3]})
    hists = []
    for _ in runs:
        h = History()
        h.append_rounds(1, {"train_loss": rng.normal(size=4)})
        for t in (0, 2, 4):
            h.append_eval(t, {"test_accuracy": rng.uniform()})
        hists.append(h)
    res = SweepResult(runs, hists)
    for rnd in (None, 2):
        rows = res.summary("test_accuracy", rnd)
        for g, row in enumerate(rows):
            v = np.array(
                [
                    hists[r.index].eval_series("test_accuracy")[1][-1 if rnd is None else 1]
                    for r in runs
                    if r.config == g
                ]
            )
            lo, hi = stats.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=stats.sem(v))
            assert row["n"] == 5 and row["config"] == runs[5 * g].label
            np.testing.assert_allclose(row["mean"], v.mean(), rtol=1e-12)
            np.testing.assert_allclose(row["std"], v.std(ddof=1), rtol=1e-12)
            np.testing.assert_allclose([row["ci95_low"], row["ci95_high"]], [lo, hi], rtol=1e-12)
        means = [row["mean"] for row in rows]
        assert res.best("test_accuracy", rnd)["config"] == rows[int(np.argmax(means))]["config"]
    loss = res.summary("train_loss", 3)
    v = np.array([hists[r.index].metrics["train_loss"][2] for r in runs if r.config == 1])
    np.testing.assert_allclose(loss[1]["mean"], v.mean(), rtol=1e-12)
    assert res.best("train_loss", 3)["mean"] == min(r["mean"] for r in loss)
    assert np.isnan(mean_ci(np.array([1.0]))[1])
    rounds, mean, lo, hi = res.bands("test_accuracy")["lr=0.2"]
    assert list(rounds) == [0, 2, 4] and np.all(lo <= mean) and np.all(mean <= hi)


def test_outputs_checkpoint_resume_and_untraceable_factory(setup, tmp_path):
    ds, model = setup
    make = _make_fedavg(model)
    kw = dict(
        seeds=2,
        grid={"lr": [0.1], "slr": [1.0, 0.5]},
        model=model,
        num_rounds=4,
        test=ds.test,
        evaluation=EVAL,
        progress=False,
        runs_per_group=4,
    )
    full = sweep(make, ds.train, out_dir=str(tmp_path / "out"), **kw)
    for f in ("histories.json", "runs.csv", "summary.csv", "summary.md", "best.json", "sweep.png"):
        assert (tmp_path / "out" / f).exists(), f
    back = SweepResult.from_dict(json.loads((tmp_path / "out" / "histories.json").read_text()))
    assert back.runs == full.runs and back.histories[3].evals == full.histories[3].evals
    ck = str(tmp_path / "ck")
    part = sweep(make, ds.train, checkpoint_dir=ck, checkpoint_every=2, **{**kw, "num_rounds": 2})
    assert part.histories[0].num_rounds == 2
    resumed = sweep(make, ds.train, checkpoint_dir=ck, checkpoint_every=2, resume=True, **kw)
    for h1, h2 in zip(full.histories, resumed.histories, strict=True):
        _same(h1, h2)
    with pytest.raises(ValueError, match="traced hyper-parameters"):
        sweep(  # a static hyper-parameter (the length of the local scan) cannot be traced
            lambda hp: fedprox(model.loss, local=LocalSpec(steps=int(hp["steps"]))),
            ds.train,
            seeds=1,
            grid={"steps": [2.0]},
            model=model,
            num_rounds=1,
            progress=False,
        )


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grid", "foo=1"], "unknown hyper-parameter"),
        (["--grid", "mu=0,0.01"], "fedavg does not use it"),
        (["--grid", "client_lr=a,b"], "must be numbers"),
        (["--grid", "client_lr="], "no values"),
        (["--grid", "client_lr"], "name=v1,v2"),
        (["--grid", "client_lr=0.1", "--grid", "client_lr=0.2"], "given twice"),
        (["--grid", "client_lr=0.1,-1"], "--client-lr must be > 0"),
        (["--seeds", "0"], "--seeds must be >= 1"),
    ],
)
def test_cli_bad_grid_is_one_line_and_exit_2(flags, message, capsys, tmp_path):
    assert main(["sweep", *flags, "--rounds", "1", "--no-progress", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedjax-sim: error:") and message in err and "\n" not in err


def test_cli_sweep_writes_results_and_resumes(tmp_path, capsys):
    flags = [
        "sweep",
        "--num-clients",
        "10",
        "--cohort-size",
        "3",
        "--local-steps",
        "1",
        "--eval-every",
        "1",
        "--seeds",
        "2",
        "--grid",
        "client_lr=0.05,0.1",
        "--grid",
        "server_lr=1",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--checkpoint-every",
        "1",
        "--runs-per-group",
        "4",
    ]
    assert main([*flags, "--rounds", "1"]) == 0
    assert main([*flags, "--rounds", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "2 grid points x 2 seeds = 4 runs" in out and "best: client_lr=" in out
    res = SweepResult.from_dict(json.loads((tmp_path / "histories.json").read_text()))
    assert [r.seed for r in res.runs] == [0, 1, 0, 1]
    assert all(
        h.rounds == [1, 2] and [e["round"] for e in h.evals] == [0, 1, 2] for h in res.histories
    )
    for f in ("summary.csv", "summary.md", "best.json", "sweep.png", "runs.csv"):
        assert (tmp_path / f).exists(), f


def test_auto_client_map_vmaps_the_cohort_inside_a_group_of_runs():
    """Inside a vmapped group of runs `ClientMap("auto")` maps the cohort with vmap (runs x
    clients lanes in one batch); outside, and with an explicit chunk, the usual rule."""
    from fedjax_sim.runtime.parallel import ClientMap, batched_runs

    assert ClientMap().resolve(10) == ("map", 8)  # CPU static rule
    assert ClientMap("map", 2).resolve(10) == ("map", 2)
    with batched_runs():
        assert ClientMap().resolve(10) == ("vmap", 10)
        assert ClientMap("auto", 2).resolve(10) == ("map", 2)
        assert ClientMap("map", 2).resolve(10) == ("map", 2)
    assert ClientMap().resolve(10) == ("map", 8)


def _personalized(model, name):
    """The personalized presets besides FedPer (`test_sweep_run_r_equals_the_single_run`),
    12 clients, cohort 4."""
    from fedjax_sim.algorithms import partitioned, personal_models

    kw = dict(client_optimizer=0.1, local=L, cohort=CohortSpec(size=4))
    rows = dict(num_clients=12)
    return {
        "ditto": lambda: personal_models.ditto(model.loss, lam=0.5, **rows, **kw),
        "apfl": lambda: personal_models.apfl(model.loss, **rows, **kw),
        "pfedme": lambda: personal_models.pfedme(model.loss, inner_steps=2, **rows, **kw),
        "per_fedavg_hf": lambda: personal_models.per_fedavg(model.loss, variant="hf", **kw),
        "fedavg_ft": lambda: personal_models.fedavg_ft(model.loss, finetune_steps=2, **kw),
        "lg_fedavg": lambda: partitioned.lg_fedavg(model.loss, **rows, **kw),
        "fedrep": lambda: partitioned.fedrep(model.loss, head_steps=1, **rows, **kw),
        "fedbabu": lambda: partitioned.fedbabu(model.loss, finetune_steps=2, **kw),
    }[name]()


@pytest.mark.parametrize(
    "name",
    ["ditto", "apfl", "pfedme", "per_fedavg_hf", "fedavg_ft", "lg_fedavg", "fedrep", "fedbabu"],
)
def test_sweep_of_personalized_presets_equals_the_single_runs(setup, name):
    """Every personalized preset runs in a sweep (its personal rows stacked `[R, C, ...]`):
    run r equals the single run of its seed (2 rounds, central evaluation)."""
    ds, model = setup
    alg = _personalized(model, name)
    spec = EvalSpec(every=2, clients=False)
    kw = dict(seeds=[5, 6], model=model, num_rounds=2, test=ds.test, evaluation=spec)
    vmapped = sweep(lambda hp: alg, ds.train, progress=False, **kw)
    for run in vmapped.runs:
        _same(vmapped.histories[run.index], _single(alg, ds, model, run.seed, 2, spec), **VMAP_TOL)
    rows = jax.tree.leaves(vmapped.states.rows)  # personal models / heads / bodies
    assert bool(rows) == (name in ("ditto", "apfl", "pfedme", "lg_fedavg", "fedrep"))
    assert all(leaf.shape[:2] == (2, 12) for leaf in rows)
