"""Every ``Note [...]`` cited anywhere in the project is defined exactly once.

A Note is defined by its title on a line of its own, underlined with ``~``::

    # Note [Budget units]
    # ~~~~~~~~~~~~~~~~~~~

(in a comment or a docstring), or, in the library, inline by a docstring
that opens with the title and a colon (``"Note [Dynamo's size inputs]: ..."``;
a test's docstring opening that way cites the Note it tests). A citation is
the title anywhere else, possibly wrapped over lines.

A dotted name of aotgrad's in backticks (``ops.table.draws_random``,
``aotgrad.capture.tracing.fake``) names something that exists, so that a Note
keeps up with a module that moved.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
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


# ``a.b.c`` in one or two backticks, possibly called: ``ops.table.draws_random()``.
_DOTTED = re.compile(r"`{1,2}((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(?:\(\))?`{1,2}")


def aotgrad_modules() -> set[str]:
    import aotgrad

    return {"aotgrad"} | {m.name for m in pkgutil.walk_packages(aotgrad.__path__, "aotgrad.")}


def _aotgrad_name(token: str, modules: set[str]) -> str | None:
    """``token`` as a name under ``aotgrad`` when it is one of aotgrad's: it starts with
    ``aotgrad.`` or with a module's path (``ops.table``); None for anything else
    (``signature.outputs`` is an attribute of a local variable)."""
    parts = token.split(".")
    if parts[0] == "aotgrad":
        return token
    return "aotgrad." + token if f"aotgrad.{parts[0]}.{parts[1]}" in modules else None


def _names_something(name: str, modules: set[str]) -> bool:
    parts = name.split(".")
    k = max(k for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in modules)
    try:
        value = importlib.import_module(".".join(parts[:k]))
        for attribute in parts[k:]:
            value = getattr(value, attribute)
    except (ImportError, AttributeError):
        return False
    return True


def stale_names(files: Iterable[tuple[str, str]], modules: set[str]) -> tuple[list[str], int]:
    """(each aotgrad name in backticks that names nothing, how many names were checked)."""
    stale, checked = [], 0
    for file, text in files:
        for match in _DOTTED.finditer(text):
            name = _aotgrad_name(match.group(1), modules)
            if name is None:
                continue
            checked += 1
            if not _names_something(name, modules):
                stale.append(f"{file}: {match.group(1)} names nothing")
    return stale, checked


def test_aotgrad_names_in_notes_and_docs_exist():
    files = [f for f in project_files() if f[0].startswith(("src/", "docs/", "README"))]
    stale, checked = stale_names(files, aotgrad_modules())
    assert stale == []
    assert checked > 50  # the library's Notes and docs name many: the pattern still finds them


def test_a_planted_stale_name_fails():
    text = "``ops.table.no_such_rule``, ``signature.outputs``, ``signature.convention.Signature()``"
    assert stale_names([("a.py", text)], aotgrad_modules()) == (
        ["a.py: ops.table.no_such_rule names nothing"],
        2,
    )


# A path in the repository or in the package: ``capture/tracing/joint.py``, `bench/ab.py`.
_PATH = re.compile(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_]\w*\.(?:py|md))\b")
_PATH_ROOTS = ("src", "tests", "bench", "docs", "examples", "sweep")


def missing_paths(files: Iterable[tuple[str, str]], root: pathlib.Path) -> list[str]:
    """Each path of the repository (``bench/ab.py``) or of the package
    (``capture/tracing/joint.py``) that ``files`` name and that does not exist."""
    package = root / "src" / "aotgrad"
    ours = {p.name for p in package.iterdir() if p.is_dir()} | set(_PATH_ROOTS)
    found = []
    for file, text in files:
        for match in _PATH.finditer(text):
            path = match.group(1)
            if path.split("/")[0] in ours and not any(
                (base / path).exists() for base in (root, package)
            ):
                found.append(f"{file}: {path} does not exist")
    return found


def test_paths_in_notes_and_docs_exist():
    files = [f for f in project_files() if f[0].startswith(("src/", "docs/", "README"))]
    assert missing_paths(files, ROOT) == []


def test_a_planted_missing_path_fails():
    text = "see capture/tracing/joint.py, capture/joint.py, bench/ab.py and torch/nn/functional.py"
    assert missing_paths([("a.py", text)], ROOT) == ["a.py: capture/joint.py does not exist"]
