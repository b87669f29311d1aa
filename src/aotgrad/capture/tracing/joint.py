"""Trace forward and backward together, in one pass, on fake tensors.

Note [One tracing pass]
~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's AOTAutograd runs the user's function several times before it has a
joint graph (a metadata pass, then the joint trace). aotgrad learns the
metadata in the same pass that records the graph. Under a tracer (Note [Two
tracers]: the direct one or the full ``make_fx`` one), over fake tensors, the
joint function:

1. gets the tracer's graph primals (the fakes, or functional wrappers of
   them) and calls the user's function;
2. reads what the metadata pass would have told it off the live results:
   which outputs alias inputs or each other (``analyze_aliasing``), which
   inputs were mutated (the tracer's ``input_mutations``), which outputs
   require grad;
3. syncs every forward value, then creates one cotangent per differentiable
   output the runtime's ``autograd.Function`` will return (Note [Cotangents
   discovered during the trace]) and calls ``torch.autograd.grad``.

Everything the tracer records before the first cotangent is forward, the
rest is backward. The trace never reads tensor data: inputs are fake. Under
``tracer="auto"`` a function the direct trace stops on runs a second time,
under the full trace (Note [Choosing a tracer]); each pass is complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    DisableTorchFunction,
    FakeTensorMode,
    compiling_flag,
    engine_run_backward,
    set_compiling_flag,
)
from aotgrad.capture.analyses.aliasing import (
    ConstantOutput,
    ViewMeta,
    analyze_aliasing,
    check_custom_views_of_mutated,
    check_input_aliases_are_views,
)
from aotgrad.capture.analyses.autocast import autocast_off
from aotgrad.capture.analyses.backward_state import saved_by_nodes, site_of
from aotgrad.capture.analyses.collectives import collective_grads_checked
from aotgrad.capture.analyses.dynamic import ShapeGuards, symbolic_context
from aotgrad.capture.analyses.input_aliases import SyntheticBase
from aotgrad.capture.analyses.mutation import (
    InputMutation,
    check_member_mutations,
    member_metadata_mutations,
)
from aotgrad.capture.analyses.reachability import reaching_masks
from aotgrad.capture.analyses.requires_grad import check_views_of_made_inputs, made_to_require_grad
from aotgrad.capture.analyses.set_storage import check_set_outputs
from aotgrad.capture.analyses.subclass_inputs import StandIns, subclass_input_changes
from aotgrad.capture.tracing.cotangents import make_cotangent
from aotgrad.capture.tracing.fake import EagerViewsFakeMode
from aotgrad.capture.tracing.fast import FastFakeMode
from aotgrad.capture.tracing.recorder import Recorder, autograd_nodes
from aotgrad.capture.tracing.rng import generator_restored, rng_stand_ins
from aotgrad.capture.tracing.state import GraphInputs, TraceRecord, TraceState
from aotgrad.capture.tracing.trace_errors import check_output_leaf, translate_trace_errors
from aotgrad.capture.tracing.tracers import Tracer, TracerChoice
from aotgrad.capture.user_state.closed_over import ClosedOver
from aotgrad.capture.user_state.side_effects import Watch
from aotgrad.errors import (
    UnsupportedOpError,
    UnsupportedOutputError,
    UnsupportedSideEffectError,
    UserFrame,
    format_error,
)
from aotgrad.signature import FlatInputs
from aotgrad.signature.descriptors import Closure, Global, Input
from aotgrad.signature.objects import SharedObjectError, objects_as_nodes
from aotgrad.signature.subclasses import check_plain_grads
from aotgrad.signature.views import check_views_still_usable

# Runs the user's function on the primals; the result is the context's value. Capture
# differentiates before leaving the context (Note [Reentrant checkpoints]).
Body = Callable[[list[torch.Tensor]], AbstractContextManager[Any]]


def fake_primals(
    mode: FakeTensorMode,
    primals: Sequence[torch.Tensor],
    dynamic_dims: Mapping[int, Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """Fake leaves with the primals' metadata and ``requires_grad``; no data is read.

    ``dynamic_dims`` (by ``id`` of the primal) gives dimensions symbolic sizes
    (Note [Dynamic shapes]).
    """
    fakes: dict[int, torch.Tensor] = {}
    for p in primals:
        if id(p) in fakes:
            continue
        # With a ShapeEnv, a tensor without a context would get a symbol for every
        # dimension: parameters and unmarked dimensions stay static only if told.
        dims = dynamic_dims.get(id(p), ()) if dynamic_dims else None
        context = None if dims is None else symbolic_context(p, dims)
        fake = mode.from_tensor(p.detach(), symbolic_context=context)
        fakes[id(p)] = fake.requires_grad_(p.requires_grad)
    return [fakes[id(p)] for p in primals]


@dataclass(frozen=True)
class TraceOptions:
    """How to trace, the same for every attempt of one capture."""

    # Trace the backward too (grad mode on and some input requires grad).
    with_backward: bool
    # Decomposition table the tracer applies as ops run.
    decompositions: Mapping[Any, Callable[..., Any]] | None
    # The user's function, for error messages.
    where: UserFrame | None
    # Per primal ``id``: dimensions with symbolic sizes (Note [Dynamic shapes]).
    dynamic_dims: Mapping[int, Sequence[int]] | None
    # Which tracer to use (Note [Choosing a tracer]).
    tracer: TracerChoice = "auto"
    # The fast path on (Note [The fast path as a layer]); off: the full trace in the stock mode.
    fast: bool = True
    # Watches the user's objects for traced tensors stored in them (Note [Side effects
    # replayed]); None: nothing to watch.
    effects: Watch | None = None


def trace_joint(
    body: Body,
    flat: FlatInputs,
    primals: Sequence[torch.Tensor],
    options: TraceOptions,
    *,
    bases: Sequence[SyntheticBase],
    tracer: Tracer,
) -> tuple[fx.GraphModule, TraceRecord, GraphInputs]:
    """Trace ``body`` and its backward into one graph with ``tracer``; see Note [One tracing pass].

    A :class:`~aotgrad.capture.tracing.fast.DirectTracer` raises
    :class:`~aotgrad.capture.tracing.tracers.NeedsFullTrace` for what it does not handle.
    """
    dynamic_dims = options.dynamic_dims
    shape_env = _shape_env() if dynamic_dims else None
    fake_mode = FastFakeMode if options.fast else EagerViewsFakeMode
    mode = fake_mode(allow_non_fake_inputs=True, shape_env=shape_env)
    inputs, tensors = GraphInputs.of(flat, primals, bases)
    fakes = fake_primals(mode, tensors, dynamic_dims)
    record = TraceRecord()
    record.closed_over_leaves = [  # closed over, or a module argument's (Note [Module arguments])
        p
        for i, (p, d) in enumerate(zip(primals, flat.descriptors, strict=True))
        if p.requires_grad
        and (isinstance(d, Closure | Global) or (i < flat.num_lifted and isinstance(d, Input)))
    ]
    if shape_env is not None:
        record.guards = ShapeGuards(shape_env, fakes, names=[str(d) for d in inputs.descriptors])

    attempt = _Attempt(body, flat, primals, options, tracer, inputs, record)

    def joint(*inner: torch.Tensor) -> list[torch.Tensor | None]:
        return _joint(attempt, inner)

    with (
        translate_trace_errors(body, options.where),
        compiling(),
        rng_stand_ins(),
        generator_restored(),
        mode,
    ):
        gm = tracer.run(joint, fakes)
    return gm, record, inputs


def _shape_env() -> Any:
    """A fresh ``ShapeEnv``: symbolic_shapes (and sympy) load only when a capture has symbols."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv()


# Note [Capture is compiling]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Library code asks whether it is being traced before it branches on tensor
# values: transformers' mask helpers skip ``if padding_mask.all():`` when
# ``torch.compiler.is_compiling()`` is true or the tensor is a ``FakeTensor``.
# The direct trace hands the function fake tensors, the full trace functional
# wrappers of them, which such checks do not recognise::
#
#     direct trace:  is_tracing(mask) -> True  (FakeTensor)   -> no branch
#     full trace:    is_tracing(mask) -> False (FunctionalTensor) -> mask.all():
#                    DataDependentError
#
# So capture says what it is, as ``torch.compile`` and ``torch.export`` do
# around their traces: ``torch.compiler.is_compiling()`` is true while either
# trace runs, and both take the same, traceable, branch.


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true inside (Note [Capture is compiling])."""
    was = compiling_flag()
    set_compiling_flag(True)
    try:
        yield
    finally:
        set_compiling_flag(was)


@dataclass(frozen=True)
class _Attempt:
    """What every run of the joint function of one attempt shares (``trace_joint``'s)."""

    body: Body
    flat: FlatInputs
    # The caller's primals: real tensors (or the caller's fakes), one per user input.
    real: Sequence[torch.Tensor]
    options: TraceOptions
    tracer: Tracer
    inputs: GraphInputs
    record: TraceRecord


def _joint(attempt: _Attempt, inner: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    tracer, options = attempt.tracer, attempt.options
    inputs, record, where = attempt.inputs, attempt.record, options.where
    dispatch_mode = tracer.dispatch_mode()
    with dispatch_mode:
        graph_primals = tracer.graph_primals(inner, inputs.infos)
    edges = [tracer.differentiate_at(p) for p in graph_primals]
    grad_fns = [p.grad_fn for p in graph_primals]  # to tell mutations autograd saw
    needs_grad = [p.requires_grad for p in graph_primals]  # before any in-place op
    with dispatch_mode:
        primals = _user_primals(graph_primals, inputs.sources, attempt.real)
        state = TraceState(
            inputs=inputs,
            record=record,
            fakes=inner,
            graph_primals=graph_primals,
            grad_fns=grad_fns,
            needs_grad=needs_grad,
            edges=edges,
            primals=primals,
            where=where,
        )
        member_grad_fns = [p.grad_fn for p in primals]
        closed_over = ClosedOver(attempt.real, primals, where)  # Note [Real tensors in a trace]
        # The backward runs inside the body's context: it may re-run the body's code. The
        # closed-over swap covers the user's code and, swapping only, the backward (Note
        # [The swap spans the backward]).
        with contextlib.ExitStack() as stack:
            if options.effects is not None:  # Note [Side effects replayed]
                stack.enter_context(options.effects.watching())
            with closed_over:
                result = stack.enter_context(attempt.body(primals))
            stored: list[torch.Tensor] = []
            if options.effects is not None:
                record.effects, stored = options.effects.stored(primals)
            _note_grad_changes(state, tracer)
            record.member_mutations = member_metadata_mutations(
                primals, member_grad_fns, inputs.sources
            )
            record.mutations = tracer.input_mutations(state)
            stand_ins: StandIns = {}
            if attempt.flat.subclasses is not None:  # Note [Subclass inputs changed in place]
                record.mutations, stand_ins = subclass_input_changes(
                    attempt.flat.subclasses,
                    record.mutations,
                    inputs.sources,
                    graph_primals,
                    attempt.flat.descriptors,
                    tracer.recorder.mutation_sites,
                    where,
                )
            forward, returned = _forward_values(state, tracer, result, stored)
            check_set_outputs(  # Note [set_() on an input]
                forward, record.mutations, graph_primals, primals, inputs.descriptors, where
            )
            if stand_ins:
                forward = _with_stand_ins(forward, record.mutations, stand_ins)
                returned = _with_stand_ins(returned, record.mutations, stand_ins)
                tracer.sync(forward)
            # Each value as it is now: a backward that mutates an input again must not
            # change the forward's new value of it (Note [State updated by the backward]).
            forward_values = [tracer.unwrap(v) for v in forward]
            check_member_mutations(record.member_mutations, record.mutations, primals, where)
            check_views_of_made_inputs(
                record.leaves,
                record.made_to_require_grad,
                inputs.sources,
                inputs.descriptors,
                where,
            )
            record.grad_inputs = [
                i
                for i, (needs, info) in enumerate(zip(needs_grad, inputs.infos, strict=True))
                if needs and info.duplicate_of is None
            ]
            check_no_leaf_outputs(returned, [*primals, *graph_primals], where)
            record.differentiable = _differentiable(returned, record, options.with_backward, where)
            grads: list[torch.Tensor | None] = []
            new_state: list[torch.Tensor] = []
            if any(record.differentiable):
                grads = _backward(state, tracer, returned, closed_over)
                new_state = [graph_primals[i] for i in record.state_at_backward]
                tracer.sync(new_state)  # Note [State updated by the backward]
    return [*forward_values, *(tracer.unwrap(v) for v in (*grads, *new_state))]


def _note_grad_changes(state: TraceState, tracer: Tracer) -> None:
    """After the body: inputs it detached (``a.detach_()``) or made require grad."""
    inputs, record, needs_grad = state.inputs, state.record, state.needs_grad
    record.detached_inputs = [
        k
        for k, (p, (j, _)) in enumerate(zip(state.primals, inputs.sources, strict=True))
        if needs_grad[j] and not p.requires_grad  # a.detach_()
    ]
    record.made_to_require_grad = made_to_require_grad(
        state.primals, needs_grad, inputs.sources, inputs.descriptors, state.where
    )
    for i in dict.fromkeys(inputs.sources[k][0] for k in record.made_to_require_grad):
        needs_grad[i] = True  # Note [requires_grad_() on an input]
        state.edges[i] = tracer.differentiate_at(state.graph_primals[i])


def check_no_leaf_outputs(
    returned: Sequence[torch.Tensor], primals: Sequence[torch.Tensor], where: UserFrame | None
) -> None:
    """Refuse an output the function made a leaf that requires grad (Note [Leaf outputs])."""
    inputs = {id(p) for p in primals}
    if any(t.requires_grad and t.grad_fn is None and id(t) not in inputs for t in returned):
        raise UnsupportedOutputError(
            format_error(
                "an output is a tensor the function made require grad itself"
                " (t.requires_grad_() on a value it computed, nn.Parameter(...)): eager returns a"
                " leaf whose .grad the caller reads, a compiled function returns its output"
                " computed from the inputs (not a leaf: its .grad would stay None)",
                where,
                "Return the value without requires_grad_() and make it require grad outside the"
                " compiled function, or pass that tensor in as an input that requires grad.",
            )
        )


# Note [Leaf outputs]
# ~~~~~~~~~~~~~~~~~~~
# Every tensor a compiled function returns comes out of its autograd.Function:
# a non-leaf whose gradient flows to the inputs. Eager can return a leaf that
# requires grad, one the function made itself::
#
#     def fn(x, w):              # w requires grad, x does not
#         v = x * 2              # no grad_fn: x does not require grad
#         v.requires_grad_(True) # v: a leaf; eager's caller reads v.grad after backward
#         return v
#
# The compiled output would be a non-leaf with v.grad None after backward,
# silently; so capture refuses it (with no input requiring grad,
# ``_differentiable`` refuses any differentiable output already).


def _differentiable(
    returned: Sequence[torch.Tensor],
    record: TraceRecord,
    with_backward: bool,
    where: UserFrame | None,
) -> list[bool]:
    """Per returned value (outputs, then mutated inputs' new values): does it get a cotangent?"""
    backward = (with_backward or bool(record.made_to_require_grad)) and bool(record.grad_inputs)
    new_values = [m.requires_grad for m in record.mutations if m.data]
    outputs = returned[: len(returned) - len(new_values)]
    if not backward and any(_is_differentiable(t) for t in outputs):
        raise UnsupportedOutputError(
            format_error(
                "an output requires grad, but no input does: its gradient would flow into a"
                " tensor the function made require grad itself (t.requires_grad_(),"
                " nn.Parameter(...)), which a compiled function cannot hold",
                where,
                "Pass that tensor as an input that requires grad, or detach the output.",
            )
        )
    differentiable = [backward and _is_differentiable(t) for t in outputs]
    return differentiable + [backward and g for g in new_values]  # Note [Input mutation]


def _forward_values(
    state: TraceState, tracer: Tracer, result: Any, stored: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Analyze the result (after the input mutations); return the forward graph's outputs and
    what the Function returns.

    Forward outputs: ``(*tensor outputs, *bases, *new values)``; the Function
    returns the fresh outputs, the bases and the new values. All are synced,
    so no forward op is recorded after the first cotangent.
    """
    record, where, graph_primals = state.record, state.where, state.graph_primals
    leaves, tensors = _flatten_result(result, stored, record, where, tracer.traced)
    check_views_still_usable(tensors, where)
    aliasing, bases = analyze_aliasing(tensors, state.primals, graph_primals, state.fakes)
    record.aliasing = aliasing
    record.leaves = [aliasing.outputs[x] if isinstance(x, int) else x for x in leaves]
    mutated = [graph_primals[m.index] for m in record.mutations if m.data]
    check_custom_views_of_mutated(tensors, mutated, where)
    check_input_aliases_are_views(tensors, aliasing, where)
    forward = [*tensors, *bases, *mutated]
    tracer.sync(forward)
    fresh = [tensors[o.index] for o in aliasing.outputs if o.alias is None]
    return forward, [*fresh, *bases, *mutated]


def _with_stand_ins(
    returned: list[torch.Tensor], mutations: Sequence[InputMutation], stand_ins: StandIns
) -> list[torch.Tensor]:
    """``returned`` with the new values of subclass inputs' inner tensors taken through the
    subclass's history (Note [Subclass inputs changed in place]): the same values, the
    gradients eager gives the caller's tensor."""
    written = [m.index for m in mutations if m.data]
    head = returned[: len(returned) - len(written)]
    tail = returned[len(head) :]
    return head + [stand_ins.get(i, t) for i, t in zip(written, tail, strict=True)]


def _user_primals(
    graph_primals: Sequence[torch.Tensor],
    sources: Sequence[tuple[int, ViewMeta | None]],
    real: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """The user's inputs: graph inputs, or views of a synthetic base (Note [Aliased inputs]).

    One view per distinct ``real`` input: two equal views (``b[1:], b[1:]``)
    stay two tensors, as the caller's are (the function may return either).
    """
    views: dict[int, torch.Tensor] = {}  # id of the real input -> its view
    primals = []
    for (j, view), p in zip(sources, real, strict=True):
        if view is not None and id(p) not in views:
            views[id(p)] = graph_primals[j].as_strided(view.size, view.stride, view.storage_offset)
        primals.append(graph_primals[j] if view is None else views[id(p)])
    return primals


def _flatten_result(
    result: Any,
    stored: Sequence[torch.Tensor],
    record: TraceRecord,
    where: UserFrame | None,
    traced: Callable[[object], bool],
) -> tuple[list[ConstantOutput | int], list[torch.Tensor]]:
    """Validate and flatten the user's result into constants and traced tensor positions.

    ``stored``: tensors the function stored in the user's objects; the result becomes
    ``(result, stored)`` (Note [Side effects replayed]).
    """
    try:
        result = objects_as_nodes(result)  # Note [Objects among the outputs]
    except SharedObjectError as e:
        raise UnsupportedOutputError(
            format_error(
                f"the result reaches one {e} object holding tensors twice (or in a cycle);"
                " aotgrad rebuilds such objects from the graph's outputs and cannot make"
                " them one object again",
                where,
                "Return the object once, or return its tensors.",
            )
        ) from None
    for t in stored:
        if not traced(t):
            raise UnsupportedSideEffectError(
                format_error(
                    "the function stored a fake tensor that is not a value of its graph in the"
                    " user's objects",
                    where,
                    "Store only tensors the function computes, or return them.",
                )
            )
    if stored:
        result = (result, list(stored))
    with_paths, record.out_spec = pytree.tree_flatten_with_path(result)
    leaves: list[ConstantOutput | int] = []
    tensors: list[torch.Tensor] = []
    user = len(with_paths) - len(stored)
    record.out_paths = [
        pytree.keystr(path[1:] if stored else path) for path, _ in with_paths[:user]
    ]
    for path, leaf in with_paths:
        check_output_leaf(path, leaf, where)
        if traced(leaf):
            leaves.append(len(tensors))
            tensors.append(leaf)
        else:  # a constant, or a tensor the function closed over: returned as is
            leaves.append(ConstantOutput(leaf))
    return leaves, tensors


def _backward(
    state: TraceState, tracer: Tracer, returned: Sequence[torch.Tensor], closed_over: ClosedOver
) -> list[torch.Tensor | None]:
    """Run the backward under the checks and swaps it needs: cotangents for the Function's
    differentiable outputs, then the grads of all (graph) primals."""
    record, primals, edges, where = state.record, state.graph_primals, state.edges, state.where
    if tracer.leaf_primals:  # a reentrant checkpoint may write closed-over .grad
        for t in record.closed_over_leaves:
            tracer.recorder.real_leaves.setdefault(id(t), t)
    with (
        tracer.backward_checked(state) as changed,
        closed_over.backward(),  # Note [The swap spans the backward]
    ):
        targets = [t for t, d in zip(returned, record.differentiable, strict=True) if d]
        cotangents = [make_cotangent(t, i) for i, t in enumerate(targets)]
        # All edges (full trace) or all tensors (direct trace): ``grad`` takes either.
        wrt: Any = [edge for i in record.grad_inputs if (edge := edges[i]) is not None]
        sources = [
            source
            for i in record.grad_inputs
            if (source := primals[i] if tracer.leaf_primals else edges[i]) is not None
        ]
        record.reached_by = [0] * len(edges)
        for i, mask in zip(record.grad_inputs, reaching_masks(targets, sources), strict=True):
            record.reached_by[i] = mask
        tracer.recorder.backward_hooks(targets)
        leaf = tracer.leaf_primals  # .backward() into leaf primals, else autograd.grad
        with (
            _real_grads_untouched(tracer.recorder, where) if leaf else contextlib.nullcontext(),
            autocast_off(),  # Note [Autocast]
            collective_grads_checked(where),  # Note [Collectives]
        ):
            computed = _run_engine(targets, cotangents, () if leaf else tuple(wrt), leaf)
        if leaf:
            computed = tuple(primals[i].grad for i in record.grad_inputs)
    record.state_at_backward = changed  # Note [State updated by the backward]
    sites = tracer.recorder.backward_sites
    record.state_sites = [site_of(primals[i], sites) for i in changed]
    if changed:  # the graph was retained: what its nodes saved is still there
        nodes = autograd_nodes(targets)
        saved = saved_by_nodes([primals[i] for i in changed], nodes)
        hooked = [site is not None and site.hooked for site in record.state_sites]
        record.state_saved = [a or b for a, b in zip(saved, hooked, strict=True)]
    grads: list[torch.Tensor | None] = [None] * len(edges)
    for i, g in zip(record.grad_inputs, computed, strict=True):
        grads[i] = g
    check_plain_grads(grads, state.inputs.descriptors, where)  # Note [Tensor subclasses]
    return grads


# Note [The swap spans the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A checkpoint re-runs user code during the backward: the non-reentrant kind
# from a saved-tensor hook, the reentrant kind from its ``backward``. That code
# reaches closed-over tensors afresh (``lin.weight``), so the closed-over swap
# (Note [Real tensors in a trace]) must be active while the engine runs.
# ``torch.autograd.grad``/``backward`` are torch functions: called under the
# mode, they are handed to its handler with the mode popped, and the engine
# would run without it::
#
#     grad(...) under ClosedOver -> handler (mode popped) -> engine
#         -> recompute lin(y): reads the real lin.weight
#            non-reentrant: a constant baked into the backward graph
#            reentrant: its .grad written with a FunctionalTensor
#
# So capture calls the engine itself, below the torch-function layer, and the
# recompute reads the traced primals: their gradients are the graph's. In the
# engine the mode only swaps (``ClosedOver.backward``): functionalization's own
# C++ wrappers reach Python decompositions there as plain tensors that require
# grad, and must pass. A real tensor the recompute reads but the forward did not
# is unlikely (the forward ran the same code under the refusing mode); one that
# gets a gradient in a reentrant backward is still caught by ``_real_grads_untouched``.


def _run_engine(
    targets: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    inputs: tuple[Any, ...],
    accumulate: bool,
) -> tuple[torch.Tensor | None, ...]:
    """``autograd.grad`` (``accumulate=False``) or ``.backward()`` with the modes kept active
    (Note [The swap spans the backward])."""
    return engine_run_backward(
        tuple(targets),
        tuple(cotangents),
        True,  # retain_graph: what the nodes saved, read after (Note [State updated by the backward])
        False,  # create_graph
        inputs,
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )


@contextlib.contextmanager
def _real_grads_untouched(recorder: Recorder, where: UserFrame | None) -> Iterator[None]:
    """Around ``.backward()`` into leaf primals: restore any real ``.grad`` it wrote, and refuse.

    A reentrant checkpoint's backward accumulates into every leaf its region
    used, including real tensors the function closes over (Note [Reentrant
    checkpoints]); capture must never change a real tensor.
    """
    # ``.grad`` is a torch function: read it below the closed-over swap, which would
    # answer with the traced primal's (Note [Real tensors in a trace]).
    with DisableTorchFunction():
        before = {i: t.grad for i, t in recorder.real_leaves.items()}
    try:
        yield
    finally:
        with DisableTorchFunction():
            touched = [t for i, t in recorder.real_leaves.items() if t.grad is not before.get(i)]
            for t in touched:
                t.grad = before.get(id(t))
    if touched:
        shapes = ", ".join(f"a tensor of shape {tuple(t.shape)}" for t in touched)
        raise UnsupportedOpError(
            format_error(
                f"a reentrant checkpoint (use_reentrant=True) uses {shapes} that requires grad"
                " but is not an input of the function (a closed-over module's parameter, a"
                " global); its gradient would be lost",
                where,
                "Trace the module itself (aotgrad.aot_module(model)) so its parameters become"
                " inputs, pass the tensor as an argument, or use use_reentrant=False.",
            )
        )


def _is_differentiable(t: torch.Tensor) -> bool:
    """Gets a cotangent: requires grad and has a differentiable dtype."""
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


__all__ = ["Body", "TraceOptions", "trace_joint"]
