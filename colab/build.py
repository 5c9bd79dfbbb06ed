"""Builds the Colab notebooks `colab/*.ipynb` from their sources `colab/src/*.py`.

The sources are plain text in the "percent" format (jupytext-compatible): a line
`# %% [markdown]` starts a markdown cell (its lines are commented with `# `), a line `# %%`
starts a code cell, and `# %% tags=["parameters"]` tags it. Edit the sources, then

    python colab/build.py            # rewrite colab/*.ipynb (no outputs, no execution counts)
    python colab/build.py --check    # exit 1 if a notebook differs from its source

`tests/test_notebooks.py` checks that the notebooks match their sources, carry no outputs,
and run (with `SMALL = True`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "src"
MARKER = re.compile(r"^# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")
METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
    "colab": {"provenance": [], "toc_visible": True},
}
# notebooks that ask Colab for an accelerator runtime
ACCELERATOR = {"03_throughput": {"accelerator": "GPU", "colab": {"gpuType": "T4"}}}


def parse(text: str) -> list[tuple[str, str, list[str]]]:
    """`[(cell_type, source, tags)]` of a percent-format source."""
    cells: list[tuple[str, list[str], list[str]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = MARKER.match(line)
        if m:
            kind = "markdown" if m["markdown"] else "code"
            cells.append((kind, [], json.loads(m["tags"]) if m["tags"] else []))
        elif not cells:
            if line.strip():
                raise ValueError(f"line {number}: text before the first '# %%' cell marker")
        elif cells[-1][0] == "markdown":
            if line and not (line == "#" or line.startswith("# ")):
                raise ValueError(f"line {number}: markdown lines must start with '# '")
            cells[-1][1].append(line[2:])
        else:
            cells[-1][1].append(line)
    return [(kind, "\n".join(lines).strip("\n"), tags) for kind, lines, tags in cells]


def build(source: pathlib.Path) -> str:
    """The notebook JSON of one source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = json.loads(json.dumps(METADATA))
    for k, v in ACCELERATOR.get(source.stem, {}).items():
        nb.metadata[k] = {**nb.metadata.get(k, {}), **v} if isinstance(v, dict) else v
    for i, (kind, text, tags) in enumerate(parse(source.read_text())):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = new(text, id=f"cell-{i:02d}")
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nbformat.writes(nb, version=4) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check; write nothing")
    args = ap.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("*.py")):
        target = HERE / f"{source.stem}.ipynb"
        text = build(source)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
    if args.check and stale:
        print(f"out of date (run python colab/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    print(("would rewrite: " if args.check else "wrote: ") + (", ".join(stale) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
