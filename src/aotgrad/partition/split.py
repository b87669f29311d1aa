"""Split a joint graph into a forward and a backward graph, given what is saved."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of, set_phase


def build_forward(joint: JointGraph, saved: Sequence[fx.Node]) -> fx.Graph:
    """``forward(*primals) -> (*outputs, *bases, *mutated, *saved)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.gm.graph.nodes:
        if node.op != "output" and phase_of(node) is Phase.FORWARD:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in (*joint.forward_results(), *saved)))
    graph.eliminate_dead_code()
    return graph


def build_backward(
    joint: JointGraph, saved: Sequence[fx.Node], recompute: set[fx.Node]
) -> fx.Graph:
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
        elif node.op in ("call_function", "get_attr") and phase_of(node) is Phase.BACKWARD:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[g] if g is not None else None for g in joint.grad_results()))
    graph.eliminate_dead_code()
    return graph
