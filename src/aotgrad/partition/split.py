"""Split a joint graph into a forward and a backward graph, given what is saved."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.capture.provenance import set_phase


def build_forward(joint: JointGraph, saved: Sequence[fx.Node]) -> fx.GraphModule:
    """``forward(*primals) -> (*outputs, *bases, *mutated, *saved)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.gm.graph.nodes:
        if node.op != "output" and phase_of(node) is Phase.FORWARD:
            env[node] = graph.node_copy(node, env.__getitem__)
    num_forward = len(joint.outputs) + len(joint.bases) + len(joint.mutated)
    outputs = joint.gm.graph.output_node().args[0][:num_forward]  # type: ignore[index]
    graph.output(tuple(env[n] for n in (*outputs, *saved)))
    graph.eliminate_dead_code()
    return fx.GraphModule(joint.gm, graph)


def build_backward(
    joint: JointGraph, saved: Sequence[fx.Node], recompute: set[fx.Node]
) -> fx.GraphModule:
    """``backward(*saved, *cotangents) -> grads``, recomputing ``recompute`` first."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in saved:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    for node in joint.gm.graph.nodes:
        if node.op == "placeholder" and phase_of(node) is Phase.BACKWARD:
            env[node] = graph.node_copy(node)
    for node in joint.gm.graph.nodes:
        if node in recompute:
            env[node] = graph.node_copy(node, env.__getitem__)
            set_phase(env[node], Phase.RECOMPUTE)
        elif node.op == "call_function" and phase_of(node) is Phase.BACKWARD:
            env[node] = graph.node_copy(node, env.__getitem__)
    num_forward = len(joint.outputs) + len(joint.bases) + len(joint.mutated)
    grads = joint.gm.graph.output_node().args[0][num_forward:]  # type: ignore[index]
    graph.output(tuple(env[g] if g is not None else None for g in grads))
    graph.eliminate_dead_code()
    return fx.GraphModule(joint.gm, graph)
