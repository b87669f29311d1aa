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
    """``backward(*saved, *cotangents) -> grads``, recomputing ``recompute`` first.

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
    for node in joint.gm.graph.nodes:
        if node in recompute:
            env[node] = graph.node_copy(node, env.__getitem__)
            set_phase(env[node], Phase.RECOMPUTE)
        elif node in backward and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[g] if g is not None else None for g in joint.grad_results()))
    remove_dead_code(graph)
    return graph, placeholders


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
