"""Prints README.md's set-up commands: `python3 .ci/readme_commands.py N` -> the N-th (0-based).

The commands are the ```bash blocks of README.md's "## Set-up" section: the bare install with
the main job, then the test extras with the test suite. `.ci/run` runs them verbatim;
`tests/test_readme.py` checks there are exactly these two.
"""

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def setup_commands(text: str | None = None) -> list[str]:
    """The bash blocks of the "## Set-up" section, stripped."""
    text = README.read_text() if text is None else text
    setup = text.split("\n## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", setup, flags=re.S)]


if __name__ == "__main__":
    print(setup_commands()[int(sys.argv[1])])
