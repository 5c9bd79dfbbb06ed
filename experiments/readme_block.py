"""A generated block of experiments/README.md: the text between two markers, replaced by a
report script's output (`--write`) or printed; the report's test compares the two."""

from __future__ import annotations

import os

README = os.path.join(os.path.dirname(__file__), "README.md")


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    """`text` with what lies between the markers `begin` and `end` replaced by `block`."""
    i, j = text.index(begin) + len(begin), text.index(end)
    return text[:i] + "\n" + block + "\n" + text[j:]


def print_or_write(block: str, begin: str, end: str, write: bool, readme: str = README) -> None:
    """Print `block`, or with `write` put it between the markers of `readme`."""
    if not write:
        print(block)
        return
    with open(readme) as f:
        text = f.read()
    with open(readme, "w") as f:
        f.write(replace_block(text, begin, end, block))
