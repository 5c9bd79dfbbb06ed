"""The documentation builds without warnings and its code runs (documentation is tested code).

`mkdocs build --strict` renders the API reference from the docstrings (mkdocstrings) and fails
on any warning: a `::: module` that does not import, a cross-reference `[x][fedjax_sim.y]` to
a name that does not exist, a broken link between pages, a page missing from the nav.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

from fedjax_sim import algorithms
from fedjax_sim.algorithms.core import tree_norm, tree_sub

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "write_your_own_algorithm.md"

pytest.importorskip("mkdocstrings", reason="docs extra not installed: pip install -e '.[docs]'")


def mkdocs_build(config_dir: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=config_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mkdocs_build_strict(tmp_path):
    result = mkdocs_build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    core = (tmp_path / "site" / "api" / "core" / "index.html").read_text()
    # the API reference is rendered from the docstrings, not just a page title
    for name in ("local_train", "map_cohort", "server_update", "CohortSpec.sample"):
        assert f'id="fedjax_sim.algorithms.core.{name}"' in core, name
    assert "masked unequal work" in core or "lax.scan" in core


def test_mkdocs_strict_fails_on_broken_reference(tmp_path):
    """The same configuration with one dangling cross-reference must not build (this caught
    that `mkdocs build -q` hides warnings from --strict)."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [gone][fedjax_sim.algorithms.core.no_such_fn].\n")
    # mkdocstrings' `paths: [.]` is relative to the config file: point it at the repository
    config = tmp_path / "mkdocs.yml"
    config.write_text(config.read_text().replace("paths: [.]", f"paths: [{ROOT}]"))
    result = mkdocs_build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "fedjax_sim.algorithms.core.no_such_fn" in result.stdout + result.stderr


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_write_your_own_algorithm_guide_runs(monkeypatch):
    """Every python block of the guide runs, in order, in one namespace; the guide's own
    check (clip=inf is FedAvg exactly) runs with it. Registering is kept out of the global
    registry so other tests see the built-in algorithms only."""
    monkeypatch.setattr(algorithms, "ALGORITHMS", dict(algorithms.ALGORITHMS))
    monkeypatch.setattr(algorithms, "_DESCRIPTIONS", dict(algorithms._DESCRIPTIONS))
    blocks = python_blocks(GUIDE)
    assert len(blocks) >= 4, "guide lost a code block"
    ns: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name}[block {i}]", "exec"), ns)

    # the composed algorithm learns
    history = ns["history"]
    assert history.num_rounds == 20
    assert history.final()["test_accuracy"] > 0.5
    # the named preset is the same composition, bit for bit
    model, ds, key = ns["model"], ns["ds"], ns["key"]
    preset = algorithms.scaffold(
        model.loss,
        num_clients=20,
        client_optimizer=0.1,
        local=ns["LocalSpec"](steps=5, batch_size=16),
        aggregator=ns["error_feedback"](ns["TopK"](fraction=0.05)),
        server_optimizer=ns["optax"].adam(0.01),
        cohort=ns["CohortSpec"](size=8, sampling="bernoulli", probability=0.3),
    )
    params = model.init(key)
    runs = [
        jax.jit(a.step)(a.init(params, key), ds.train, key)[0] for a in (ns["composed"], preset)
    ]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), *[r.params for r in runs]))
    # registered under its name, described by its docstring, and built by name
    assert algorithms.ALGORITHMS["pulled_fedavg"] is ns["pulled_fedavg"]
    assert algorithms.describe("pulled_fedavg").startswith("FedAvg whose local steps are pulled")
    with pytest.raises(ValueError, match="pull mu"):
        ns["pulled_fedavg"](model.loss, mu=-1.0)
    # the pull is real: a strong pull keeps the clients near the global model
    moved = {}
    for mu in (0.0, 100.0):
        alg = ns["pulled_fedavg"](model.loss, mu=mu, client_optimizer=0.005)
        state, _ = jax.jit(alg.step)(alg.init(params, key), ds.train, key)
        moved[mu] = float(tree_norm(tree_sub(state.params, params)))
    assert moved[100.0] < 0.5 * moved[0.0]


def test_write_your_own_algorithm_guide_runs_as_a_user_runs_it(tmp_path):
    """The guide's code as one script, the way a user runs it: `ClientMap("auto")` measuring
    (the suite turns measuring off) with an empty cache. Its own exact checks hold."""
    script = tmp_path / "guide.py"
    script.write_text("\n".join(python_blocks(GUIDE)))
    env = {k: v for k, v in os.environ.items() if k != "FEDJAX_SIM_AUTOTUNE"}
    env["FEDJAX_SIM_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "test accuracy" in proc.stdout
    assert json.loads((tmp_path / "cache" / "client_map.json").read_text())  # it measured


SPEC_REF = re.compile(r"docs/specs/([\w.-]+\.md)")


def test_spec_references_stay_in_the_repository():
    """Docstrings and docs cite the specs copied into `docs/specs/`, never a path outside the
    repository, and every cited spec exists and is in the documentation's nav."""
    files = [
        p
        for d in ("fedjax_sim", "tests", "docs")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".md") and p.name != "test_docs.py"
    ]
    outside = [str(p) for p in files if "../shared/" in p.read_text()]
    assert not outside, f"references outside the repository: {outside}"
    cited = {name for p in files for name in SPEC_REF.findall(p.read_text())}
    assert cited >= {"fedmim.md", "fgdro.md", "area_async.md"}, cited
    missing = sorted(name for name in cited if not (ROOT / "docs" / "specs" / name).is_file())
    assert not missing, f"cited specs missing from docs/specs/: {missing}"
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f"specs/{p.name}" in nav for p in (ROOT / "docs" / "specs").glob("*.md"))
