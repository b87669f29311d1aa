"""One capture attempt: the chosen tracer's trace, the passes after it, the JointGraph.

:func:`trace_joint_graph` runs the tracer ``options.tracer`` asks for (Note [Choosing a
tracer] in ``tracers.py``) over the joint function (``joint.py``), then the graph passes that
follow every trace, and assembles the graph, its signature and descriptors into a
:class:`~aotgrad.capture.graph.JointGraph`. :func:`synthetic_bases` says whether a second
attempt is needed (Note [Aliased inputs]).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch
import torch.fx as fx

from aotgrad._torch_compat import FAST_PATH_VERIFIED, TORCH_RELEASE, rename_node
from aotgrad.capture.analyses.aliasing import TensorOutput
from aotgrad.capture.analyses.backward_state import (
    StateRegion,
    read_state_at_backward,
    state_regions,
)
from aotgrad.capture.analyses.collectives import describe_collectives
from aotgrad.capture.analyses.input_aliases import (
    SyntheticBase,
    overlapping_groups,
    separate,
    synthetic_base,
)
from aotgrad.capture.analyses.reachability import computed_from
from aotgrad.capture.analyses.recompute import link_recompute
from aotgrad.capture.graph import JointGraph, joint_signature
from aotgrad.capture.provenance import node_info, set_info
from aotgrad.capture.tracing.cotangents import split_at_cotangents
from aotgrad.capture.tracing.fast import DirectTracer
from aotgrad.capture.tracing.full import FullTracer, refuse_untraceable
from aotgrad.capture.tracing.joint import Body, TraceOptions, trace_joint
from aotgrad.capture.tracing.recorder import Recorder, stamp
from aotgrad.capture.tracing.state import GraphInputs, TraceRecord
from aotgrad.capture.tracing.tracers import (
    Tracer,
    TracerReport,
    refuses_autograd_grad,
    trace_with,
)
from aotgrad.errors import UnsupportedMutationError, UserFrame, format_error
from aotgrad.ops.table import remove_dead_code
from aotgrad.signature import (
    Buffer,
    Cotangent,
    Descriptor,
    FlatInputs,
    Inner,
    Input,
    MultiOutputView,
    MutatedInput,
    Output,
    OutputBase,
    Param,
    Signature,
    describe_graph,
)
from aotgrad.signature.printing import placeholder_name

_Traced = tuple[fx.GraphModule, TraceRecord, GraphInputs, Recorder]


def fast_path(fast: bool) -> bool:
    """``fast``, on a torch release the suite verified the fast path on only (Note [Behaviour
    by torch release])."""
    return fast and TORCH_RELEASE in FAST_PATH_VERIFIED


def trace_joint_graph(
    body: Body,
    flat: FlatInputs,
    primals: Sequence[torch.Tensor],
    bases: Sequence[SyntheticBase],
    options: TraceOptions,
    new_recorder: Callable[[], Recorder],
) -> JointGraph:
    def attempt(tracer: Tracer) -> _Traced:
        gm, record, inputs = trace_joint(body, flat, primals, options, bases=bases, tracer=tracer)
        return gm, record, inputs, tracer.recorder

    def full(leaf_primals: bool) -> _Traced:
        refuse_untraceable(primals, flat.descriptors, options.where)
        symbolic = bool(options.dynamic_dims)
        tracer = FullTracer(
            new_recorder(), options.decompositions, symbolic=symbolic, leaf_primals=leaf_primals
        )
        return attempt(tracer)

    (gm, record, inputs, recorder), report = trace_with(
        options.tracer,
        why_not_direct=_why_not_direct(options, bases, primals, flat),
        direct=lambda: attempt(DirectTracer(new_recorder(), options.decompositions)),
        full=lambda: _full_trace(full),
        where=options.where,
    )
    split_at_cotangents(gm)
    stamp(gm, recorder)
    _remove_detaches(gm.graph)  # before matching: a checkpoint recomputes from detached inputs
    describe_collectives(gm)  # op, group, shape of each collective (Note [Collectives])
    link_recompute(gm)
    if record.state_at_backward:  # Note [State updated by the backward]
        read_state_at_backward(gm, record.state_at_backward, _after_forward(gm, record))
    joint = _assemble(gm, flat, inputs, bases, record, report)
    _name_owners(gm.graph, inputs.descriptors, frozenset(recorder.module_names.values()))
    return joint


def _after_forward(gm: fx.GraphModule, record: TraceRecord) -> list[fx.Node]:
    """Per input the backward updates: its value after the forward (the forward's new value,
    or the placeholder when the forward left it alone)."""
    results = list(gm.graph.output_node().args[0])  # type: ignore[arg-type]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mutated = [m.index for m in record.mutations if m.data]
    forward = len(results) - len(record.reached_by) - len(record.state_at_backward)
    new_values = results[forward - len(mutated) : forward]  # (*outputs, *bases, *mutated)
    by_input = dict(zip(mutated, new_values, strict=True))
    return [by_input.get(i, placeholders[i]) for i in record.state_at_backward]


def _why_not_direct(
    options: TraceOptions,
    bases: Sequence[SyntheticBase],
    primals: Sequence[torch.Tensor],
    flat: FlatInputs,
) -> str | None:
    """Why the direct trace cannot even be tried (Note [Direct tracing]); None when it can."""
    if flat.subclasses is not None:  # its mode would see the subclass, not its inner tensors
        return "tensor subclass inputs (Note [Tensor subclasses])"
    if options.dynamic_dims:
        return "dynamic shapes (it records static sizes only)"
    if bases or overlapping_groups(primals):
        return "inputs share memory (only functionalization tells which one a view comes from)"
    if not options.fast and TORCH_RELEASE not in FAST_PATH_VERIFIED:
        return f"the fast path is not verified on torch {torch.__version__}, so it is off"
    if not options.fast:
        return "the fast path is off (Note [The fast path as a layer])"
    return None


def _full_trace(full: Callable[[bool], _Traced]) -> _Traced:
    """The full trace, again with leaf primals if a reentrant checkpoint refuses autograd.grad."""
    try:
        return full(False)
    except RuntimeError as e:  # Note [Reentrant checkpoints]
        if not refuses_autograd_grad(e):
            raise
    return full(True)


# Note [Reentrant checkpoints]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``checkpoint(..., use_reentrant=True)`` runs its own ``autograd.backward``
# inside the backward and refuses ``autograd.grad`` from outside. Capture
# differentiates with ``autograd.grad`` on the inputs' gradient edges (Note
# [Input mutation]); when a reentrant checkpoint refuses that, the full trace
# runs again with the inputs as autograd leaves and ``.backward()``, reading
# each input's ``.grad`` (the direct trace stops there: Note [Direct
# tracing]). The backward runs before the body's context closes (``Body``),
# so a region that reaches a module's parameters through ``self`` re-runs on
# the lifted ones and their ``.grad`` is the graph's; so does a closed-over
# module's, through the closed-over swap (Note [The swap spans the
# backward]). A real tensor's ``.grad`` written by that backward anyway is
# put back and refused. The region's forward ops then appear once in the forward
# and again, as recompute, in the backward, as for the non-reentrant flavour:
#
#     forward:   sin, mm, cos, mm, sigmoid           saves: a, w
#     backward:  sin, mm, cos, mm, sigmoid (recompute), sigmoid_backward, ...


def synthetic_bases(
    joint: JointGraph, primals: Sequence[torch.Tensor], where: UserFrame | None
) -> list[SyntheticBase]:
    """Bases for groups of memory-sharing inputs of which one's data is mutated.

    A metadata mutation (``a.t_()``) changes no value another input sees: no base.
    """
    mutated = {m.index for m in joint.mutations if m.data}
    restrided = {m.index for m in joint.mutations if m.metadata is not None}
    bases = []
    for group in overlapping_groups(primals):
        if not mutated.intersection(group):
            continue
        if separate(primals, group) and not restrided.intersection(group):
            continue  # Note [Inputs sharing memory without a common base]
        base = synthetic_base(primals, group)
        if base is None:
            names = ", ".join(str(joint.inputs.descriptors[i]) for i in group)
            raise UnsupportedMutationError(
                format_error(
                    f"inputs {names} share memory without a common base, the function"
                    " mutates one of them, and one requires grad: one base's gradient would"
                    " sum theirs over the shared elements"
                    " (Note [Inputs sharing memory without a common base])",
                    where,
                    "Pass views of one tensor (x and x[1:]), or clone the inputs before the call.",
                )
            )
        bases.append(base)
    return bases


def _assemble(
    gm: fx.GraphModule,
    flat: FlatInputs,
    inputs: GraphInputs,
    input_bases: Sequence[SyntheticBase],
    record: TraceRecord,
    report: TracerReport,
) -> JointGraph:
    assert record.aliasing is not None and record.out_spec is not None
    remove_dead_code(gm.graph)
    outputs = _output_descriptors(record)
    bases = tuple(
        OutputBase(of=tuple(outputs[k] for k in members))
        for members in record.aliasing.base_members
    )
    fresh = [outputs[o.index] for o in record.aliasing.outputs if o.alias is None]
    mutated = [
        MutatedInput(of=inputs.descriptors[m.index], storage=m.storage is not None)
        for m in record.mutations
        if m.data
    ]
    returned: list[Output | OutputBase | MutatedInput] = [*fresh, *bases, *mutated]
    targets = [r for r, d in zip(returned, record.differentiable, strict=True) if d]
    cotangents = tuple(Cotangent(of=t) for t in targets)
    requires_grad = tuple(info.requires_grad for info in inputs.infos)
    signature = joint_signature(
        graph_inputs=inputs.descriptors,
        returned=(*outputs, *bases, *mutated),
        cotangents=cotangents,
        requires_grad=requires_grad,
        state_at_backward=tuple(record.state_at_backward),
    )
    joint = JointGraph(
        gm=gm,
        inputs=flat,
        signature=signature,
        input_bases=tuple(input_bases),
        requires_grad=requires_grad,
        leaves=tuple(record.leaves),
        out_spec=record.out_spec,
        mutations=tuple(record.mutations),
        differentiable=tuple(record.differentiable),
        guards=record.guards,
        member_mutations=tuple(record.member_mutations),
        reached_by=_reached_by(gm.graph, record, signature),
        made_to_require_grad=tuple(record.made_to_require_grad),
        detached_inputs=tuple(record.detached_inputs),
        state_at_backward=tuple(record.state_at_backward),
        state_regions=_state_regions(gm.graph, signature, record),
        tracer=report,
    )
    placeholders = [*signature.forward_inputs, *signature.backward_inputs]
    _name_placeholders(gm.graph, placeholders)
    grads = signature.backward_outputs if signature.has_backward else ()  # (*results, *grads)
    describe_graph(gm.graph, placeholders, [*signature.forward_outputs, *grads])
    gm.recompile()
    return joint


def _reached_by(
    graph: fx.Graph, record: TraceRecord, signature: Signature
) -> tuple[tuple[Cotangent, ...], ...]:
    """Per graph input, the cotangents that reach it (Note [Gradients no output reaches])."""
    cotangents = signature.cotangents
    if not cotangents:
        return ()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    results = list(graph.output_node().args[0])  # type: ignore[arg-type]
    grads = results[signature.grads_in_joint]
    computed = computed_from(graph, placeholders[signature.cotangents_in_joint], grads)
    return tuple(
        tuple(c for j, c in enumerate(cotangents) if (path | data) >> j & 1)
        for path, data in zip(record.reached_by, computed, strict=True)
    )


def _state_regions(
    graph: fx.Graph, signature: Signature, record: TraceRecord
) -> tuple[StateRegion, ...]:
    """Per input the backward updates, its region's backward (Note [State updated by the
    backward])."""
    if not signature.state_at_backward:
        return ()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    results = list(graph.output_node().args[0])  # type: ignore[arg-type]
    grads = results[signature.grads_in_joint]
    new_state = results[signature.new_state_in_joint]
    cotangents = placeholders[signature.cotangents_in_joint]
    sites, saved = record.state_sites, record.state_saved
    return tuple(state_regions(graph, cotangents, new_state, grads, sites, saved))


def _output_descriptors(record: TraceRecord) -> list[Output]:
    """One Output per tensor output, named by its key path in the user's result; then one
    SideEffect per tensor stored in the user's objects (Note [Side effects replayed])."""
    user = zip(record.out_paths, record.leaves[: len(record.out_paths)], strict=True)
    outputs = [_output(path, leaf) for path, leaf in user if isinstance(leaf, TensorOutput)]
    return [*outputs, *record.effects]


def _output(path: str, leaf: TensorOutput) -> Output:
    """The descriptor of one tensor output; it names a multi-output view (Note [Multi-output
    views] in ``capture/analyses/aliasing.py``)."""
    if leaf.alias is not None and leaf.alias.multi_output_view:
        return MultiOutputView(path=path)
    return Output(path=path)


_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _remove_detaches(graph: fx.Graph) -> None:
    """``detach`` (and ``alias``) is the identity on values; in a functional graph it only adds
    noise. (From torch 2.14 the full trace records a ``detach`` as ``alias``.)"""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _IDENTITIES:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _name_placeholders(graph: fx.Graph, descriptors: Sequence[Descriptor]) -> None:
    """Name each placeholder after its descriptor; a parameter belongs to its module."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, desc in zip(placeholders, descriptors, strict=True):
        if isinstance(desc, Cotangent):
            continue  # already cotangent_<i>
        rename_node(node, placeholder_name(desc))
        node.target = node.name


def _name_owners(
    graph: fx.Graph, descriptors: Sequence[Descriptor], modules: Collection[str]
) -> None:
    """A lifted tensor's placeholder belongs to the module holding it (``net.0`` for
    ``global net.0.weight``), when that is one of ``modules`` (Note [Module paths as the
    signature names them]); the others keep the function's name."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, desc in zip(placeholders, descriptors, strict=False):  # the cotangents follow
        lifted = desc.of if isinstance(desc, Inner) else desc  # Note [Tensor subclasses]
        name = lifted.path if isinstance(lifted, Input) else getattr(lifted, "name", "")
        owner = name.rpartition(".")[0]
        if owner and (owner in modules or isinstance(lifted, Param | Buffer)):
            set_info(node, replace(node_info(node), module=owner))


__all__ = ["fast_path", "synthetic_bases", "trace_joint_graph"]
