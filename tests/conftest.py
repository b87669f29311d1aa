"""Shared helpers: clone inputs, run eager and compiled, compare everything."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from aotgrad.settings import switch
from aotgrad.store import disk


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The disk cache on, in a directory of this test's own (the suite turns it off), with
    its warnings not yet given."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(directory))
    monkeypatch.setattr(disk, "_warned", set())
    return directory


@pytest.fixture
def one_rank_mesh():
    """A 1-D cpu DeviceMesh over a one-rank gloo group in this process (see
    ``multiproc.one_rank_group``)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is missing")
    from torch.distributed.device_mesh import DeviceMesh

    from multiproc import one_rank_group

    with one_rank_group():
        yield DeviceMesh("cpu", [0])


# Doctests that show the direct tracer's report (the tracer that made the graphs).
_FAST_DOCTESTS = ("aotgrad.api.Traced.tracer", "aotgrad.api.Traced.fallback_reason")


def pytest_collection_modifyitems(config, items):
    """Under ``AOTGRAD_FAST=0``, tests of the fast path itself (``fast_path``) are skipped."""
    if switch("AOTGRAD_FAST", True):
        return
    skip = pytest.mark.skip(reason="tests the fast path, which AOTGRAD_FAST=0 leaves off")
    for item in items:
        if item.get_closest_marker("fast_path") is not None or item.name in _FAST_DOCTESTS:
            item.add_marker(skip)


def clone_inputs(tree):
    """Fresh leaf copies with the same values, strides and requires_grad."""

    def clone(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out = leaf.detach().clone(memory_format=torch.preserve_format)
        return out.requires_grad_(leaf.requires_grad)

    return pytree.tree_map(clone, tree)


def tensor_leaves(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
