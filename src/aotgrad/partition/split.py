"""Split a joint graph into a forward and a backward graph, given what is saved."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of, set_phase
from aotgrad.optable import remove_dead_code


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
    joint: JointGraph, saved: Sequence[fx.Node], recompute: set[fx.Node]
) -> tuple[fx.Graph, list[fx.Node]]:
    """``backward(*saved, *cotangents) -> grads``, each op of ``recompute`` run just before
    the first backward op that reads it (Note [Recompute just before use]).

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
    backward = set(joint.backward_nodes())
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    for node in joint.gm.graph.nodes:
        if node in backward and node.op != "placeholder":
            _recompute_for(node.all_input_nodes, recompute, order, graph, env)
            env[node] = graph.node_copy(node, env.__getitem__)
    grads = joint.grad_results()
    _recompute_for([g for g in grads if g is not None], recompute, order, graph, env)
    graph.output(tuple(env[g] if g is not None else None for g in grads))
    remove_dead_code(graph)
    return graph, placeholders


# Note [Recompute just before use]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A recomputed forward op runs in the backward right before the first backward
# op that reads it, its own recomputed inputs before it, not all at the
# backward's start: a recomputed activation then lives from that op to its
# last use, not through the whole backward. Two blocks, both recomputed:
#
#     at the start:       relu_0 = relu(mm_0); relu_1 = relu(mm_1)
#                         grads of block 1 (reads relu_1) ... grads of block 0 (reads relu_0)
#                         -> relu_0 and relu_1 live together, with block 1's gradients
#     just before use:    relu_1 = relu(mm_1); grads of block 1
#                         relu_0 = relu(mm_0); grads of block 0
#                         -> relu_1 is freed before relu_0 exists
#
# The values and the ops run are the same; only the peak changes, and it is
# what ``Partitioned.peak`` predicts (Note [What a step holds] in ``memory.py``).
def _recompute_for(
    needed: Sequence[fx.Node],
    recompute: set[fx.Node],
    order: dict[fx.Node, int],
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
) -> None:
    """Copy the recomputed ops ``needed`` reads, and theirs, that are not in ``graph`` yet."""
    missing: set[fx.Node] = set()
    stack = [n for n in needed if n in recompute and n not in env]
    while stack:
        node = stack.pop()
        if node not in missing:
            missing.add(node)
            stack += [s for s in node.all_input_nodes if s in recompute and s not in env]
    for node in sorted(missing, key=order.__getitem__):  # joint order: inputs first
        env[node] = graph.node_copy(node, env.__getitem__)
        set_phase(env[node], Phase.RECOMPUTE)


def apply_mutations_in_graph(joint: JointGraph, graph: fx.Graph) -> None:
    """Note [Mutations kept in the graph]: ``copy_`` each new value into its input, in place.

    For backends that want the mutation (an inference graph that updates a
    KV cache, say)::

        forward(cache, x):  new = aten.index_put(cache, ...)
                            copy_ = aten.copy_(cache, new)     # kept in the graph
                            return (out,)                     # no "new value of cache"
    """
    output = graph.output_node()
    values = list(output.args[0])  # type: ignore[arg-type]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mutated = joint.signature.mutated_in_forward
    with graph.inserting_before(output):
        for index, new in zip(joint.mutated, values[mutated], strict=True):
            graph.call_function(torch.ops.aten.copy_.default, (placeholders[index], new))
    del values[mutated]
    output.args = (tuple(values),)
