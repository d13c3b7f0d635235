"""The code blocks of the README and of the docs/ pages, for the tests that run them.

```python blocks run verbatim (tests/test_readme.py); ```bash blocks are commands a reader types,
run verbatim in a fresh copy of the repository (tests/test_launch.py); ```text blocks are output
or file trees, never run.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


OWN_TEST = {"after-training.md": "test_docs_after_training.py", "modes.md": "test_docs_modes.py"}
"""Pages whose blocks a test of their own runs in order and checks (a later block reads what an earlier one
wrote); the generic tests leave them out."""


def pages() -> list[Path]:
    """The README, then every docs/ page that has no test of its own."""
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in OWN_TEST)]


def blocks(lang: str, page: Path | None = None) -> list[tuple[Path, str]]:
    """(page, code) of every ```<lang> block, in reading order."""
    return [(p, code) for p in ([page] if page else pages())
            for code in re.findall(rf"^```{lang}\n(.*?)^```$", p.read_text(), re.S | re.M)]


def python_block(first_line: str) -> str:
    """The one python block (of all pages) that starts with ``first_line``."""
    found = [code for _, code in blocks("python") if code.startswith(first_line)]
    assert len(found) == 1, f"expected one python block starting with {first_line!r}, found {len(found)}"
    return found[0]


def commands(code: str) -> list[str]:
    """The commands of a bash block as a reader would type them: one per line, continued lines
    (ending in a backslash) and here-documents joined, comment-only and blank lines left out."""
    out: list[str] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + "\n" + lines[i]
            i += 1
        here = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if here:
            while i < len(lines) and lines[i].strip() != here.group(1):
                line += "\n" + lines[i]
                i += 1
            line += "\n" + here.group(1)
            i += 1
        out.append(line)
    return out
