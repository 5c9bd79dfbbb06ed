"""The package's layering (docs/design.md, "Layers"): at most 8 top-level units, imports only
downward, no cycle, no function-local import below the app layer except of an optional
dependency. Figures: `python tools/import_graph.py`."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

import import_graph as g  # noqa: E402

# rank of each top-level unit: a unit imports only units of lower rank (or itself)
RANKS = {
    "core": 0,
    "data": 1,
    "runtime": 2,
    "models": 2,
    "algorithms": 3,
    "run": 4,
    "app": 5,
    "__main__": 6,
}


def _short(unit: str) -> str:
    return unit.removeprefix(g.PACKAGE + ".")


def test_at_most_eight_top_level_units_all_ranked():
    units = {_short(u) for u in g.unit_graph(g.graph()[0])}
    assert len(units) <= 8, sorted(units)
    assert units == set(RANKS), sorted(units ^ set(RANKS))


def test_imports_only_downward():
    upward = [
        f"{_short(a)} -> {_short(b)}"
        for a, targets in g.unit_graph(g.graph()[0]).items()
        for b in targets
        if RANKS[_short(b)] >= RANKS[_short(a)]
    ]
    assert upward == []


def test_no_import_cycle_between_modules():
    assert g.cycles(g.graph()[0]) == []


# the app layer defers JAX-backed imports so that a bad flag is refused in well under a
# second (tests/test_fuzz_cli.py); below it, a function-local import is a cycle dodge
LAZY_LAYERS = ("app",)


def test_no_function_local_import_below_the_app_layer():
    _, local = g.graph()
    below = [f"{m}:{line} -> {t}" for m, t, line in local if _short(g.unit(m)) not in LAZY_LAYERS]
    assert below == []


def test_figures_flag_a_cycle_and_an_upward_import():
    """The checker can fail: a made-up graph with a cycle and a cross-unit edge."""
    edges = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.a.x"}, "p.c": set()}
    assert g.cycles(edges) == [["p.a.x", "p.b.y"]]
    assert g.unit_graph(edges) == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}


# `fedjax_sim.__all__` at 1ba5437, the last commit of the flat layout: every name still works
PUBLIC_BEFORE_LAYERS = (
    "Aggregator Algorithm ArrayData Batch ClientMap ClientWork CohortSpec Distributor EvalSpec "
    "FederatedData History LocalHook LocalSpec Model NonFiniteError Stragglers algorithms area "
    "as_fedavg chain clipped compose compressed data dr_dsgd drfa ef_fedavg ef_fedprox "
    "error_feedback fedadagrad fedadam fedadam_reddi fedasync fedavg fedavgm fedbuff fedcm "
    "feddyn fedlps fedmim fednova fedopt fedprox fedsam fedsgd fedyogi fgdro_cvar fgdro_kl "
    "fgdro_kl_adam forced_cohorts fp_fedavg fp_fedprox local_adam local_train mean mifa models "
    "mofedsam s_fedavg scaffold simulate simulate_streamed"
).split()


def test_public_names_of_the_flat_layout_still_exported():
    import fedjax_sim

    missing = [n for n in PUBLIC_BEFORE_LAYERS if not hasattr(fedjax_sim, n)]
    assert missing == []
    assert set(PUBLIC_BEFORE_LAYERS) <= set(fedjax_sim.__all__)
    assert callable(fedjax_sim.simulate) and callable(fedjax_sim.simulate_streamed)
