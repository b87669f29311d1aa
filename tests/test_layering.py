"""The pipeline's dependencies point one way, and aotgrad never calls AOTAutograd."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "aotgrad"
STAGES = ["signature", "capture", "partition", "runtime"]
FORBIDDEN = (
    "torch._functorch.aot_autograd",
    "functorch.compile",
    "torch._functorch.partitioners",
    "torch._functorch._aot_autograd",
)


def imports_of(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


@pytest.mark.parametrize("stage", STAGES)
def test_stages_import_only_earlier_stages(stage):
    later = STAGES[STAGES.index(stage) + 1 :]
    banned = [f"aotgrad.{s}" for s in later] + [
        "aotgrad.report",
        "aotgrad.api",
        "aotgrad.cli",
        "aotgrad.testing",
    ]
    for path in (SRC / stage).rglob("*.py"):
        for module in imports_of(path):
            assert not module.startswith(tuple(banned)), f"{path.name} imports {module}"


def test_no_aot_autograd_in_the_library():
    for path in SRC.rglob("*.py"):
        for module in imports_of(path):
            assert not module.startswith(FORBIDDEN), f"{path} imports {module}"
