"""The README's Python example runs as written (documentation is tested code)."""

import importlib.util
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    history = namespace["history"]
    assert history.num_rounds == 200
    assert history.final()["test_accuracy"] > 0.85


def _setup_commands() -> list[str]:
    path = README.parent / ".ci" / "readme_commands.py"
    spec = importlib.util.spec_from_file_location("readme_commands", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.setup_commands()


def test_setup_has_the_two_commands_ci_runs():
    """`.ci/run` runs exactly these, verbatim: a bare install (no extras) that runs the main
    job, then the test extras and pytest."""
    install_and_run, test = _setup_commands()
    assert re.fullmatch(r"pip install -e \. && fedjax-sim run", install_and_run)
    assert test.startswith('pip install -e ".[test') and "pytest" in test
    ci = (README.parent / ".ci" / "run").read_text()
    assert "readme_commands.py" in ci and ".venv-bare" in ci
