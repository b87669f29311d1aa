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

Every strategy counts the bytes of the inputs a plan saves, as
``Partitioned.saved_bytes`` does (Note [Min-cut weights], Note [Budget
units]). Views are never saved (their base is, and the view is replayed on
it); random ops are never recomputed (the backward must see the forward's
draws), nor are collectives (Note [Collectives]), nor a value a selective
checkpoint tags ``MUST_SAVE`` (Note [Selective checkpoint policies]). Bytes
are counted as Note [Counting bytes] says.

Note [Min-cut weights]
~~~~~~~~~~~~~~~~~~~~~~
``mincut`` saves the fewest bytes from which the backward can recompute what
it reads. Each forward input and op is an edge ``in -> out`` weighing its
output's bytes; inputs, and ops it may not recompute, hang off the source;
what the backward reads hangs off the sink. A cut is a saved set. It may
recompute what PyTorch's min-cut may (``cheap_in_mincut``): views,
deterministic pointwise ops, dtype copies, and reductions that shrink their
input at most 4x (``x * x.sum(-1, keepdim=True)`` for ``x`` of shape (64, 2):
the sum is recomputed from ``x``, which the backward reads anyway); matmuls,
convolutions, attention and larger reductions are saved::

    f(x) = x.cos().cos().cos(),  x of 1000 floats
    the backward reads x, cos, cos_1 (each cos's gradient reads its input)
    save x:              4,000 B; recompute cos = cos(x), cos_1 = cos(cos)
    save x, cos, cos_1: 12,000 B

An input weighs its bytes like any saved value, though the caller holds it
anyway: ``saved_bytes`` counts it. Free, and outside the graph, inputs made
the second plan above (no source: nothing to cut, so everything the backward
reads was saved) and made ``x[:10].exp()`` recomputed from all of ``x``
(4,000 B) rather than saved (40 B). An input the backward reads is cut in
every plan, so recomputing from it costs nothing more.

Among the cuts of fewest bytes, the one nearest the sink recomputes least
(its recomputed ops are among every other's): for ``b = relu(mm(x, w))``
read by the backward, saving ``b`` and saving the mm weigh the same, and ``b``
is saved. networkx's cut is that one: on the sink's side it puts only what
still reaches the sink through unsaturated edges of the maximal flow.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.ops.table import (
    cheap_to_recompute,
    draws_random,
    flops,
    is_collective,
    is_free_view,
    is_reduction,
)
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
    """Saved, whatever the strategy: :func:`why_never_recomputed` has a reason."""
    return why_never_recomputed(node) is not None


def why_never_recomputed(node: fx.Node) -> str | None:
    """Why no strategy may recompute this forward op, or None: an op that draws from the RNG
    (the backward must see the forward's draws; attention without dropout draws nothing), a
    collective (every rank must run the same ones, once: Note [Collectives]), or a value a
    selective checkpoint tags ``MUST_SAVE`` (Note [Selective checkpoint policies]). An element
    of a multi-output op is saved when its op is.
    """
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return why_never_recomputed(node.args[0])
    if node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
        return "a selective checkpoint policy says MUST_SAVE"
    if draws_random(node.target, node.args, node.kwargs):
        return "a random op is never recomputed: the backward must see the forward's draws"
    if is_collective(node.target):
        return "a collective is never recomputed (Note [Collectives])"
    return None


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
    """Forward ops that read a tensor the function mutates (its old value, its new value, or a
    view of either): never recomputed (Note [Reading a mutated input])."""
    placeholders = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    new_values = joint.results()[joint.signature.mutated_in_forward]
    aliases = {placeholders[i] for i in joint.mutated} | {n for n in new_values if n is not None}
    readers = set(aliases)
    for node in joint.gm.graph.nodes:
        if node.op == "call_function" and any(a in aliases for a in node.all_input_nodes):
            readers.add(node)
            if is_view_node(node):
                aliases.add(node)
    return readers


# Note [Reading a mutated input]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The runtime writes a mutated input's new value into the caller's tensor
# after the forward, so the backward no longer has the old value: an op that
# reads the input, its new value or a view of either (what the user's code
# reads as that tensor) is never recomputed. The values such an op computes
# are the forward's own, and what reads them is recomputed like any op:
#
#     bn = _native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, ...)
#     out = bn[0]; r = relu(out); s = hardsigmoid(conv(r)); y = r * s
#     running_mean and running_var are mutated (their new values: bn[3], bn[4])
#     never recomputed: bn; recomputed when min-cut finds it cheaper: r, s
#
#     buf.add_(1); y = buf.cos()   ->   add = add(buf, 1); cos = cos(add)
#     add is buf's new value: add and cos are never recomputed
#
# Every op downstream of a BatchNorm was once held to the same rule: min-cut
# then saved MobileNetV3's hardsigmoid outputs beside the convolutions they
# are recomputed from, 18 KB more than PyTorch's min-cut.


def forward_ops(joint: JointGraph) -> list[fx.Node]:
    return [n for n in joint.nodes(Phase.FORWARD) if n.op == "call_function"]


def forward_inputs(joint: JointGraph) -> list[fx.Node]:
    """The forward's placeholders (the cotangents are the backward's)."""
    return [
        n for n in joint.gm.graph.nodes if n.op == "placeholder" and phase_of(n) is Phase.FORWARD
    ]


def mincut_saved(joint: JointGraph, needed: Iterable[fx.Node]) -> set[fx.Node]:
    """The saved set of fewest bytes, inputs included, from which the backward recomputes the
    rest of what it reads; among those, the one that recomputes least (Note [Min-cut
    weights])."""
    import networkx as nx  # loaded by the first min-cut, not by ``import aotgrad``

    # The sink's side holds what still reaches the sink once the flow is maximal: the cut
    # nearest the sink (Note [Min-cut weights]).
    _, (source_side, _) = nx.minimum_cut(_flow_graph(joint, needed), "source", "sink")
    return {
        node
        for node in (*forward_inputs(joint), *forward_ops(joint))
        if (node, "in") in source_side and (node, "out") not in source_side
    }


def _flow_graph(joint: JointGraph, needed: Iterable[fx.Node]) -> Any:
    """Each forward value is an edge ``in -> out`` weighing its bytes; a saved set is a cut
    between the source (inputs, ops not to recompute) and the sink (what the backward reads)."""
    import networkx as nx

    graph = nx.DiGraph()
    pinned = reads_mutated_input(joint)
    for node in forward_inputs(joint):
        graph.add_edge("source", (node, "in"), capacity=INF)
        graph.add_edge((node, "in"), (node, "out"), capacity=_capacity(node, savable=True))
    for node in forward_ops(joint):
        recomputable = node not in pinned and cheap_in_mincut(node)
        # Views are replayed rather than saved, unless they cannot be recomputed.
        savable = is_tensor_node(node) and (not is_view_node(node) or not recomputable)
        graph.add_edge((node, "in"), (node, "out"), capacity=_capacity(node, savable))
        if not recomputable:
            graph.add_edge("source", (node, "in"), capacity=INF)
        for source in node.all_input_nodes:
            if source.op in ("call_function", "placeholder"):
                graph.add_edge((source, "out"), (node, "in"), capacity=INF)
    for node in needed:
        if node.op in ("call_function", "placeholder"):
            graph.add_edge((node, "out"), "sink", capacity=INF)
    graph.add_nodes_from(("source", "sink"))  # a backward that reads no forward value
    return graph


# A reduction shrinking its input more than this many times is saved, not recomputed: its
# output is small, and recomputing it keeps its input (Note [Min-cut weights]).
REDUCTION_SHRINK = 4


def cheap_in_mincut(node: fx.Node) -> bool:
    """May min-cut recompute this forward op? Views, deterministic pointwise ops, copies
    (``ops.table.cheap_to_recompute``) and reductions shrinking their input little; never what
    :func:`why_never_recomputed` saves."""
    if never_recomputed(node):
        return False
    if cheap_to_recompute(node.target) or is_view_node(node):
        return True
    if not (is_reduction(node.target) and is_tensor_node(node)):
        return False
    inputs = [a for a in node.all_input_nodes if is_tensor_node(a)]
    return REDUCTION_SHRINK * hinted_bytes([node]) >= hinted_bytes(inputs)


def _capacity(node: fx.Node, savable: bool) -> float:
    """The bytes of saving ``node`` (Note [Weights at the example sizes]); a size costs none."""
    if is_size_node(node):
        return 0  # a size (dynamic shapes): the backward gets it as a Python int
    return hinted_bytes([node]) if savable else INF
