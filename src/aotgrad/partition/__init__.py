"""Stage 3: partition. Decide what the backward saves, and split the joint graph in two.

Entry point: :func:`partition`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch.fx as fx

from aotgrad.capture import JointGraph
from aotgrad.partition.save_all import choose_saved, users_in
from aotgrad.partition.saved import SavedValue, describe_saved, unique_bytes
from aotgrad.partition.split import apply_mutations_in_graph, build_backward, build_forward
from aotgrad.signature import Grad, MutatedInput, Saved, Signature, describe_graph

__all__ = ["Partitioned", "SavedValue", "partition"]

Strategy = Literal["save_all"]


@dataclass(frozen=True)
class Partitioned:
    """The forward and backward graphs, what passes between them, and the convention."""

    # What was split.
    joint: JointGraph
    # forward(*primals) -> (*outputs, *bases, *mutated, *saved)
    forward: fx.GraphModule
    # backward(*saved, *cotangents) -> grads; None when nothing needs a gradient.
    backward: fx.GraphModule | None
    # The values the forward hands to the backward, in order.
    saved: tuple[SavedValue, ...]
    # Descriptors of every placeholder and output of both graphs.
    signature: Signature
    # The forward graph copies new values into mutated inputs itself (inference only).
    mutations_in_graph: bool = False

    def __post_init__(self) -> None:
        if self.backward is None and self.saved:
            raise AssertionError(f"expected no saved values without a backward, got {self.saved}")
        if self.mutations_in_graph and self.backward is not None:
            raise AssertionError("expected mutations in the graph only without a backward")

    @property
    def saved_bytes(self) -> int:
        """Bytes of the storages the backward receives, each counted once (inputs included)."""
        return unique_bytes(self.saved)

    @property
    def saved_bytes_beyond_inputs(self) -> int:
        """Bytes the saved values keep alive that the caller does not hold anyway."""
        return unique_bytes([s for s in self.saved if not s.is_input])


def partition(
    joint: JointGraph,
    strategy: Strategy | Callable[[JointGraph], Partitioned] = "save_all",
    *,
    keep_input_mutations: bool = False,
) -> Partitioned:
    """Split ``joint`` into forward and backward graphs.

    With ``keep_input_mutations`` and no backward, the forward graph itself
    writes the new values into its inputs (``aten.copy_``) instead of
    returning them (Note [Mutations kept in the graph]).

    >>> import torch, aotgrad
    >>> traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
    >>> [s.name for s in traced.saved]
    ['x']
    """
    if callable(strategy):
        return strategy(joint)
    if strategy != "save_all":
        raise ValueError(f"unknown partition strategy {strategy!r}; expected 'save_all'")
    if not joint.has_backward:
        return _forward_only(joint, keep_input_mutations)
    saved_nodes, recompute, reasons = choose_saved(joint)
    backward = build_backward(joint, saved_nodes, recompute)
    saved = describe_saved(
        saved_nodes,
        [users_in_backward(n, backward) for n in saved_nodes],
        [reasons[n] for n in saved_nodes],
    )
    signature = _signature(joint, saved)
    forward = _module(
        joint,
        build_forward(joint, saved_nodes),
        signature.forward_inputs,
        signature.forward_outputs,
    )
    backward_gm = _module(joint, backward, signature.backward_inputs, signature.backward_outputs)
    return Partitioned(joint, forward, backward_gm, saved, signature)


def users_in_backward(node: fx.Node, backward: fx.Graph) -> list[str]:
    placeholder = next(n for n in backward.nodes if n.op == "placeholder" and n.name == node.name)
    return users_in(placeholder, backward.nodes)


def _forward_only(joint: JointGraph, keep_input_mutations: bool) -> Partitioned:
    graph = build_forward(joint, [])
    signature = _signature(joint, ())
    if keep_input_mutations and joint.mutated:
        apply_mutations_in_graph(joint, graph)
        kept = [d for d in signature.forward_outputs if not isinstance(d, MutatedInput)]
        signature = replace(signature, forward_outputs=tuple(kept))
    forward = _module(joint, graph, signature.forward_inputs, signature.forward_outputs)
    return Partitioned(
        joint, forward, None, (), signature, bool(keep_input_mutations and joint.mutated)
    )


def _module(
    joint: JointGraph, graph: fx.Graph, inputs: Sequence[object], outputs: Sequence[object]
) -> fx.GraphModule:
    """Describe ``graph``, then compile it once into a module sharing the joint's constants."""
    describe_graph(graph, inputs, outputs)
    return fx.GraphModule(joint.gm, graph)


def _signature(joint: JointGraph, saved: tuple[SavedValue, ...]) -> Signature:
    saved_descs = tuple(Saved(name=s.name) for s in saved)
    grads = tuple(
        Grad(of=d) if rg and joint.has_backward else None
        for d, rg in zip(joint.graph_inputs, joint.requires_grad, strict=True)
    )
    return Signature(
        forward_inputs=joint.graph_inputs,
        forward_outputs=(
            *joint.outputs,
            *joint.bases,
            *joint.mutated_descriptors,
            *saved_descs,
        ),
        backward_inputs=(*saved_descs, *joint.cotangents),
        backward_outputs=grads,
    )
