"""The Colab notebooks run as written (documentation is tested code).

Each notebook in `colab/` is executed top to bottom in a fresh Python kernel with the
small-size parameter (`SMALL = True`, injected after the cell tagged "parameters", as
papermill does); any exception fails the test. The notebooks are also checked to be
stored without outputs, to match their sources in `colab/src/`, and to carry the Colab badge
and the guarded install cell.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="test extra not installed")
nbclient = pytest.importorskip("nbclient", reason="test extra not installed")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(p.stem for p in COLAB.glob("*.ipynb"))
BADGE = "https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/{}.ipynb"
INSTALL = '%pip install -q "fedjax_sim @ git+https://github.com/fedjax-sim/fedjax_sim"'
CELL_TIMEOUT_S = 300


def load(name: str):
    return nbformat.read(COLAB / f"{name}.ipynb", as_version=4)


def test_the_notebooks_exist():
    expected = {
        "01_quickstart",
        "02_async",
        "03_throughput",
        "04_paper_algorithms",
        "05_privacy_robustness",
        "06_sweeps",
        "07_hypergradients",
        "08_personalization",
        "09_system_heterogeneity",
        "10_federated_lora",
    }
    assert expected <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    raw = json.loads((COLAB / f"{name}.ipynb").read_text())
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{name}: cell {cell['id']} has stored outputs"
            assert cell["execution_count"] is None, f"{name}: cell {cell['id']} was executed"
    nbformat.validate(nbformat.from_dict(raw))


def test_notebooks_match_their_sources():
    result = subprocess.run(
        [sys.executable, str(COLAB / "build.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.stem for p in (COLAB / "src").glob("*.py")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_has_badge_install_and_parameters(name):
    nb = load(name)
    assert nb.cells[0].cell_type == "markdown"
    assert f"]({BADGE.format(name)})" in nb.cells[0].source, "Open in Colab badge"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert INSTALL in code[0].source and 'find_spec("fedjax_sim") is None' in code[0].source
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SMALL = False" in params[0].source


def with_small_parameters(nb):
    """A copy of the notebook with `SMALL = True` injected after its parameters cell."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    cell = nbformat.v4.new_code_cell("SMALL = True", id="injected-parameters")
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(i + 1, cell)
    return nb


def this_interpreter_kernel(tmp_path, monkeypatch) -> str:
    """A kernel spec that runs ipykernel with this very interpreter (whatever "python3" kernel
    a user or system Jupyter installation may define), found first through JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / "fedjax-sim-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "fedjax_sim tests", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # connection files
    return spec.name


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    # the small runs are dominated by XLA's CPU compile time, which this flag halves (the
    # kernel inherits the environment)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", flags.strip())
    nb = with_small_parameters(load(name))
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)", id="which"))
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=this_interpreter_kernel(tmp_path, monkeypatch),
        resources={"metadata": {"path": str(tmp_path)}},  # files it writes go to tmp_path
    )
    client.execute()  # raises CellExecutionError (with the traceback) if a cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} plotted nothing inline"
    assert nb.cells[-1].outputs[0].text.strip() == sys.executable  # ran in this environment
