"""Every ```python block of README.md and docs/*.md runs as written (issue 38).

A page's blocks run in order in one namespace, as a reader pasting them into one session would
run them, each page in a fresh process (in a scratch directory: blocks write files) with a time
limit. A block is left out only where the page says so, right before it and visibly::

    <!-- no-run: examples/distributed.py itself, run on 2 processes by tests/... -->
    ```python

with the reason after ``no-run:``; such skips are few and each names where the code does run.
A traceback from a block names the page and the block's line in it (``docs/scan.md:130``).

Run one page by hand: ``python tests/test_docs_blocks.py docs/scan.md``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120  # per page; the slowest page takes a few seconds

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")  # a fence may be indented (inside a list item)
_NO_RUN = re.compile(r"^<!--\s*no-run:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # the page's path from the repository root
    line: int  # the line of the block's first line of code, counted from 1
    code: str
    skip: str | None  # the no-run reason, or None: the block runs


def blocks(path: Path) -> list[Block]:
    """The page's ```python blocks, in order, each with its no-run reason (if any)."""
    lines = path.read_text().split("\n")
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent = fence.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if fence.group(2) == "python":
            marker = _NO_RUN.match(lines[i - 1].strip()) if i > 0 else None
            code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
            found.append(Block(page, i + 2, code, marker.group(1) if marker else None))
        i = end + 1
    return found


def run_page(page: str) -> None:
    """Run the page's blocks in order in one namespace (the reader's session)."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks(ROOT / page):
        if block.skip is not None:
            continue
        # Blank lines first, so a traceback's line number is the line in the page.
        code = "\n" * (block.line - 1) + block.code
        exec(compile(code, block.page, "exec"), namespace)


def _pages_with_code() -> list[str]:
    """The pages with a block to run (a page whose only block is left out starts no process)."""
    return [str(p.relative_to(ROOT)) for p in PAGES if any(b.skip is None for b in blocks(p))]


@pytest.mark.parametrize("page", _pages_with_code())
def test_page_runs(page: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [sys.executable, __file__, page],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"{page}: a block failed\n{result.stderr[-6000:]}"


def test_blocks_are_found_as_a_reader_sees_them(tmp_path: Path) -> None:
    """An indented block (inside a list item) is found and dedented; a marker leaves out only
    the block right after it."""
    page = tmp_path / "page.md"
    page.write_text(
        "- a step:\n\n  ```python\n  x = 1\n  ```\n\n<!-- no-run: needs a GPU -->\n"
        "```python\nraise SystemExit\n```\n\n```\nnot python\n```\n"
    )
    found = blocks(page)
    assert [(b.line, b.code, b.skip) for b in found] == [
        (4, "x = 1\n", None),
        (9, "raise SystemExit\n", "needs a GPU"),
    ]


def test_skips_are_marked_and_explained() -> None:
    """Every no-run marker stands right before a ```python block and gives its reason; and
    there are few of them."""
    skipped = []
    for path in PAGES:
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if "no-run" in line:
                marker = _NO_RUN.match(line.strip())
                assert marker, f"{path.name}:{i + 1}: write <!-- no-run: reason -->"
                assert marker.group(1), f"{path.name}:{i + 1}: the reason is empty"
                assert lines[i + 1].strip() == "```python", (
                    f"{path.name}:{i + 1}: not before a block"
                )
                skipped.append(f"{path.name}:{i + 1}")
    every = [b for p in PAGES for b in blocks(p)]
    assert len(skipped) <= max(1, len(every) // 10), f"too many blocks left out: {skipped}"


if __name__ == "__main__":
    import library_models  # noqa: F401  (torchvision's shim, before a page imports transformers)

    run_page(sys.argv[1])
