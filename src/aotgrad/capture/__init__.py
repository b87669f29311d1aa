"""Stage 2: capture. Fake tensors in, one functional joint graph of forward + backward out.

Entry point: :func:`capture`. See Note [One tracing pass] in ``joint.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotgrad.capture.aliasing import (
    Alias,
    AliasSource,
    ConstantOutput,
    OutputLeaf,
    TensorOutput,
    ViewMeta,
)
from aotgrad.capture.cotangents import split_at_cotangents
from aotgrad.capture.graph import JointGraph
from aotgrad.capture.joint import Body, TraceRecord, trace_joint
from aotgrad.capture.mutation import InputMutation
from aotgrad.capture.provenance import META_KEY, NodeInfo, Phase, node_info, phase_of, set_phase
from aotgrad.errors import UserFrame
from aotgrad.signature import (
    Cotangent,
    FlatInputs,
    Grad,
    MutatedInput,
    Output,
    OutputBase,
    describe_graph,
)

__all__ = [
    "META_KEY",
    "Alias",
    "AliasSource",
    "ConstantOutput",
    "InputMutation",
    "JointGraph",
    "NodeInfo",
    "OutputLeaf",
    "Phase",
    "TensorOutput",
    "ViewMeta",
    "capture",
    "node_info",
    "phase_of",
    "set_phase",
]


def capture(
    body: Body,
    flat: FlatInputs,
    primals: Sequence[torch.Tensor],
    *,
    with_backward: bool,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    where: UserFrame | None = None,
) -> JointGraph:
    """Trace ``body(primals)`` and, if ``with_backward``, its backward, into a :class:`JointGraph`.

    ``body`` receives the primals (lifted module state, then the user's
    tensors) as functional fake tensors and returns the user's result.
    """
    gm, record, _ = trace_joint(
        body, flat, primals, with_backward=with_backward, decompositions=decompositions, where=where
    )
    return _assemble(gm, flat, primals, record)


def _assemble(
    gm: fx.GraphModule, flat: FlatInputs, primals: Sequence[torch.Tensor], record: TraceRecord
) -> JointGraph:
    assert record.aliasing is not None and record.out_spec is not None
    split_at_cotangents(gm)
    _remove_detaches(gm.graph)
    gm.graph.eliminate_dead_code()
    outputs = _output_descriptors(record)
    bases = tuple(
        OutputBase(of=tuple(outputs[k] for k in members))
        for members in record.aliasing.base_members
    )
    fresh = [outputs[o.index] for o in record.aliasing.outputs if o.alias is None]
    mutated = [MutatedInput(of=flat.descriptors[m.index]) for m in record.mutations if m.data]
    returned: list[Output | OutputBase | MutatedInput] = [*fresh, *bases, *mutated]
    targets = [r for r, d in zip(returned, record.differentiable, strict=True) if d]
    cotangents = tuple(Cotangent(of=t) for t in targets)
    joint = JointGraph(
        gm=gm,
        inputs=flat,
        requires_grad=tuple(p.requires_grad for p in primals),
        leaves=tuple(record.leaves),
        out_spec=record.out_spec,
        outputs=tuple(outputs),
        bases=bases,
        mutations=tuple(record.mutations),
        differentiable=tuple(record.differentiable),
        cotangents=cotangents,
    )
    _name_placeholders(gm.graph, [*flat.descriptors, *cotangents])
    grads = [Grad(of=d) for d in flat.descriptors] if cotangents else []
    describe_graph(
        gm.graph,
        [*flat.descriptors, *cotangents],
        [*outputs, *bases, *joint.mutated_descriptors, *grads],
    )
    gm.recompile()
    return joint


def _output_descriptors(record: TraceRecord) -> list[Output]:
    """One Output per tensor output, named by its key path in the user's result."""
    return [
        Output(path=path)
        for path, leaf in zip(record.out_paths, record.leaves, strict=True)
        if isinstance(leaf, TensorOutput)
    ]


def _remove_detaches(graph: fx.Graph) -> None:
    """``detach`` is the identity on values; in a functional graph it only adds noise."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _name_placeholders(graph: fx.Graph, descriptors: Sequence[object]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, desc in zip(placeholders, descriptors, strict=True):
        if isinstance(desc, Cotangent):
            continue  # already cotangent_<i>
        node._rename(_identifier(str(desc)))
        node.target = node.name


def _identifier(text: str) -> str:
    """``carry['a']`` → ``carry_a``; ``param fc1.weight`` → ``fc1_weight``."""
    text = text.removeprefix("param ").removeprefix("buffer ")
    name = re.sub(r"\W+", "_", text).strip("_") or "input"
    return name if not name[0].isdigit() else f"_{name}"
