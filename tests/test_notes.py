"""Every ``Note [...]`` cited anywhere in the project is defined exactly once.

A Note is defined by its title on a line of its own, underlined with ``~``::

    # Note [Budget units]
    # ~~~~~~~~~~~~~~~~~~~

(in a comment or a docstring), or, in the library, inline by a docstring
that opens with the title and a colon (``"Note [Dynamo's size inputs]: ..."``;
a test's docstring opening that way cites the Note it tests). A citation is
the title anywhere else, possibly wrapped over lines.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLOBS = ("src/**/*.py", "tests/**/*.py", "bench/*.py", "sweep/*.py", "examples/*.py")
GLOBS_MD = ("*.md", "docs/**/*.md")

_TITLE = r"Note\s+\[([^\]]+)\]"
_UNDERLINED = re.compile(r"^[ \t]*(?:#[ \t]*)?" + _TITLE + r"[ \t]*\n[ \t]*(?:#[ \t]*)?~{3,}", re.M)
_INLINE = re.compile(r"^[ \t]*[rb]?\"\"\"" + _TITLE + r":", re.M)
_CITED = re.compile(_TITLE)


def _title(raw: str) -> str:
    """A title wrapped over comment or docstring lines, as one line."""
    return re.sub(r"\s*\n[\s#>*]*", " ", raw).strip()


def notes(files: Iterable[tuple[str, str]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(definitions, citations): each title -> the files defining / citing it."""
    defined: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for name, text in files:
        inline = (_INLINE,) if name.startswith("src/") else ()  # tests cite this way
        for pattern in (_UNDERLINED, *inline):
            for match in pattern.finditer(text):
                defined.setdefault(_title(match.group(1)), []).append(name)
        for match in _CITED.finditer(text):
            cited.setdefault(_title(match.group(1)), []).append(name)
    return defined, cited


def problems(files: Iterable[tuple[str, str]]) -> list[str]:
    defined, cited = notes(files)
    found = [
        f"Note [{title}] cited in {', '.join(sorted(set(where)))} is defined nowhere"
        for title, where in cited.items()
        if title not in defined
    ]
    found += [
        f"Note [{title}] is defined {len(where)} times: {', '.join(where)}"
        for title, where in defined.items()
        if len(where) > 1
    ]
    return found


def project_files() -> list[tuple[str, str]]:
    paths = {p for pattern in GLOBS + GLOBS_MD for p in ROOT.glob(pattern)}
    paths.discard(pathlib.Path(__file__).resolve())  # its planted notes are examples
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(paths)]


def test_every_cited_note_is_defined_once():
    files = project_files()
    assert len(files) > 50
    assert problems(files) == []


def test_the_project_defines_and_cites_notes():
    defined, cited = notes(project_files())
    assert "Calling convention" in defined
    assert "Budget units" in cited


def test_a_planted_citation_of_a_missing_note_fails():
    files = [
        ("a.py", "# Note [Real one]\n# ~~~~~~~~~~~~~~~\n# text\n"),
        ("b.py", '"""See Note [Real one] and Note [Made\n    # up one]."""\n'),
    ]
    assert problems(files) == ["Note [Made up one] cited in b.py is defined nowhere"]


def test_inline_and_docstring_definitions_count():
    files = [
        ("src/a.py", '    """Note [Sizes]: each size is re-read."""\n'),
        ("tests/t.py", '    """Note [Sizes]: a test of it."""\n'),
        ("b.py", '"""Stage.\n\nNote [Order]\n~~~~~~~~~~~~\nText.\n"""\n# Note [Order] again\n'),
        ("c.md", "See Note [Sizes] and Note [Order].\n"),
    ]
    assert problems(files) == []


def test_a_note_defined_twice_fails():
    twice = "# Note [Twice]\n# ~~~~~~~~~~~~\n"
    assert problems([("a.py", twice), ("b.py", twice)]) == [
        "Note [Twice] is defined 2 times: a.py, b.py"
    ]
