"""Split a joint graph into a forward and a backward graph, given what is saved."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.capture.provenance import set_phase
from aotgrad.ops.table import remove_dead_code


def build_forward(joint: JointGraph, saved: Sequence[fx.Node]) -> fx.Graph:
    """``forward(*primals) -> (*outputs, *bases, *mutated, *saved)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.gm.graph.nodes:
        if node.op != "output" and phase_of(node) is Phase.FORWARD:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in (*joint.forward_results(), *saved)))
    remove_dead_code(graph)
    return graph


def build_backward(
    joint: JointGraph,
    saved: Sequence[fx.Node],
    recompute: set[fx.Node],
    *,
    recompute_late: bool = True,
) -> tuple[fx.Graph, list[fx.Node]]:
    """``backward(*saved, *cotangents, *state) -> (*grads, *new state)`` (Note [State updated
    by the backward]), each op of ``recompute`` run just before
    the first backward op that needs it (``recompute_late``, the default), or all of them first
    (Note [Recompute just before use]).

    Also returns the backward's placeholder for each saved value, in order: a
    saved value keeps its forward name (``LayerNorm_weight`` stays as it is;
    ``fx`` would snake-case a name it derives itself), but callers hold the node.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in saved:
        env[node] = graph.create_node("placeholder", node.name, name=node.name)
        env[node].meta.update(node.meta)
    placeholders = [env[node] for node in saved]
    for node in joint.gm.graph.nodes:
        if node.op == "placeholder" and phase_of(node) is Phase.BACKWARD:
            env[node] = graph.node_copy(node)
    for node in backward_order(joint, recompute, recompute_late=recompute_late):
        env[node] = graph.node_copy(node, env.__getitem__)
        if node in recompute:
            set_phase(env[node], Phase.RECOMPUTE)
    graph.output(tuple(env[g] if g is not None else None for g in joint.backward_results()))
    remove_dead_code(graph)
    return graph, placeholders


def backward_order(
    joint: JointGraph,
    recompute: set[fx.Node],
    *,
    recompute_late: bool = True,
    backward_ops: frozenset[fx.Node] | None = None,
) -> list[fx.Node]:
    """The joint's nodes the backward graph runs, in its order (before dead code is removed):
    the recomputed ones and the backward's own ops, ``backward_ops`` when the caller has them
    (Note [Recompute just before use])."""
    if backward_ops is None:
        backward_ops = frozenset(n for n in joint.backward_nodes() if n.op != "placeholder")
    order = [n for n in joint.gm.graph.nodes if n in recompute or n in backward_ops]
    return _late_order(order, recompute) if recompute_late else order


# Note [Recompute just before use]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The joint graph holds the forward before the backward, so a backward built in
# its order re-runs every recomputed op before its first backward op: the
# recomputed values are live together with everything saved, and recomputing
# lowers the saved bytes but not the peak. ``recompute_late`` moves each
# recomputed op to just before the first backward op that needs it, directly or
# through other recomputed ops (its deadline); ties keep the joint's order, which
# is topological. Two layers ``relu(x @ w1) @ w2``, then ``relu(h @ w1) @ w2``,
# each relu output 64 KB, saving the second relu (``relu_1``) and recomputing the
# first from ``x``:
#
#     joint order:  mm = mm(x, w1); relu = relu(mm)          <- relu and relu_1 both live
#                   layer 2's grads (read relu_1, then free it); layer 1's grads (read relu)
#     late order:   layer 2's grads (read relu_1, then free it)
#                   mm = mm(x, w1); relu = relu(mm)          <- relu_1 is gone
#                   layer 1's grads (read relu)
#
# (the step's peak: 282632 -> 229384 bytes, the ``aotgrad.budget`` doctest). The
# values are the same in any topological order (recomputed ops are functional,
# never random, never collectives, never read a mutated input); only lifetimes
# change. Every strategy recomputes late (``RematPlan.recompute_late``). Late
# is not always lower: a small value recomputed early from a large saved one
# frees the large one sooner. So a peak budget tries both orders and its plan
# says which it chose (Note [Peak budgets] in ``partition/peak_budget.py``).
def _late_order(order: Sequence[fx.Node], recompute: set[fx.Node]) -> list[fx.Node]:
    """``order`` with each recomputed node moved to just before its first non-recomputed user."""
    index = {n: i for i, n in enumerate(order)}
    deadline: dict[fx.Node, float] = {}
    for node in reversed(order):  # users come later: their deadlines are known
        if node in recompute:
            users = [deadline[u] if u in recompute else index[u] for u in node.users if u in index]
            deadline[node] = min(users, default=float("inf"))

    def key(node: fx.Node) -> tuple[float, int, int]:
        if node in recompute:
            return (deadline[node], 0, index[node])
        return (index[node], 1, index[node])

    return sorted(order, key=key)


def apply_mutations_in_graph(joint: JointGraph, graph: fx.Graph) -> None:
    """Note [Mutations kept in the graph]: ``copy_`` each new value into its input, in place.

    For backends that want the mutation (an inference graph that updates a
    KV cache, say)::

        forward(cache, x):  new = aten.index_put(cache, ...)
                            copy_ = aten.copy_(cache, new)     # kept in the graph
                            return (out,)                     # no "new value of cache"

    Only data mutations are written so. An input whose size or strides changed
    too keeps its new value among the outputs, and the runtime restrides the
    input *before* copying it in: the new value has the new layout. Copied into
    the input in the graph, it would land in the old one::

        def f(a):          # a: 2x3, not requiring grad
            a.t_()         # a: 3x2, strides (1, 3)
            a[0].mul_(2)   # new value: 3x2; copy_(a, new) into the 2x3 input
            return a       # fails, or, for a square a, writes the transpose
    """
    output = graph.output_node()
    values = list(output.args[0])  # type: ignore[arg-type]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mutated = joint.signature.mutated_in_forward
    data = [m for m in joint.mutations if m.data]
    written = [k for k, m in enumerate(data) if m.written_in_graph]
    new_values = values[mutated]
    with graph.inserting_before(output):
        for k in written:
            copy = (placeholders[data[k].index], new_values[k])
            graph.call_function(torch.ops.aten.copy_.default, copy)
    kept = [v for k, v in enumerate(new_values) if k not in written]
    values[mutated] = kept
    output.args = (tuple(values),)
