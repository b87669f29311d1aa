"""The package's dependencies point one way, and aotgrad never calls AOTAutograd.

Every top-level module of the package sits in one layer of ``LAYERS``; a
module may import only from layers below its own (and from inside itself).
Imports are resolved as Python resolves them: ``from . import x``,
``from ..capture import y`` and ``from aotgrad import trace`` (the package's
public face, the top layer) all count.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import networkx as nx
import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "aotgrad"

LAYERS: list[tuple[str, ...]] = [
    ("_torch_compat",),  # every private torch name aotgrad uses
    ("errors", "measure"),  # error types; measured peaks
    ("ops",),  # per-op knowledge: one table per kind of fact, keyed by op
    ("signature",),  # stage 1: the calling convention, module state lifted to inputs
    ("capture",),  # stage 2: the joint graph
    ("partition",),  # stage 3: forward and backward graphs
    ("runtime",),  # stage 4: the autograd.Function
    ("report", "export"),  # tables and reports over the graphs; torch.export programs of them
    ("settings", "cache"),  # Options and the AOTGRAD_* switches; specializations, their keys
    # and what a Traced's calls must keep to
    ("pipeline", "store"),  # the stage sequence once: the stages, the driver; graphs in files
    # and the disk cache (docs/caching.md), which never import the pipeline
    ("compilers", "wrappers"),  # compilers users pass; DDP and FSDP2 run around the graphs
    ("api",),  # the frontends: trace, aot_function, aot_module, load
    ("dynamo", "profiling", "testing", "loops"),  # built on the frontends
    ("backends",),  # exported programs run by ONNX Runtime and IREE (docs/backends.md)
    ("cli",),
    ("aotgrad",),  # the package's public face (__init__.py)
]
FORBIDDEN = (
    "torch._functorch.aot_autograd",
    "functorch.compile",
    "torch._functorch.partitioners",
    "torch._functorch._aot_autograd",
)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``src/aotgrad/capture/tracing/joint.py`` -> ``aotgrad.capture.tracing.joint``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, root: pathlib.Path, lazy: bool = True) -> Iterator[str]:
    """Every module ``path`` imports, resolved to an absolute dotted name; without ``lazy``,
    only those it imports when it is imported (not inside a function)."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in _import_nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = root.parent / f"{module}.{alias.name}".replace(".", "/")
                is_module = submodule.with_suffix(".py").exists() or submodule.is_dir()
                yield f"{module}.{alias.name}" if is_module else module


def _import_nodes(tree: ast.AST, lazy: bool) -> Iterator[ast.AST]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if lazy or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
            stack.extend(ast.iter_child_nodes(node))


def top_level(module: str) -> str:
    """``aotgrad.capture.tracing.joint`` -> ``capture``; the package itself -> ``aotgrad``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(root: pathlib.Path, layers: list[tuple[str, ...]]) -> list[str]:
    layer = {name: i for i, names in enumerate(layers) for name in names}
    found = []
    for path in sorted(root.rglob("*.py")):
        here = top_level(module_name(path, root))
        if here not in layer:
            found.append(f"{here} is in no layer: add it to LAYERS")
            continue
        for module in imports_of(path, root):
            if not module.startswith(root.name):
                continue
            there = top_level(module)
            if there != here and layer.get(there, len(layers)) >= layer[here]:
                found.append(
                    f"{path.relative_to(root)} imports {module} ({there} is not below {here})"
                )
    return sorted(set(found))


def test_the_package_is_layered():
    assert violations(SRC, LAYERS) == []


def test_every_layer_exists():
    modules = {top_level(module_name(p, SRC)) for p in SRC.rglob("*.py")}
    missing = [name for names in LAYERS for name in names if name not in modules]
    assert not missing, missing


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("signature/bad.py", "from aotgrad.capture import joint"),
        ("signature/bad.py", "from ..capture import joint"),
        ("signature/bad.py", "from aotgrad import trace"),
        ("capture/bad.py", "import aotgrad.api"),
        ("cache.py", "from . import dynamo"),
        ("newthing.py", "import torch"),
    ],
)
def test_a_planted_violation_is_found(tmp_path, where, line):
    root = tmp_path / "aotgrad"
    for package in ("signature", "capture"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "joint.py").write_text("")
    for name in ("__init__.py", "api.py", "dynamo.py", "cache.py"):
        (root / name).write_text("")
    (root / where).write_text(line + "\n")
    assert len(violations(root, LAYERS)) == 1


def test_imports_from_below_are_fine(tmp_path):
    root = tmp_path / "aotgrad"
    (root / "capture").mkdir(parents=True)
    (root / "signature").mkdir()
    for path in ("__init__.py", "capture/__init__.py", "signature/__init__.py", "errors.py"):
        (root / path).write_text("")
    (root / "capture" / "x.py").write_text(
        "from ..signature import y\nfrom aotgrad.errors import E\nfrom . import z\n"
    )
    assert violations(root, LAYERS) == []


def test_no_import_cycles():
    """Modules import each other one way, ``if TYPE_CHECKING:`` blocks included: a type two
    modules share lives below both, or one passes the other what it needs."""
    graph = nx.DiGraph()
    for path in SRC.rglob("*.py"):
        here = module_name(path, SRC)
        for module in imports_of(path, SRC, lazy=False):
            if module.startswith("aotgrad.") and module != here:
                graph.add_edge(here, module)
    assert list(nx.simple_cycles(graph)) == []


def test_no_aot_autograd_in_the_library():
    for path in SRC.rglob("*.py"):
        for module in imports_of(path, SRC):
            assert not module.startswith(FORBIDDEN), f"{path} imports {module}"
