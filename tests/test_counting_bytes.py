"""One byte-counting rule (Note [Counting bytes]): storages, each once, in every report and budget."""

from __future__ import annotations

import torch
import torch.fx as fx

import aotgrad
from aotgrad.partition.saved import unique_bytes
from aotgrad.report.saved_report import format_bytes, memory_report


def f(x, w):
    return ((x @ w.t()) * w.sum()).sin().sum()


def view_input_trace(partition="save_all"):
    """``x`` is a slice of a larger tensor: saving it keeps more than its own elements."""
    x = torch.randn(64, 64)[:4, :8]
    w = torch.randn(8, 8, requires_grad=True)
    return aotgrad.trace(f, x, w, partition=partition)


def test_a_saved_view_costs_its_storage():
    traced = view_input_trace()
    (x,) = (s for s in traced.saved if s.name == "x")
    assert x.nbytes > 4 * 8 * 4  # more than its 32 elements
    assert traced.partitioned.saved_bytes == sum(s.nbytes for s in traced.saved)


def test_saved_values_and_their_nodes_count_alike():
    partitioned = view_input_trace("mincut").partitioned
    nodes = {n.name: n for n in partitioned.forward.graph.nodes}
    saved_nodes = [nodes[s.name] for s in partitioned.saved]
    assert unique_bytes(saved_nodes) == unique_bytes(partitioned.saved) == partitioned.saved_bytes


def test_a_full_budget_is_exactly_save_all():
    # Note [Budget units]: the fraction 1 is save_all's saved_bytes; counting elements
    # (x's 128 bytes instead of its storage) made the cap smaller than save_all's plan.
    traced = view_input_trace()
    assert aotgrad.budget(1.0).bytes_for(traced.partitioned.joint) == traced.partitioned.saved_bytes


def test_the_report_totals_the_same_count():
    traced = view_input_trace()
    total = memory_report(traced.saved).splitlines()[-1]
    assert total.startswith(f"total: {format_bytes(traced.partitioned.saved_bytes)} in")


def test_views_of_one_storage_count_once():
    graph = fx.Graph()
    base, view, pair = (graph.placeholder(name) for name in ("base", "view", "pair"))
    w = torch.empty(8, 8)
    base.meta["val"], view.meta["val"] = w, w.t()
    pair.meta["val"] = (w[0], torch.empty(3))  # a multi-output op: each storage once
    assert unique_bytes([view]) == unique_bytes([base, view]) == 256
    assert unique_bytes([base, view, pair]) == 256 + 12
