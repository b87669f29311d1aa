"""Checks of the forward and backward graphs partition hands to the runtime (Note [Stage checks]).

Entry point: :func:`check_partitioned`.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.fx as fx

from aotgrad.capture.analyses.collectives import runs_collective
from aotgrad.capture.checks import check_graph, fail
from aotgrad.partition import Partitioned
from aotgrad.partition.saved import storages, unique_bytes


def _fail(node: str, invariant: str, expected: str, got: str) -> NoReturn:
    fail("partition", node, invariant, expected, got)


def check_partitioned(partitioned: Partitioned) -> None:
    """Raise :class:`InvariantError` where ``partitioned`` breaks an invariant (Note [Stage checks]).

    >>> import torch, aotgrad
    >>> x = torch.ones(2, requires_grad=True)
    >>> check_partitioned(aotgrad.trace(lambda x: x.sin(), x).partitioned)
    """
    signature, forward, backward = partitioned.signature, partitioned.forward, partitioned.backward
    stage = "partition"
    check_graph(
        stage, "forward graph", forward, signature.forward_inputs, signature.forward_outputs
    )
    if backward is not None:
        inputs, outputs = signature.backward_inputs, signature.backward_outputs
        check_graph(stage, "backward graph", backward, inputs, outputs)
    _check_saved(partitioned)
    _check_collectives(partitioned)
    _check_bytes(partitioned)


def _check_saved(partitioned: Partitioned) -> None:
    signature, saved = partitioned.signature, partitioned.saved
    names = [s.name for s in saved]
    described = [d.name for d in signature.saved]
    if described != names:
        _fail("signature", "saved", f"the saved values {names}", str(described))
    returned = _results(partitioned.forward)[signature.saved_in_forward]
    got = [v.name if isinstance(v, fx.Node) else repr(v) for v in returned]
    if got != names:
        _fail(
            "forward graph, output node output",
            "saved",
            f"the saved values {names} as the last forward outputs",
            str(got),
        )
    if partitioned.backward is None:
        return
    placeholders = [n for n in partitioned.backward.graph.nodes if n.op == "placeholder"]
    got = [n.name for n in placeholders[signature.saved_in_backward]]
    if got != names:
        _fail(
            "backward graph, placeholders",
            "saved",
            f"the saved values {names} as the first backward inputs",
            str(got),
        )


def _check_collectives(partitioned: Partitioned) -> None:
    joint = [n.name for n in partitioned.joint.gm.graph.nodes if runs_collective(n)]
    order = {name: i for i, name in enumerate(joint)}
    previous: tuple[int, str] | None = None
    for name, graph in (("forward", partitioned.forward), ("backward", partitioned.backward)):
        if graph is None:
            continue
        for node in graph.graph.nodes:
            if not runs_collective(node):
                continue
            where = f"{name} graph, node {node.name}"
            if node.name not in order:
                _fail(where, "collectives", f"one of the joint's collectives {joint}", "a new one")
            position = order[node.name]
            if previous is not None and position <= previous[0]:
                _fail(
                    where,
                    "collectives",
                    f"the joint's collectives once each in its order {joint}",
                    f"{node.name} after {previous[1]}",
                )
            previous = (position, node.name)


def _check_bytes(partitioned: Partitioned) -> None:
    returned = _results(partitioned.forward)[partitioned.signature.saved_in_forward]
    nodes = [v for v in returned if isinstance(v, fx.Node)]
    for value, node in zip(partitioned.saved, nodes, strict=True):
        if value.is_size:
            continue
        nbytes = sum(storages(node).values())
        if _known(value.nbytes) and _known(nbytes) and value.nbytes != nbytes:
            _fail(
                f"saved value {value.name}",
                "bytes",
                f"nbytes {nbytes} (its storage)",
                str(value.nbytes),
            )
    total, expected = partitioned.saved_bytes, unique_bytes(nodes)
    if _known(total) and _known(expected) and total != expected:
        _fail(
            "saved values",
            "bytes",
            f"saved_bytes {expected} (the saved nodes' distinct storages)",
            str(total),
        )


def _known(n: object) -> bool:
    """A plain int: symbolic sizes are compared by no check (it would add a guard)."""
    return isinstance(n, int) and not isinstance(n, torch.SymInt)


def _results(gm: fx.GraphModule) -> list[object]:
    values = gm.graph.output_node().args[0]
    return list(values) if isinstance(values, list | tuple) else [values]
