"""Run every ```python block of the documentation, so the examples in the docs cannot rot.

Usage: ``python docs/run_examples.py PACKAGE...``. Each page runs top to bottom in one fresh
namespace (later blocks may use names defined by earlier ones), in a temporary working directory.
Blocks fenced as anything other than ``python`` (``bash``, ``text``, ``pycon``) are not run.
Exits non-zero naming the page and the line of the first failing block.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

DOCS = Path(__file__).resolve().parent
_FENCE = re.compile(r"^(?P<indent> *)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """Return ``(line_number, code)`` for each ```python block of a Markdown page."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("code").splitlines())
        blocks.append((text.count("\n", 0, match.start()) + 2, code))
    return blocks


def run_page(page: Path) -> int:
    """Run a page's blocks in one namespace; return the number of blocks run."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    blocks = python_blocks(page)
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{line}", "exec", dont_inherit=True), namespace)
        except Exception as exc:
            traceback.print_exc()
            raise SystemExit(f"example failed: {page} line {line}: {type(exc).__name__}: {exc}") from exc
    return len(blocks)


def main(packages: list[str]) -> None:
    if not packages:
        raise SystemExit("usage: python docs/run_examples.py PACKAGE...")
    total = 0
    for package in packages:
        pages = sorted((DOCS / package / "docs").rglob("*.md"))
        if not pages:
            raise SystemExit(f"no documentation pages under {DOCS / package / 'docs'}")
        for page in pages:
            with tempfile.TemporaryDirectory() as workdir:
                cwd = os.getcwd()
                os.chdir(workdir)
                try:
                    count = run_page(page)
                finally:
                    os.chdir(cwd)
            total += count
            print(f"{page.relative_to(DOCS)}: {count} example(s) ran")
    print(f"{total} documentation examples ran")


if __name__ == "__main__":
    main(sys.argv[1:])
