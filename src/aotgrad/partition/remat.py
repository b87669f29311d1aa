"""Choosing what the backward saves and what it recomputes: min-cut and an exact budget solver.

Note [Saved and recomputed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward reads some forward values (``needed``). A partition picks a
``saved`` set; everything else the backward needs is recomputed from it,
walking back through forward ops until saved values or inputs::

    forward:  a = mm(x, w); b = relu(a); c = sin(b); out = mm(c, w2)
    needed by the backward: b (for relu's grad), c (for mm's grad), w, w2
    save_all: save b, c                     (recompute nothing)
    mincut:   save b; recompute c = sin(b)  (c costs as many bytes as b;
              saving one pointwise input beats saving both)
    budget(0.5): the same if it fits, chosen by an integer program that
              minimizes recompute FLOPs within the byte budget

Inputs are always available to the backward: min-cut saves one at no cost
(the caller holds it anyway), while a budget counts the bytes of every input
a plan saves (Note [Budget units]). Views are never saved (their base is, and
the view is replayed on it); random ops are never recomputed (the backward
must see the forward's draws), nor are collectives (Note [Collectives]).
Bytes are counted as Note [Counting bytes] says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.ops.table import cheap_to_recompute, draws_random, flops, is_collective, is_free_view
from aotgrad.partition.sizes import hint, hinted_bytes

INF = math.inf


@dataclass
class RematPlan:
    """What the backward receives (``saved``, in forward order) and what it re-runs."""

    saved: list[fx.Node]
    recompute: set[fx.Node]
    # Why each saved node is saved, and why each recomputed node is recomputed.
    save_reasons: dict[fx.Node, str] = field(default_factory=dict)
    recompute_reasons: dict[fx.Node, str] = field(default_factory=dict)
    # Anything the solver wants the user to know (a time limit hit, say).
    note: str | None = None
    # Re-run each recomputed op just before its first use in the backward (the default), or
    # all of them first (Note [Recompute just before use] in ``partition/split.py``).
    recompute_late: bool = True


def needed_by_backward(joint: JointGraph) -> dict[fx.Node, str]:
    """Forward values the backward reads, each with the first backward node reading it."""
    needed: dict[fx.Node, str] = {}
    for node in joint.backward_nodes():
        for source in node.all_input_nodes:
            if phase_of(source) is Phase.FORWARD:
                needed.setdefault(source, f"read by backward op {node.name}")
    for grad in joint.backward_results():  # grads, and new state (rarely a forward value)
        if grad is not None and phase_of(grad) is Phase.FORWARD:
            needed.setdefault(grad, "is a gradient")
    return needed


def never_recomputed(node: fx.Node) -> bool:
    """An op that draws from the RNG (the backward must see the forward's draws; attention
    without dropout draws nothing) or a collective (every rank must run the same ones, once:
    Note [Collectives]): saved, whatever the strategy."""
    if node.op != "call_function":
        return False
    return draws_random(node.target, node.args, node.kwargs) or is_collective(node.target)


def is_tensor_node(node: fx.Node) -> bool:
    """Produces one tensor (multi-output ops are saved through their ``getitem`` nodes)."""
    return isinstance(node.meta.get("val"), torch.Tensor)


def is_size_node(node: fx.Node) -> bool:
    """A symbolic size (dynamic shapes): saved as a Python int, at no cost in bytes."""
    return isinstance(node.meta.get("val"), torch.SymInt)


def node_flops(node: fx.Node) -> int:
    """The op's FLOPs (``ops.table.flops``), at the example sizes under dynamic shapes (Note
    [Weights at the example sizes])."""
    args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
    return hint(flops(node.target, args, node.meta.get("val")))


def is_view_node(node: fx.Node) -> bool:
    """A view op (``t``, ``split``) or an element of a multi-output view: no storage of its own."""
    if node.op != "call_function":
        return False
    if is_free_view(node.target) or getattr(node.target, "is_view", False):
        return True
    source = node.args[0] if node.args else None
    return (
        node.target.__name__ == "getitem"  # type: ignore[union-attr]
        and isinstance(source, fx.Node)
        and getattr(source.target, "is_view", False)
    )


def recompute_closure(
    needed: Iterable[fx.Node], saved: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """Everything to re-run so the backward has ``needed`` from ``saved``; plus what else to
    save: the inputs and collectives the re-run reads."""
    recompute: set[fx.Node] = set()
    inputs: set[fx.Node] = set()
    stack = [n for n in needed if n not in saved]
    while stack:
        node = stack.pop()
        if node in recompute or node in saved or node in inputs:
            continue
        if node.op == "placeholder" or never_recomputed(node):
            inputs.add(node)  # saved: an input, or a collective (Note [Collectives])
            continue
        recompute.add(node)
        stack.extend(node.all_input_nodes)
    return recompute, inputs


def reads_mutated_input(joint: JointGraph) -> set[fx.Node]:
    """Forward ops that depend on an input the function mutates: never recomputed.

    The runtime writes the new value into the caller's tensor after the
    forward, so the backward no longer has the old one to recompute from.
    """
    placeholders = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    tainted = {placeholders[i] for i in joint.mutated}
    for node in joint.gm.graph.nodes:
        if node.op == "call_function" and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    return tainted


def forward_ops(joint: JointGraph) -> list[fx.Node]:
    return [n for n in joint.nodes(Phase.FORWARD) if n.op == "call_function"]


def mincut_saved(joint: JointGraph, needed: Iterable[fx.Node]) -> set[fx.Node]:
    """Min-cut over a graph whose edge weights are tensor bytes (Note [Saved and recomputed]).

    Each forward op is an edge ``in → out`` weighing its output's bytes
    (infinite for views: their base is saved instead). Ops that must not be
    recomputed hang off the source; what the backward reads hangs off the
    sink. The cheapest cut is the set of values to save.
    """
    import networkx as nx  # loaded by the first min-cut, not by ``import aotgrad``

    graph = nx.DiGraph()
    pinned = reads_mutated_input(joint)
    for node in forward_ops(joint):
        recomputable = (
            node not in pinned
            and not never_recomputed(node)
            and (cheap_to_recompute(node.target) or is_view_node(node))
        )
        # Views are replayed rather than saved, unless they cannot be recomputed.
        savable = is_tensor_node(node) and (not is_view_node(node) or not recomputable)
        capacity = hinted_bytes([node]) if savable else INF  # Note [Weights at the example sizes]
        if is_size_node(node):
            capacity = 0  # a size (dynamic shapes): the backward gets it as a Python int
        graph.add_edge((node, "in"), (node, "out"), capacity=capacity)
        if not recomputable:
            graph.add_edge("source", (node, "in"), capacity=INF)
        for source in node.all_input_nodes:
            if source.op == "call_function":
                graph.add_edge((source, "out"), (node, "in"), capacity=INF)
    for node in needed:
        if node.op == "call_function":
            graph.add_edge((node, "out"), "sink", capacity=INF)
    if "sink" not in graph or "source" not in graph:
        return {n for n in needed if n.op == "call_function" and not is_view_node(n)}
    _, (source_side, _) = nx.minimum_cut(graph, "source", "sink")
    return {
        node
        for node in forward_ops(joint)
        if (node, "in") in source_side and (node, "out") not in source_side
    }
