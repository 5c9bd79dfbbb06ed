"""The README's Python example runs as written (documentation is tested code)."""

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
