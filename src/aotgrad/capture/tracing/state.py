"""What one trace holds: its graph inputs, what it learns (``TraceRecord``), and the state
one run of the joint function shares between its steps and the tracer (``TraceState``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import GradientEdge

from aotgrad.capture.analyses.aliasing import OutputAliasing, OutputLeaf, ViewMeta
from aotgrad.capture.analyses.backward_state import BackwardSite
from aotgrad.capture.analyses.dynamic import ShapeGuards
from aotgrad.capture.analyses.input_aliases import SyntheticBase, graph_inputs, input_sources
from aotgrad.capture.analyses.mutation import InputMutation, PrimalInfo
from aotgrad.errors import UserFrame
from aotgrad.signature import FlatInputs, GraphInputDescriptor, InputBase
from aotgrad.signature.descriptors import SideEffect


@dataclass
class TraceRecord:
    """What the joint function learns about the user's function while it is traced."""

    # Every leaf of the user's result, in pytree order.
    leaves: list[OutputLeaf] = field(default_factory=list)
    out_spec: pytree.TreeSpec | None = None
    # Key path of every leaf of the user's result: "[0]['a']".
    out_paths: list[str] = field(default_factory=list)
    # The tensors the function stored in the user's objects, described; they follow the
    # result's tensors among the outputs (Note [Side effects replayed]).
    effects: list[SideEffect] = field(default_factory=list)
    aliasing: OutputAliasing | None = None
    mutations: list[InputMutation] = field(default_factory=list)
    # Metadata mutations of inputs re-derived from a synthetic base, by user input position.
    member_mutations: list[InputMutation] = field(default_factory=list)
    # Per value the autograd.Function returns: does it get a cotangent?
    differentiable: list[bool] = field(default_factory=list)
    grad_inputs: list[int] = field(default_factory=list)
    # User input positions the function made require grad (Note [requires_grad_() on an input]).
    made_to_require_grad: list[int] = field(default_factory=list)
    # User input positions the function detached in place (``a.detach_()``).
    detached_inputs: list[int] = field(default_factory=list)
    # Per graph input: bit ``j`` set when cotangent ``j``'s output has an autograd path to it
    # (Note [Gradients no output reaches]).
    reached_by: list[int] = field(default_factory=list)
    # Symbolic sizes and their guards (Note [Dynamic shapes]); None for static traces.
    guards: ShapeGuards | None = None
    # Real tensors requiring grad the function closes over (lifted as inputs): a reentrant
    # checkpoint's backward must not write their ``.grad`` (``_real_grads_untouched``, a
    # safety net: the closed-over swap spans the backward).
    closed_over_leaves: list[torch.Tensor] = field(default_factory=list)
    # Graph input positions whose data the backward changed (a checkpointed BatchNorm's
    # running statistics): their values after it follow the grads
    # (Note [State updated by the backward]).
    state_at_backward: list[int] = field(default_factory=list)
    # Per input in state_at_backward: what changed it in the backward (None: not known).
    state_sites: list[BackwardSite | None] = field(default_factory=list)
    # Per input in state_at_backward: an autograd node saved it (eager checks its version).
    state_saved: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class GraphInputs:
    """The forward graph's inputs, and how the user's inputs derive from them."""

    # One descriptor per graph input.
    descriptors: tuple[GraphInputDescriptor, ...]
    # One per graph input.
    infos: tuple[PrimalInfo, ...]
    # Per user input: the graph input it comes from and its view of it (None: it is it).
    sources: tuple[tuple[int, ViewMeta | None], ...]

    @staticmethod
    def of(
        flat: FlatInputs, primals: Sequence[torch.Tensor], bases: Sequence[SyntheticBase]
    ) -> tuple[GraphInputs, list[torch.Tensor]]:
        tensors = graph_inputs(primals, bases)
        sources = tuple(input_sources(primals, bases))
        descriptors: list[GraphInputDescriptor] = []
        infos = list(PrimalInfo.of_all(tensors))
        base_at = {b.members[0]: b for b in bases}
        for i, (j, _) in enumerate(sources):
            if j < len(descriptors):
                continue
            base = base_at.get(i)
            if base is None:
                descriptors.append(flat.descriptors[i])
                continue
            descriptors.append(InputBase(of=tuple(flat.descriptors[m] for m in base.members)))
            root = primals[base.anchor]._base
            root = primals[base.anchor] if root is None else root
            infos[j] = PrimalInfo(root.is_leaf, root.requires_grad, None)
        return GraphInputs(tuple(descriptors), tuple(infos), sources), tensors


@dataclass(frozen=True)
class TraceState:
    """One run of the joint function, from the moment its primals exist: what its steps (and
    the tracer's ``input_mutations`` and ``backward_checked``) read (Note [One tracing pass]).

    ``needs_grad`` and ``edges`` change once, for inputs the function made require grad
    (Note [requires_grad_() on an input]); ``record`` fills in as the run goes.
    """

    # The graph's inputs, and how the user's inputs derive from them.
    inputs: GraphInputs
    # What the run learns about the function.
    record: TraceRecord
    # The fakes the tracer ran the joint function on, one per graph input.
    fakes: Sequence[torch.Tensor]
    # What the function sees for each graph input (``Tracer.graph_primals``).
    graph_primals: Sequence[torch.Tensor]
    # Per graph primal, its ``grad_fn`` before the body ran: tells mutations autograd saw.
    grad_fns: Sequence[object]
    # Per graph primal: does it need a gradient (read before any in-place op)?
    needs_grad: list[bool]
    # Per graph primal: what ``autograd.grad`` differentiates with respect to.
    edges: list[GradientEdge | torch.Tensor | None]
    # The user's inputs as the function gets them: graph primals, or views of a synthetic
    # base (Note [Aliased inputs]).
    primals: Sequence[torch.Tensor]
    # The user's function, for error messages.
    where: UserFrame | None


__all__ = ["GraphInputs", "TraceRecord", "TraceState"]
