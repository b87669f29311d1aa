"""The compiled callable: an ``autograd.Function`` around the two graphs, plus an epilogue.

Note [What the autograd.Function returns]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The forward graph returns ``(*outputs, *bases, *mutated, *saved)``. The
Function returns only the values autograd must track as its own outputs:
fresh outputs (those that alias nothing, Note [Aliased outputs]), bases and
mutated inputs' new values. Non-differentiable ones are marked so. Every
position comes from the ``Signature`` (Note [Positions]); for that Note's
``f(x, buf)``, forward outputs ``(out0, out1, out2, base, new buf, *saved)``::

    returned            = (0, 3, 4)    # output[0], the base, buf's new value
    bases_in_returned   = slice(1, 2)  # output[1], output[2] are rebuilt from it
    mutated_in_returned = slice(2, 3)  # copied into buf by the epilogue
    saved_in_forward    = slice(5, 7)  # to ctx.save_for_backward

The epilogue, outside the Function, then

1. copies each mutated input's new value into the user's tensor;
2. rebuilds every aliased output from what it aliases (an input, a fresh
   output or a base) with ``as_strided`` or by identity, so autograd sees
   a real view and routes its gradient into the source, and gives the view
   the traced one's creation meta (Note [Multi-output views]);
3. puts constants back and unflattens the result to the user's structure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    FUNCTION_BASE_APPLY,
    engine_uses,
    functorch_transforms_active,
    set_version_counter,
    set_view_creation,
    unwrap_if_dead,
)
from aotgrad.capture.analyses.aliasing import (
    Alias,
    AliasSource,
    ConstantOutput,
    OutputLeaf,
    TensorOutput,
    ViewMeta,
)
from aotgrad.capture.analyses.autocast import any_autocast, autocast_off, autocast_state
from aotgrad.capture.analyses.backward_state import StateRegion
from aotgrad.capture.analyses.dynamic import ShapeGuards
from aotgrad.capture.analyses.input_aliases import SyntheticBase
from aotgrad.capture.analyses.mutation import InputMutation
from aotgrad.errors import AutocastBackwardError, DoubleBackwardError, SavedVersionError
from aotgrad.ops.table import autocast_lowers, needs_grad_mode, op_name
from aotgrad.partition import Partitioned
from aotgrad.runtime.boxing import BoxedCall
from aotgrad.runtime.higher_order import HigherOrder
from aotgrad.runtime.slices import ancestors, graph_outputs, graph_placeholders
from aotgrad.runtime.transforms import GRAPH_PAIR, refuse_transform
from aotgrad.signature import Signature


@dataclass(frozen=True)
class Plan:
    """Positions the runtime needs, computed once per compiled specialization."""

    # Forward-graph output positions the Function returns, in order: the fresh outputs,
    # the bases, the mutated inputs' new values (read off the Signature, Note [Positions]).
    returned: tuple[int, ...]
    # Per returned value: does it get a cotangent?
    differentiable: tuple[bool, ...]
    # Where the saved values sit among the forward graph's outputs.
    saved_in_forward: slice
    # Tensor-output position of each fresh output, aligned with the head of ``returned``.
    fresh: tuple[int, ...]
    # Where the bases and the mutated inputs' new values sit among the returned values.
    bases_in_returned: slice
    mutated_in_returned: slice
    # Inputs mutated in place; those with ``data`` align with ``mutated_in_returned``.
    mutations: tuple[InputMutation, ...]
    num_tensor_outputs: int
    # Synthetic bases the graph takes in place of memory-sharing inputs.
    input_bases: tuple[SyntheticBase, ...]
    # Metadata mutations of user inputs a synthetic base stands for (by user input position).
    member_mutations: tuple[InputMutation, ...]
    # Per saved value, whether it is a size (dynamic shapes); empty when none is.
    saved_sizes: tuple[bool, ...]
    # Every output leaf is a fresh tensor, in order, and nothing is mutated: no epilogue.
    only_fresh: bool
    # The forward holds a kernel that needs grad mode on (ops.table.needs_grad_mode).
    forward_needs_grad_mode: bool
    leaves: tuple[OutputLeaf, ...]
    out_spec: pytree.TreeSpec
    # Graph inputs whose size/stride/offset the epilogue changes in place: saved as aliases
    # (Note [Replayed metadata keeps the version]).
    restrided: tuple[int, ...] = ()
    # Dynamic shapes: evaluates symbolic layouts at a call (Note [Symbolic layouts]).
    guards: ShapeGuards | None = None
    # The result holds a ``torch.Size`` (Note [Sizes in the result]).
    has_sizes: bool = False
    # Per Function input: bit ``k`` set when cotangent ``k``'s output reaches it (Note
    # [Gradients no output reaches]).
    reached_by: tuple[int, ...] = ()
    # Per cotangent: how to make zeros in its place (Note [Missing cotangents]).
    zeros: tuple[ZerosLike, ...] = ()
    # User inputs to make require grad before the call (Note [requires_grad_() on an input]).
    made_to_require_grad: tuple[int, ...] = ()
    # Backward ops autocast would cast, with their input dtype (Note [Autocast]).
    autocast_backward: tuple[tuple[torch.dtype, str], ...] = ()
    # User inputs to detach in place after the call (``a.detach_()`` in the function).
    detached_inputs: tuple[int, ...] = ()
    # Graph inputs the backward reads when it runs and writes its new values into (Note
    # [State updated by the backward] in ``capture/analyses/backward_state.py``).
    state_at_backward: tuple[int, ...] = ()
    # Per input in ``state_at_backward``: the cotangents (bitmask) that reach its region's
    # backward, and the inputs whose gradients that backward feeds.
    state_regions: tuple[StateRegion, ...] = ()
    # Graph inputs whose version the backward checks (the saved values are read from them,
    # or it reads them as state); None: not known, every metadata replay keeps the version
    # (Note [Replayed metadata keeps the version]).
    version_read: tuple[int, ...] | None = None

    @staticmethod
    def of(partitioned: Partitioned) -> Plan:
        joint, signature = partitioned.joint, partitioned.signature
        returned = _returned(joint.fresh_outputs, signature)
        bases = _following(len(joint.fresh_outputs), signature.bases_in_forward)
        mutations = joint.mutations
        if partitioned.mutations_in_graph:  # Note [Mutations kept in the graph]
            mutations = tuple(m for m in mutations if not m.written_in_graph)
        return Plan(
            returned=returned,
            differentiable=joint.differentiable[: len(returned)],
            saved_in_forward=signature.saved_in_forward,
            fresh=joint.fresh_outputs,
            bases_in_returned=bases,
            mutated_in_returned=_following(bases.stop, signature.mutated_in_forward),
            mutations=mutations,
            num_tensor_outputs=len(signature.outputs),
            input_bases=joint.input_bases,
            member_mutations=joint.member_mutations,
            saved_sizes=sizes if any(sizes := tuple(s.is_size for s in partitioned.saved)) else (),
            only_fresh=_only_fresh(
                joint.leaves,
                (*joint.mutations, *joint.member_mutations, *joint.detached_inputs),
                _width(bases),
            ),
            forward_needs_grad_mode=any(
                needs_grad_mode(n.target) for n in partitioned.forward.graph.nodes
            ),
            leaves=joint.leaves,
            out_spec=joint.out_spec,
            guards=joint.guards,
            has_sizes=_holds_size(joint.out_spec),
            reached_by=tuple(
                sum(1 << joint.cotangents.index(c) for c in cotangents)
                for cotangents in joint.reached_by
            ),
            zeros=_zeros_like_cotangents(partitioned),
            made_to_require_grad=joint.made_to_require_grad,
            restrided=tuple(m.index for m in mutations if m.metadata is not None),
            autocast_backward=_autocast_sensitive(partitioned.backward),
            detached_inputs=joint.detached_inputs,
            state_at_backward=joint.state_at_backward,
            state_regions=joint.state_regions,
            version_read=_version_read(partitioned),
        )


def _version_read(partitioned: Partitioned) -> tuple[int, ...]:
    """Graph inputs a saved value is read from, or the backward reads as state."""
    forward = partitioned.forward
    index = {node: i for i, node in enumerate(graph_placeholders(forward))}
    saved = graph_outputs(forward)[partitioned.signature.saved_in_forward]
    read = {index[n] for n in ancestors(saved) if n in index}
    return tuple(sorted(read | set(partitioned.joint.state_at_backward)))


def _returned(fresh: tuple[int, ...], signature: Signature) -> tuple[int, ...]:
    """Forward-output positions of the fresh outputs, every base and every new value."""
    outputs, bases, mutated = (
        signature.outputs_in_forward,
        signature.bases_in_forward,
        signature.mutated_in_forward,
    )
    return (
        *(outputs.start + k for k in fresh),
        *range(bases.start, bases.stop),
        *range(mutated.start, mutated.stop),
    )


def _following(start: int, span: slice) -> slice:
    """A slice as wide as ``span``, starting at ``start``."""
    return slice(start, start + _width(span))


def _width(span: slice) -> int:
    return span.stop - span.start


@dataclass(frozen=True)
class ZerosLike:
    """Zeros standing in for a cotangent the caller did not give (Note [Missing cotangents])."""

    # None when the size is symbolic: the forward keeps each call's sizes on ``ctx``.
    size: tuple[int, ...] | None
    dtype: torch.dtype
    device: torch.device

    def make(self, ctx: Any, k: int) -> torch.Tensor:
        size = self.size if self.size is not None else ctx.cotangent_sizes[k]
        return torch.zeros(size, dtype=self.dtype, device=self.device)


def _zeros_like_cotangents(partitioned: Partitioned) -> tuple[ZerosLike, ...]:
    if partitioned.backward is None:
        return ()
    placeholders = [n for n in partitioned.backward.graph.nodes if n.op == "placeholder"]
    values = [n.meta["val"] for n in placeholders[partitioned.signature.cotangents_in_backward]]
    return tuple(
        ZerosLike(
            size=tuple(v.shape) if all(isinstance(d, int) for d in v.shape) else None,
            dtype=v.dtype,
            device=v.device,
        )
        for v in values
    )


def _autocast_sensitive(
    backward: torch.fx.GraphModule | None,
) -> tuple[tuple[torch.dtype, str], ...]:
    """(input dtype, "op at source") of each backward op autocast would cast (Note [Autocast])."""
    if backward is None:
        return ()
    found = []
    for node in backward.graph.nodes:
        if node.op != "call_function" or not autocast_lowers(node.target):
            continue
        for arg in node.args:
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if (
                isinstance(val, torch.Tensor)
                and val.is_floating_point()
                and val.dtype != torch.float64
            ):
                info = node.meta.get("aotgrad")
                where = f" (the backward of {info.source})" if getattr(info, "source", None) else ""
                found.append((val.dtype, f"{op_name(node.target)}{where}"))
                break
    return tuple(found)


def _check_autocast_backward(sensitive: Sequence[tuple[torch.dtype, str]]) -> None:
    """Refuse a backward under autocast that would cast one of its ops (Note [Autocast])."""
    for device, dtype in autocast_state():
        for input_dtype, what in sensitive:
            if input_dtype != dtype:
                raise AutocastBackwardError(
                    f"backward() was called under torch.autocast({device!r}, dtype={dtype}), and"
                    f" the compiled backward holds {what} on {input_dtype} inputs, which eager"
                    " autocast would cast there; aotgrad traced the backward without autocast"
                    " (Note [Autocast]).\nCall backward() outside the autocast region, as"
                    " PyTorch recommends."
                )


def _only_fresh(leaves: Sequence[OutputLeaf], mutations: Sequence[Any], num_bases: int) -> bool:
    tensors = [leaf for leaf in leaves if isinstance(leaf, TensorOutput)]
    return (
        not mutations
        and num_bases == 0
        and len(tensors) == len(leaves)
        and all(leaf.alias is None and leaf.index == k for k, leaf in enumerate(tensors))
    )


def make_function(
    plan: Plan, forward: BoxedCall, backward: BoxedCall, higher_order: HigherOrder | None = None
) -> type[torch.autograd.Function]:
    """A fresh ``autograd.Function`` class bound to one pair of compiled graphs.

    ``higher_order`` computes the gradients under ``create_graph=True`` (Note
    [Differentiable backward]); without it, such a backward raises.
    """
    # Every field the two methods read, as locals of their closure: they run on every
    # call (Note [Where a call's microseconds go]).
    returned_positions, saved_in_forward = plan.returned, plan.saved_in_forward
    num_returned = len(returned_positions)
    leading = returned_positions == tuple(range(num_returned))
    not_differentiable = [i for i, d in enumerate(plan.differentiable) if not d]
    differentiable = [i for i, d in enumerate(plan.differentiable) if d]
    symbolic_sizes = any(z.size is None for z in plan.zeros)
    all_received = (1 << len(differentiable)) - 1
    no_grads = (None,) * len(plan.reached_by)
    extra = () if higher_order is None else higher_order.extra  # Note [Primals in the backward]
    needs_grad_mode, restrided, saved_sizes = (
        plan.forward_needs_grad_mode,
        plan.restrided,
        plan.saved_sizes,
    )
    zeros, reached_by, autocast_backward = plan.zeros, plan.reached_by, plan.autocast_backward
    keep_one = extra[0] if len(extra) == 1 else None
    only = differentiable[0] if len(differentiable) == 1 else None
    state_at_backward, state_regions = plan.state_at_backward, plan.state_regions
    # Positions in ``ctx.state`` of the inputs a node of the user's autograd graph saved:
    # their versions are checked as eager's unpack would (Note [State updated by the backward]).
    checked = [k for k, r in enumerate(state_regions) if r.saved]
    ahead = _replay_bumps(plan.mutations, [state_at_backward[k] for k in checked])
    num_grads = len(reached_by)

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if needs_grad_mode or any_autocast():
                results = run_forward(forward, plan, primals)
            else:  # run_forward's common case, inlined
                results = forward([*primals])
            if leading:  # the returned values are the graph's first outputs, in order
                returned = tuple(results[:num_returned])
            else:
                returned = tuple([results[i] for i in returned_positions])
            saved = results[saved_in_forward]
            if restrided:  # Note [Replayed metadata keeps the version]
                ids = {id(primals[i]) for i in restrided}
                saved = [v.detach() if id(v) in ids else v for v in saved]
            if saved_sizes:  # dynamic shapes: ints ride on ctx, tensors are saved
                ctx.sizes = [v for v in saved if not isinstance(v, torch.Tensor)]
                saved = [v for v in saved if isinstance(v, torch.Tensor)]
            ctx.save_for_backward(*saved)
            if keep_one is not None:  # Note [Primals in the backward]: one input (usual)
                kept_one = primals[keep_one]
                ctx.kept = ((kept_one,), (kept_one._version,))
            elif extra:
                kept = [primals[i] for i in extra]
                ctx.kept = (kept, [t._version for t in kept])
            ctx.set_materialize_grads(False)  # Note [Missing cotangents]
            if state_at_backward:  # the tensors, read when the backward runs
                ctx.state = [primals[i] for i in state_at_backward]
                if checked:  # their versions once the epilogue replayed the forward's change
                    state = zip(checked, ahead, strict=True)
                    ctx.versions = [ctx.state[k]._version + a for k, a in state]
            if symbolic_sizes:
                ctx.cotangent_sizes = [returned[i].shape for i in differentiable]
            if not_differentiable:
                ctx.mark_non_differentiable(*[returned[i] for i in not_differentiable])
            return returned

        @staticmethod
        def jvp(ctx: Any, *tangents: Any) -> Any:  # a dual tensor reached the graphs
            refuse_transform(GRAPH_PAIR)  # Note [Transforms run the function]

        @staticmethod
        def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
            received = all_received
            try:  # the usual call: every differentiable output got a gradient
                if only is not None:  # one differentiable output (the usual case)
                    cotangents = [grad_outputs[only].contiguous()]  # type: ignore[union-attr]
                else:
                    cotangents = [grad_outputs[i].contiguous() for i in differentiable]  # type: ignore[union-attr]
            except AttributeError:  # one is None (Note [Missing cotangents])
                given = [grad_outputs[i] for i in differentiable]
                cotangents, received = with_zeros(ctx, given, zeros)
                if not received:
                    return no_grads
            saved = ctx.saved_tensors
            if checked:  # Note [State updated by the backward]
                check_versions([ctx.state[k] for k in checked], ctx.versions)
            if saved_sizes:  # the ints back between the tensors
                tensors, sizes = iter(saved), iter(ctx.sizes)
                saved = [next(sizes) if is_size else next(tensors) for is_size in saved_sizes]
                del tensors  # it holds autograd's tuple: the graph could free nothing early
            if torch.is_grad_enabled():  # create_graph=True (Note [Differentiable backward])
                if state_at_backward:
                    _refuse_state_at_double_backward(state_regions, ctx.state)
                if any_autocast():  # Note [Autocast]
                    _check_autocast_backward(autocast_backward)
                state = ctx.state if state_at_backward else ()
                grads = _differentiable(higher_order, ctx, saved, cotangents, state)
                if state_at_backward:  # the new values: the first-order graph's
                    with torch.no_grad():
                        results = backward([*saved, *cotangents, *state])
                    ran = regions_run(state_regions, received, ctx.next_functions)
                    write_state(state, results, num_grads, ran)
            else:  # Note [Saved values die in the backward]
                args = [*saved, *cotangents]
                if state_at_backward:  # Note [State updated by the backward]
                    args += ctx.state
                del saved
                ctx.maybe_clear_saved_tensors()
                if any_autocast():  # Note [Autocast]
                    _check_autocast_backward(autocast_backward)
                    with autocast_off():
                        grads = backward(args)
                else:
                    grads = backward(args)
                if state_at_backward:
                    ran = regions_run(state_regions, received, ctx.next_functions)
                    grads = write_state(ctx.state, grads, num_grads, ran)
            if received != all_received:
                return tuple(reached_grads(grads, reached_by, received))
            return tuple(grads)

    return CompiledFunction


# Note [Saved values die in the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The backward graph frees each saved value after its last use, but only if
# nothing else holds it: the backward hands the graph its one list of saved
# values and cotangents (the straight-line code empties it once unpacked),
# drops its own tuple, and clears autograd's copies on ``ctx``
# (``maybe_clear_saved_tensors``: a no-op under ``retain_graph=True``, where
# a second backward needs them). For ``relu(x @ w).sum()`` saving ``mm`` and
# ``relu``::
#
#     backward graph:  g = threshold_backward(ones, relu)   relu freed here
#                      gw = mm(t(x), g) ...                 mm freed at its last use
#
# Held to the end instead, every saved value would sit under the backward's
# peak, which is the step's peak in most models (Note [What a step holds] in
# ``partition/memory.py`` predicts it). A second-order backward
# (``create_graph=True``) keeps them: its graph is differentiated again.


def regions_run(
    regions: Sequence[StateRegion], received: int, next_functions: Sequence[Any]
) -> list[bool]:
    """Per state input: would eager's engine run its region's backward, and recompute it?
    Some cotangent reaching it was given, and the engine uses a gradient it feeds (Note
    [State updated by the backward] in ``capture/analyses/backward_state.py``)."""
    return [
        bool(region.cotangents & received)
        and (
            not region.feeds
            or any(
                (node := next_functions[i][0]) is not None and engine_uses(node)
                for i in region.feeds
            )
        )
        for region in regions
    ]


def write_state(
    state: Sequence[torch.Tensor], results: Sequence[Any], num_grads: int, ran: Sequence[bool]
) -> Sequence[Any]:
    """Write the backward's new state values into the inputs whose regions eager would have
    recomputed; return the grads alone (Note [State updated by the backward])."""
    with torch.no_grad():
        for tensor, new, write in zip(state, results[num_grads:], ran, strict=True):
            if write:
                tensor.copy_(new)
    return results[:num_grads]


def _replay_bumps(mutations: Sequence[InputMutation], checked: Sequence[int]) -> list[int]:
    """Per checked state input: how many times the epilogue's replay of the forward's change
    bumps its version (``as_strided_`` then ``copy_``; a metadata change alone keeps it)."""
    bumps = {m.index: int(m.data) * (1 + int(m.metadata is not None)) for m in mutations}
    return [bumps.get(i, 0) for i in checked]


def check_versions(state: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Raise eager's error for a state input changed since eager would have saved it (a first
    backward's change, the caller's): Note [State updated by the backward]."""
    for t, version in zip(state, versions, strict=True):
        if t._version != version:
            raise SavedVersionError(
                "one of the variables needed for gradient computation has been modified by an"
                f" inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version};"
                f" expected version {version} instead: an input of the compiled function that"
                " its backward reads as eager's saved tensor"
                " (Note [State updated by the backward]).\nEager raises this error here too:"
                " leave the tensor unchanged until the backward has run, or call backward once."
            )


def _refuse_state_at_double_backward(
    regions: Sequence[StateRegion], state: Sequence[torch.Tensor]
) -> None:
    """Refuse ``create_graph=True`` through a backward that changes inputs in place where
    aotgrad does not replay it, naming what changes them (Note [State updated by the
    backward]): a checkpointed region's recompute, or an input that requires grad."""
    named = [r.what for r in regions if r.what]
    if len(named) == len(regions) and not any(t.requires_grad for t in state):
        return  # custom Functions changing inputs that do not require grad: replayed
    what = (
        f"{named[0]} changes an input in place"
        if named
        else "a checkpointed region's recompute updates state (a BatchNorm's running statistics)"
    )
    if any(t.is_leaf and t.requires_grad for r, t in zip(regions, state, strict=True) if r.what):
        why = (
            "the input is a leaf that requires grad, and eager raises 'a leaf Variable that"
            " requires grad is being used in an in-place operation' there"
        )
    else:
        why = (
            "aotgrad's differentiable backward does not replay that change (of an input that"
            " requires grad, or in a checkpointed region)"
        )
    raise DoubleBackwardError(
        f"create_graph=True (double backward) through a function whose backward changes its"
        f" inputs: {what}, and {why} (Note [State updated by the backward]).\n"
        "Call backward() without create_graph, or make the change outside the compiled"
        " function (or outside the checkpointed region)."
    )


def run_forward(forward: BoxedCall, plan: Plan, inputs: Sequence[torch.Tensor]) -> Any:
    """The forward graph's results, under the grad mode and autocast it needs."""
    if plan.forward_needs_grad_mode:  # detached inputs: grad mode on, no graph built
        with torch.enable_grad(), autocast_off():
            return forward([p.detach() for p in inputs])
    if any_autocast():  # the graph holds its casts (Note [Autocast])
        with autocast_off():
            return forward(list(inputs))
    return forward(list(inputs))


# Note [Missing cotangents]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The Function does not let autograd make zeros for the outputs nothing
# differentiated (``set_materialize_grads(False)``): ``backward`` receives
# ``None`` for them, puts zeros in their place for the backward graph (which
# takes one cotangent per differentiable output), and returns ``None`` for
# every input that only those outputs reach (Note [Gradients no output
# reaches]). For ``f(a, c) = (a * 2, c * 3)`` with ``reached_by = (0b01, 0b10)``:
#
#     backward(g0, g1)    ->  received 0b11   ->  (2 * g0, 3 * g1)
#     backward(g0, None)  ->  received 0b01   ->  (2 * g0, None)      # graph ran on (g0, zeros)
#     backward(None, None) ->  received 0b00  ->  (None, None)        # graph not run
#
# Zeros take the cotangent's traced size, or, under dynamic shapes, the size
# the forward saw at this call (kept on ``ctx`` only then).


def with_zeros(
    ctx: Any, given: Sequence[torch.Tensor | None], zeros: Sequence[ZerosLike]
) -> tuple[list[torch.Tensor], int]:
    """Zeros in place of missing cotangents, and the bitmask of those given."""
    cotangents, received = [], 0
    for k, (g, like) in enumerate(zip(given, zeros, strict=True)):
        if g is None:
            cotangents.append(like.make(ctx, k))
        else:
            cotangents.append(g.contiguous())
            received |= 1 << k
    return cotangents, received


def reached_grads(
    grads: Sequence[torch.Tensor | None], reached_by: Sequence[int], received: int
) -> list[torch.Tensor | None]:
    """``grads`` with None for inputs no received cotangent reaches (Note [Missing cotangents])."""
    return [g if mask & received else None for g, mask in zip(grads, reached_by, strict=True)]


# Note [Calling the Function directly]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``autograd.Function.apply`` is a Python classmethod that, outside functorch
# transforms, unwraps dead functorch wrappers (pytree over the arguments) and
# calls the C++ ``_FunctionBase.apply``. That Python layer is a visible share
# of a small graph's call (bench/findings.md). ``direct_apply`` does the same two steps
# itself on the flat tensor list. Under an active transform the graphs cannot
# run at all: it raises (Note [Transforms run the function]; the frontends run
# the user's function instead and never get here):
#
#     Function.apply(x, w)       ->  unwrap_dead_wrappers((x, w)); _FunctionBase.apply(x, w)
#     direct_apply(F)(x, w)      ->  [unwrap_if_dead(x), unwrap_if_dead(w)]; _FunctionBase.apply
#
# The last entry's direct call (``CompiledGraphs.direct_call(common=True)``)
# calls ``_FunctionBase.apply`` with neither step: its checks have already
# ruled out a transform and any functorch wrapper (Note [Where a call's
# microseconds go]).


def direct_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without its Python layer (Note [Calling the Function directly])."""
    raw = FUNCTION_BASE_APPLY.__get__(None, function)
    unwrap = unwrap_if_dead
    transforms_active = functorch_transforms_active

    def apply(*inputs: torch.Tensor) -> Any:
        if transforms_active():
            refuse_transform(GRAPH_PAIR)
        return raw(*map(unwrap, inputs))

    return apply


def _differentiable(
    higher_order: HigherOrder | None,
    ctx: Any,
    saved: Sequence[Any],
    cotangents: Sequence[Any],
    state: Sequence[torch.Tensor],
) -> Sequence[torch.Tensor | None]:
    """The gradients under ``create_graph=True`` (Note [Differentiable backward])."""
    if higher_order is None:
        raise DoubleBackwardError(
            "create_graph=True (double backward): these compiled graphs were wired up without"
            " their forward graph (CompiledGraphs(..., higher_order=None)), which the"
            " differentiable backward recomputes from.\nBuild them with"
            " aotgrad.pipeline.compile_stage, or call aot_function / trace()."
        )
    kept = ctx.kept if higher_order.extra else ((), ())
    needs_grad = ctx.needs_input_grad
    wanted = [  # Note [Only the gradients asked for]
        needed and engine_uses(node)
        for needed, (node, _) in zip(needs_grad, ctx.next_functions, strict=True)
    ]
    with autocast_off() if any_autocast() else contextlib.nullcontext():  # Note [Autocast]
        return higher_order.gradients(needs_grad, wanted, saved, kept, cotangents, state)


def run_epilogue(
    plan: Plan,
    primals: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    returned: Sequence[torch.Tensor],
    subclass_inputs: SubclassInputs | None = None,
) -> Any:
    """Mutations back into inputs, aliases rebuilt, constants restored (Note above).

    ``primals`` are the user's tensors, ``inputs`` the graph's (Note [Aliased inputs]).
    ``subclass_inputs`` replays the mutations of subclass inputs' inner tensors
    (Note [Subclass inputs rebased] in ``runtime/subclass_inputs.py``).
    """
    if plan.only_fresh and subclass_inputs is None:  # nothing to replay: the returned values
        # are the outputs, in order
        if plan.out_spec.is_leaf():
            return returned[0]
        return unflatten_result(list(returned), plan)
    bases = returned[plan.bases_in_returned]
    new_values = iter(returned[plan.mutated_in_returned])
    concrete = _ConcreteLayouts(plan.guards, inputs)
    if any(m.metadata or m.storage for m in (*plan.mutations, *plan.member_mutations)):
        concrete.bind()  # before the replays below restride the inputs the sizes are read from
    sets = [m for m in plan.mutations if m.storage is not None]
    storages = _source_storages(sets, inputs)  # Note [set_() on an input]
    shrinks: list[tuple[torch.UntypedStorage, int]] = []
    for mutation in plan.mutations:
        new = next(new_values) if mutation.data else None
        if subclass_inputs is not None and mutation.index in subclass_inputs.positions:
            subclass_inputs.take(mutation, new)
            continue
        if mutation.storage is not None:  # replayed below, onto its new storage
            storages[mutation.index] = (storages[mutation.index][0], new)
        if mutation.resized is not None:  # Note [Storage resizes of an input]
            shrinks += _replay_resized(inputs[mutation.index], concrete.mutation(mutation), new)
        elif mutation.storage is None:
            bumps = _bumps_as_eager(plan, inputs, mutation.index)
            _replay_mutation(inputs[mutation.index], concrete.mutation(mutation), new, bumps)
    if subclass_inputs is not None:
        subclass_inputs.replay()
    for mutation in sets:  # after every copy_: a set_ source's values are final
        assert mutation.storage is not None
        storage, new = storages[mutation.index]
        layout = concrete.layout(mutation.storage.layout)
        keeps = mutation.storage.keeps_version
        _replay_set(inputs[mutation.index], layout, storage, new, keeps)
    with torch.no_grad():
        for storage, nbytes in shrinks:  # last: set_() would grow a freed storage again
            storage.resize_(nbytes)
    for mutation in plan.member_mutations:  # Note [Aliased inputs]
        _replay_mutation(primals[mutation.index], concrete.mutation(mutation), None)
    if plan.restrided:  # Note [Views of a restrided input]
        inputs = [
            x._base if i in plan.restrided and x._base is not None else x
            for i, x in enumerate(inputs)
        ]
    for i in plan.detached_inputs:  # Note [requires_grad_() on an input]
        primals[i].detach_()
    tensors: list[torch.Tensor | None] = [None] * plan.num_tensor_outputs
    for k, value in zip(plan.fresh, returned, strict=False):
        tensors[k] = value
    leaves = []
    for leaf in plan.leaves:
        if isinstance(leaf, ConstantOutput):
            value = leaf.value
            leaves.append(concrete.size(value) if type(value) is torch.SymInt else value)
            continue
        if leaf.alias is not None:
            tensors[leaf.index] = _rebuild(
                concrete.alias(leaf.alias), (primals, inputs, tensors, bases)
            )
        leaves.append(tensors[leaf.index])
    if plan.out_spec.is_leaf():
        return leaves[0]
    return unflatten_result(leaves, plan)


# Note [Sizes in the result]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch registers ``torch.Size`` as a pytree node that unflattens to a plain
# ``tuple`` (fx's tracers need that: ``Size`` only holds ints). A function
# returning ``x.shape`` must still return a ``torch.Size``, as eager does, so
# the result is rebuilt node by node when its structure holds one:
#
#     fn(x) = (x.sin(), x.shape)   leaves: [sin, 2, 3]   spec: tuple(*, Size(*, *))
#     pytree.tree_unflatten:       (sin, (2, 3))
#     unflatten_result:            (sin, torch.Size([2, 3]))


def unflatten_result(leaves: list[Any], plan: Plan) -> Any:
    """The user's result from its leaves, ``torch.Size`` kept (Note [Sizes in the result])."""
    if not plan.has_sizes:
        return pytree.tree_unflatten(leaves, plan.out_spec)
    return _build(iter(leaves), plan.out_spec)


def _build(leaves: Any, spec: pytree.TreeSpec) -> Any:
    if spec.is_leaf():
        return next(leaves)
    children = [_build(leaves, child) for child in spec.children()]
    if spec.type is torch.Size:
        return torch.Size(children)
    return pytree.SUPPORTED_NODES[spec.type].unflatten_fn(children, spec.context)


def _holds_size(spec: pytree.TreeSpec) -> bool:
    return spec.type is torch.Size or any(_holds_size(c) for c in spec.children())


class _ConcreteLayouts:
    """Aliases and mutations with this call's layouts (Note [Symbolic layouts])."""

    def __init__(self, guards: ShapeGuards | None, inputs: Sequence[torch.Tensor]) -> None:
        self.guards, self.inputs = guards, inputs
        self._value_of: Callable[[Any], int] | None = None

    def bind(self) -> None:
        """Read this call's values of the trace's symbolic sizes from the inputs as they are now
        (an input restrided in place, ``a.squeeze_()``, would give other sizes afterwards)."""
        if self._value_of is None and self.guards is not None:
            self._value_of = self.guards.value_of(self.inputs)

    def _resolve(self, layout: ViewMeta | None) -> ViewMeta | None:
        if layout is None or self.guards is None or not layout.is_symbolic:
            return None
        self.bind()
        assert self._value_of is not None
        return layout.resolved(self._value_of)

    # Note [Sizes among the outputs]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Under dynamic shapes ``return y, x.shape[0] * 2`` returns a ``SymInt`` of the
    # trace: a constant leaf of the result whose value is an expression of the
    # inputs' sizes, evaluated at each call's sizes (``2*s0`` -> 10 for 5 rows).
    def size(self, value: torch.SymInt) -> int:
        """A ``SymInt`` of the trace at this call's sizes."""
        if self.guards is None:
            raise AssertionError(f"expected shape guards for the symbolic output {value}")
        self.bind()
        assert self._value_of is not None
        return self._value_of(value)

    def alias(self, alias: Alias) -> Alias:
        view = self._resolve(alias.view)
        return alias if view is None else replace(alias, view=view)

    def layout(self, layout: ViewMeta) -> ViewMeta:
        return self._resolve(layout) or layout

    def mutation(self, mutation: InputMutation) -> InputMutation:
        metadata = self._resolve(mutation.metadata)
        return mutation if metadata is None else replace(mutation, metadata=metadata)


class SubclassInputs(Protocol):
    """Takes the replays of subclass inputs' inner tensors (``runtime/subclass_inputs.py``)."""

    positions: frozenset[int]

    def take(self, mutation: InputMutation, new: torch.Tensor | None) -> None: ...

    def replay(self) -> None: ...


def _bumps_as_eager(plan: Plan, inputs: Sequence[torch.Tensor], i: int) -> bool:
    """May a metadata replay on input ``i`` bump its version, as eager's did? Only when no
    input the backward checks shares its storage (Note [Replayed metadata keeps the version])."""
    if plan.version_read is None:
        return False
    storage = inputs[i].untyped_storage()
    return not any(
        inputs[j].untyped_storage().data_ptr() == storage.data_ptr() for j in plan.version_read
    )


def _replay_mutation(
    x: torch.Tensor, mutation: InputMutation, new: torch.Tensor | None, bumps: bool = False
) -> None:
    """Apply a traced in-place change to the caller's tensor (Note [Input mutation]); ``bumps``:
    a metadata-only change bumps its version (Note [Replayed metadata keeps the version])."""
    if mutation.metadata is not None:
        meta = mutation.metadata
        needed = meta.extent * x.element_size()
        if needed > x.untyped_storage().nbytes():  # resize_ grew the tensor
            with torch.no_grad():
                x.untyped_storage().resize_(needed)
        version = x._version
        with torch.set_grad_enabled(mutation.with_grad):
            x.as_strided_(meta.size, meta.stride, meta.storage_offset)
        if new is None and not bumps:  # Note [Replayed metadata keeps the version]
            set_version_counter((x,), (version,))
    if new is not None:
        with torch.set_grad_enabled(mutation.requires_grad):
            x.copy_(new)


def _replay_resized(
    x: torch.Tensor, mutation: InputMutation, new: torch.Tensor | None
) -> list[tuple[torch.UntypedStorage, int]]:
    """Grow the caller's storage as the function did, then replay the input's other changes
    (no copy into a storage the function freed); return the shrink to do after every replay
    (Note [Storage resizes of an input] in ``capture/analyses/set_storage.py``). An input ``set_()``
    moves is replayed later."""
    nbytes, storage = mutation.resized, x.untyped_storage()
    if nbytes > storage.nbytes():
        with torch.no_grad():
            storage.resize_(nbytes)
    if mutation.storage is None:
        _replay_mutation(x, mutation, new if nbytes else None)
    return [(storage, nbytes)] if nbytes < storage.nbytes() else []


def _source_storages(
    sets: Sequence[InputMutation], inputs: Sequence[torch.Tensor]
) -> dict[int, tuple[torch.UntypedStorage | None, torch.Tensor | None]]:
    """Per input ``set_()`` moved: the caller's storage it now shares (None: a storage the
    function made), read before any replay moves one (Note [set_() on an input])."""
    found: dict[int, tuple[torch.UntypedStorage | None, torch.Tensor | None]] = {}
    for m in sets:
        assert m.storage is not None
        source = m.storage.source
        found[m.index] = (None if source is None else inputs[source].untyped_storage(), None)
    return found


def _replay_set(
    x: torch.Tensor,
    layout: ViewMeta,
    storage: torch.UntypedStorage | None,
    new: torch.Tensor | None,
    keeps_version: bool,
) -> None:
    """``x.set_()`` as the function did: onto a caller's storage, or onto a fresh storage
    holding ``new`` (Note [set_() on an input] in ``capture/analyses/set_storage.py``)."""
    if storage is None:
        assert new is not None, "expected the new value of an input set_ onto a fresh storage"
        fresh = torch.empty(layout.extent, dtype=x.dtype, device=x.device)
        with torch.no_grad():
            fresh.as_strided(layout.size, layout.stride, layout.storage_offset).copy_(new)
        storage = fresh.untyped_storage()
    version = x._version
    if x.requires_grad and x.is_leaf:  # Note [set_() on a leaf keeps its accumulator]
        carrier = torch.empty(0, dtype=x.dtype, device=x.device)
        carrier.set_(storage, layout.storage_offset, layout.size, layout.stride)
        x.data = carrier  # keeps x's version
        if not keeps_version:  # as set_() bumps it
            set_version_counter((x,), (version + 1,))
        return
    with torch.no_grad():
        x.set_(storage, layout.storage_offset, layout.size, layout.stride)
    if keeps_version:  # ``x.data = source`` (set_() bumps it)
        set_version_counter((x,), (version,))


# Note [set_() on a leaf keeps its accumulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``x.set_(...)`` on a leaf that requires grad gives ``x`` a new gradient
# accumulator (``x.data = y`` keeps the old one). The compiled Function's edge
# to ``x`` was made, at its apply, before the epilogue replays the set_, so
# replayed with ``set_()`` the edge would lead to an accumulator ``x`` no
# longer has: ``.backward()`` still fills ``x.grad``, but
# ``autograd.grad(out, x)`` finds ``x`` unused::
#
#     def f(a):                  # a: a leaf requiring grad
#         a.data = torch.ones(3)
#         return a * 2           # eager: grad(out, a) = 2s; set_() replay: None
#
# So a leaf requiring grad takes its new storage through ``x.data = carrier``
# (a tensor over that storage and layout), which keeps the accumulator, and its
# version is bumped by hand where eager's ``set_()`` bumped it. Eager's own
# ``set_()`` (under no_grad) does start a new accumulator, but its outputs
# computed after it lead there, as the compiled outputs lead to the kept one.


# Note [Views of a restrided input]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When an input that is itself a view changes its size or strides in place
# with grad mode on, autograd regenerates every older view of it from its
# *base*; rebuilt from the input, an output view would send its gradient
# through the input's new, possibly smaller, geometry. Worked example::
#
#     def f(a):                        # a = (root * 1)[:], size (2,)
#         v = a.view(-1)
#         a.as_strided_((1, 1), (0, 0), 0)
#         return v                     # eager: v's gradient reaches both elements
#
#     a.as_strided(v's layout)         # through a's as_strided_: element 1 gets 0
#     a._base.as_strided(v's layout)   # as eager
#
# So after a metadata replay, views of such an input are rebuilt from its base.


# Note [Replayed metadata keeps the version]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd checks, in the backward, that a saved tensor is still at the
# version it was saved at. In eager, ``t_()`` bumps the version *before* the
# ops that follow save the tensor; the runtime replays it *after* the
# Function saved the input, so the bump would fail a backward eager runs::
#
#     def f(a):            # a = torch.randn(2, 1, requires_grad=True) * 1
#         a.t_()           # eager: a at version 1
#         return a.sin()   # eager: saves a at version 1; backward checks 1
#
#     compiled:  Function saves a (version 0); epilogue a.as_strided_(...)
#                -> version 1; backward: "modified by an inplace operation"
#
# A metadata-only replay changes no value the backward reads, so it puts the
# version back. But it does change the metadata of the caller's tensor, and
# ``save_for_backward(a)`` of an input keeps that very tensor: the backward
# would read ``a`` with the new strides (the gradient comes back transposed,
# silently). So the Function saves such an input as an alias (``a.detach()``:
# its own size and strides, the same data and version counter). A data
# mutation's ``copy_`` keeps its bump: when the backward needs the old value,
# the backward raises as eager does. The price of the restored version: where
# eager raises because ``t_()`` came *after* the save, the compiled function
# computes the (correct) gradient.
#
# Where no input the backward checks (``Plan.version_read``: those the saved
# values are read from, and the backward's state) shares the input's storage,
# the bump is kept, as eager's: a view of the input taken before the call
# (another argument, ``b`` and ``b[1:]``) sees the version move and, once its
# base requires grad, takes a ``grad_fn`` as eager's does::
#
#     def f(a0, a1):             # called as f(b, b[1:]), b a leaf not requiring grad
#         a0.t_()                # bumps b's version (and a1's: one counter)
#         a0.requires_grad_(True)
#         return a0              # eager: a1 is a view with a grad_fn; restored: a leaf


_SOURCES = (AliasSource.INPUT, AliasSource.GRAPH_INPUT, AliasSource.OUTPUT, AliasSource.BASE)


def _rebuild(alias: Alias, values: tuple[Sequence[torch.Tensor | None], ...]) -> torch.Tensor:
    """``values``: user inputs, graph inputs, tensor outputs and bases, in ``_SOURCES`` order."""
    source = values[_SOURCES.index(alias.source)][alias.index]
    assert source is not None, f"expected {alias.source.value} {alias.index} to be built first"
    if alias.view is None:
        return source
    meta = alias.view
    if alias.past_no_grad_view:  # Note [Views past a no_grad view]
        with torch.no_grad():
            cut = source.as_strided(meta.size, meta.stride, meta.storage_offset)
        with torch.enable_grad():
            view = cut.view_as(cut)
    else:
        with torch.set_grad_enabled(alias.with_grad):  # Note [Grad mode regions]
            view = source.as_strided(meta.size, meta.stride, meta.storage_offset)
    if alias.creation is not None:  # Note [Multi-output views]: eager's rule for in-place changes
        set_view_creation(view, alias.creation.value)
    if view.requires_grad and not alias.requires_grad:
        return view.detach()
    if alias.requires_grad and not view.requires_grad:  # v = a.view(-1); v.requires_grad_()
        return view.requires_grad_(True)
    return view


__all__ = [
    "Plan",
    "TensorOutput",
    "direct_apply",
    "make_function",
    "run_epilogue",
    "unflatten_result",
]
