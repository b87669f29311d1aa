"""The joint graph, the contract between capture and partition."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad._torch_compat import LazyGraphModule
from aotgrad.capture.analyses.aliasing import OutputLeaf, TensorOutput
from aotgrad.capture.analyses.backward_state import StateRegion
from aotgrad.capture.analyses.dynamic import ShapeGuards
from aotgrad.capture.analyses.input_aliases import SyntheticBase
from aotgrad.capture.analyses.mutation import InputMutation
from aotgrad.capture.provenance import Phase, phase_of
from aotgrad.capture.tracing.tracers import TracerReport
from aotgrad.capture.user_state.environ import EnvironReads
from aotgrad.signature import (
    Cotangent,
    FlatInputs,
    Grad,
    GraphInputDescriptor,
    MutatedInput,
    Output,
    OutputBase,
    Signature,
    StateAtBackward,
)

# Note [Code on demand]
# ~~~~~~~~~~~~~~~~~~~~~
# An ``fx.GraphModule`` generates and ``exec``s Python source for its graph
# when it is built and on every ``recompile()``, at a cost that grows with the
# graph (bench/findings.md). A capture builds three modules (the joint, the forward, the
# backward) and, before this rule, compiled four sources no one ran: the joint
# graph is data, and ``nop`` turns the forward and backward into straight-line
# code of its own (Note [Straight-line graphs]). Graph modules aotgrad builds
# are therefore lazy (``torch.fx``'s ``_LazyGraphModule``): ``gm.code``,
# ``print(gm)`` and ``gm(*args)`` generate the source on first use, as before,
# and a user's compiler receives an ordinary GraphModule over the same graph
# (``ready_for_compiler``; ``torch.jit.script`` refuses the lazy class).


def lazy_module(
    root: torch.nn.Module, graph: fx.Graph, class_name: str = "GraphModule"
) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose code is generated on first use (Note [Code on demand])."""
    return LazyGraphModule(root, graph, class_name)


def ready_for_compiler(gm: fx.GraphModule) -> fx.GraphModule:
    """An ordinary ``GraphModule`` over ``gm``'s graph, for compilers (Note [Code on demand])."""
    return fx.GraphModule(gm, gm.graph) if isinstance(gm, LazyGraphModule) else gm


def joint_signature(
    *,
    graph_inputs: tuple[GraphInputDescriptor, ...],
    returned: tuple[Output | OutputBase | MutatedInput, ...],  # every output, then bases, mutated
    cotangents: tuple[Cotangent, ...],
    requires_grad: tuple[bool, ...],
    state_at_backward: tuple[int, ...] = (),
) -> Signature:
    """The joint graph's calling convention: nothing saved yet (Note [Calling convention]).

    A grad for every input that requires one, when there is a backward at all; then the
    inputs the backward updates (Note [State updated by the backward]).
    """
    state = [graph_inputs[i] for i in state_at_backward]
    return Signature(
        forward_inputs=graph_inputs,
        forward_outputs=returned,
        backward_inputs=(*cotangents, *(StateAtBackward(of=d) for d in state)),
        backward_outputs=(
            *(
                Grad(of=d) if needs and cotangents else None
                for d, needs in zip(graph_inputs, requires_grad, strict=True)
            ),
            *(MutatedInput(of=d) for d in state),
        ),
    )


@dataclass(frozen=True)
class JointGraph:
    """One functional aten graph computing forward outputs and gradients.

    ``gm(*primals, *cotangents) -> (*outputs, *bases, *mutated, *grads)`` with
    one grad per primal (``None`` where it needs none), as ``signature`` says
    (Note [Calling convention]). Every node's ``meta["aotgrad"]`` says whether
    it is forward or backward.
    """

    # The graph; placeholders and outputs carry descriptors.
    gm: fx.GraphModule
    # The user's call, flattened; one descriptor per user input.
    inputs: FlatInputs
    # The joint graph's calling convention, nothing saved yet (Note [Calling convention]):
    # the graph inputs, outputs, bases, mutated inputs and cotangents below are its. The
    # partitioner adds the saved values (``Signature.with_saved``).
    signature: Signature
    # The synthetic bases among the graph inputs, if any.
    input_bases: tuple[SyntheticBase, ...]
    # Per graph input: does it require grad?
    requires_grad: tuple[bool, ...]
    # Every leaf of the user's result, in pytree order.
    leaves: tuple[OutputLeaf, ...]
    # Tree structure of the user's result.
    out_spec: pytree.TreeSpec
    # Inputs the function mutated in place (Note [Input mutation]).
    mutations: tuple[InputMutation, ...]
    # Per value the autograd.Function returns (fresh outputs, bases, mutated): differentiable?
    # The signature's cotangents are those of the differentiable ones.
    differentiable: tuple[bool, ...]
    # Guards on symbolic sizes (Note [Dynamic shapes]); None for a static trace.
    guards: ShapeGuards | None = None
    # Metadata mutations of inputs a synthetic base stands for, by user input position.
    member_mutations: tuple[InputMutation, ...] = ()
    # Per graph input (with a backward): the cotangents whose outputs have an autograd path
    # to it; its gradient is None when none of them is given (Note [Gradients no output reaches]).
    reached_by: tuple[tuple[Cotangent, ...], ...] = ()
    # User input positions the function called requires_grad_() on; the runtime does the
    # same to the caller's tensors before the call (Note [requires_grad_() on an input]).
    made_to_require_grad: tuple[int, ...] = ()
    # User input positions the function detached in place (``a.detach_()``); the runtime
    # detaches the caller's tensors after the call (Note [requires_grad_() on an input]).
    detached_inputs: tuple[int, ...] = ()
    # Graph input positions the backward reads and updates, in the order of their
    # StateAtBackward placeholders and new values (Note [State updated by the backward]).
    state_at_backward: tuple[int, ...] = ()
    # Per input in state_at_backward: where its region's backward runs, which decides when
    # the runtime writes its new value.
    state_regions: tuple[StateRegion, ...] = ()
    # Which tracer made the graph, and why not the direct one (Note [Choosing a tracer]).
    tracer: TracerReport = field(kw_only=True)
    # The environment variables the user's code read at capture, with the values read;
    # None when it read none (Note [Environment read at capture]).
    environ: EnvironReads | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.signature.saved:
            raise AssertionError(
                f"expected the joint graph's signature (none saved), got {self.signature}"
            )
        state = tuple(self.graph_inputs[i] for i in self.state_at_backward)
        if state != tuple(d.of for d in self.signature.state_at_backward):
            raise AssertionError(
                f"expected the signature's state at backward {state},"
                f" got {self.signature.state_at_backward}"
            )
        if sum(self.differentiable) != len(self.cotangents):
            raise AssertionError(
                f"expected {sum(self.differentiable)} cotangents, got {len(self.cotangents)}"
            )
        if self.cotangents and len(self.reached_by) != len(self.graph_inputs):
            raise AssertionError(
                f"expected reached_by for {len(self.graph_inputs)} inputs,"
                f" got {len(self.reached_by)}"
            )
        returned = len(self.fresh_outputs) + len(self.bases) + len(self.mutated)
        if returned != len(self.differentiable):
            raise AssertionError(
                f"expected {returned} returned values, got {len(self.differentiable)}"
            )

    @property
    def tensor_outputs(self) -> tuple[TensorOutput, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, TensorOutput))

    @property
    def fresh_outputs(self) -> tuple[int, ...]:
        """Tensor-output positions the autograd.Function returns (the rest are rebuilt)."""
        unique = {o.index: o for o in self.tensor_outputs}
        return tuple(k for k, o in sorted(unique.items()) if o.alias is None)

    @property
    def mutated(self) -> tuple[int, ...]:
        """Primal positions whose data changed: their new values are forward outputs."""
        return tuple(m.index for m in self.mutations if m.data)

    @property
    def graph_inputs(self) -> tuple[GraphInputDescriptor, ...]:
        """One descriptor per graph input (primal placeholder): the user's inputs, except that
        a synthetic base replaces inputs sharing memory (Note [Aliased inputs])."""
        return self.signature.forward_inputs

    @functools.cached_property
    def outputs(self) -> tuple[Output, ...]:
        """One descriptor per tensor output of the graph."""
        return self.signature.outputs

    @functools.cached_property
    def bases(self) -> tuple[OutputBase, ...]:
        """Intermediates several outputs view (Note [Aliased outputs])."""
        values = self.signature.forward_outputs[self.signature.bases_in_forward]
        return tuple(d for d in values if isinstance(d, OutputBase))

    @functools.cached_property
    def mutated_descriptors(self) -> tuple[MutatedInput, ...]:
        values = self.signature.forward_outputs[self.signature.mutated_in_forward]
        return tuple(d for d in values if isinstance(d, MutatedInput))

    @functools.cached_property
    def cotangents(self) -> tuple[Cotangent, ...]:
        """One per cotangent placeholder, aligned with the differentiable returned values."""
        return self.signature.cotangents

    @property
    def has_backward(self) -> bool:
        return self.signature.has_backward

    def results(self) -> list[fx.Node | None]:
        """The graph's output values: ``(*outputs, *bases, *mutated, *grads)``."""
        values = self.gm.graph.output_node().args[0]
        assert isinstance(values, (list, tuple)), f"expected a list of outputs, got {values!r}"
        return [v if isinstance(v, fx.Node) else None for v in values]

    def forward_results(self) -> list[fx.Node]:
        """Outputs, bases and mutated inputs' new values (``Signature.results_in_forward``)."""
        values = self.results()[self.signature.results_in_forward]
        return [v for v in values if v is not None]

    def grad_results(self) -> list[fx.Node | None]:
        """One per primal, ``None`` where it gets none (``Signature.grads_in_joint``)."""
        return self.results()[self.signature.grads_in_joint]

    def backward_results(self) -> list[fx.Node | None]:
        """What the backward graph returns: the grads, then the new values of the inputs it
        updates (Note [State updated by the backward])."""
        return self.results()[self.signature.grads_in_joint.start :]

    def backward_nodes(self) -> list[fx.Node]:
        """Nodes the backward computes: its own ops and forward ops it re-runs."""
        phases = (Phase.BACKWARD, Phase.RECOMPUTE)
        return [n for n in self.gm.graph.nodes if n.op != "output" and phase_of(n) in phases]

    def nodes(self, phase: Phase) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op != "output" and phase_of(n) is phase]
