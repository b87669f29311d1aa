"""One capture of a scan's body ``fn(carry, x) -> (carry, y)``, and its positions.

Note [Scan's calling convention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The body is traced once, as ``aotgrad.trace`` would trace ``fn(carry, x)``
on one iteration's values: ``x`` is one row of ``xs``. Its graphs follow the
calling convention of ``docs/calling-convention.md``, with the inputs named
``carry...`` and ``x...`` whatever ``fn``'s parameters are called, after the
tensors ``fn`` closes over (``closure lin.weight``)::

    def fn(carry, x):                      # carry {'a', 'b'}, x {'weights', 'biases'}
        ...
        return {"a": a, "b": b}, y

    forward(closure..., carry['a'], carry['b'], x['weights'], x['biases'])
        -> (output[0]['a'], output[0]['b'], output[1], *saved)
    backward(*saved, cotangent of output[0]['a'], ..., cotangent of output[1])
        -> (grad of closure..., grad of carry['a'], ..., grad of x['biases'])

The loop reads every position off the ``Signature``: the carry's new values
are the first tensor outputs (the carry's leaves are all tensors), ``y``'s
follow; cotangent ``k`` belongs to the output its descriptor names. The
carry is traced as requiring grad whenever anything does (from the second
iteration on, it depends on whatever required grad), so one backward graph
serves every iteration.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.api import Traced
from aotgrad.capture import JointGraph
from aotgrad.capture.analyses.aliasing import TensorOutput
from aotgrad.capture.analyses.autocast import autocast_state
from aotgrad.capture.user_state.side_effects import Watch
from aotgrad.errors import (
    ScanError,
    UnsupportedSideEffectError,
    format_error,
    user_frame_of_function,
)
from aotgrad.loops.peak import LoopShape, ScanPeak, choose_for_peak
from aotgrad.ops.table import is_random
from aotgrad.partition import Budget, Partitioned
from aotgrad.partition.checks import check_partitioned
from aotgrad.pipeline import (
    Traceable,
    capture_stage,
    compile_stage,
    partition_stage,
    run,
    signature_stage,
    watch_of,
)
from aotgrad.runtime import CompiledGraphs
from aotgrad.runtime.boxing import BoxedCall
from aotgrad.runtime.function import Plan
from aotgrad.settings import Options, collector_paused
from aotgrad.signature.lifting import Body, Lifted, State


def carry_and_x(carry: Any, x: Any) -> None:
    """Names the body's inputs ``carry...`` and ``x...`` (Note [Scan's calling convention])."""


@dataclass(frozen=True, kw_only=True)
class ScanBody:
    """The body's graphs, compiled, and where the loop finds each of its values."""

    # The body's graphs and convention, as ``aotgrad.trace`` gives them.
    traced: Traced
    # The forward and backward graphs, compiled with the user's compilers.
    forward: BoxedCall
    backward: BoxedCall | None
    # Facts the runtime reads off the graphs (grad mode, zeros for missing cotangents).
    plan: Plan
    # How many inputs are closed-over tensors, carry leaves and x leaves, in that order.
    num_lifted: int
    num_carry: int
    num_x: int
    # Forward-output positions of the carry's new leaves and of y's tensor leaves.
    carry_in_forward: tuple[int, ...]
    y_in_forward: tuple[int, ...]
    # The structure of ``y``; per leaf of it, is it a tensor (else None, returned as is)?
    y_spec: pytree.TreeSpec
    y_is_tensor: tuple[bool, ...]
    # Each y tensor's (shape, dtype, device), for an empty scan.
    y_examples: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]
    # Per cotangent of the backward: ("carry", j) or ("y", j), the output it belongs to.
    cotangent_of: tuple[tuple[str, int], ...]
    # Does the forward draw random numbers (Note [Random ops in a scan])?
    random: bool
    # The predicted step peak a peak budget chose the plan for (Note [Peak budgets over a
    # scan]); None for other partitions (``ScanFunction.step_peak`` predicts it on demand).
    peak: ScanPeak | None = None

    @property
    def saved_in_forward(self) -> slice:
        return self.traced.signature.saved_in_forward

    def y_of(self, tensors: Sequence[torch.Tensor]) -> Any:
        """``y`` (or ``ys``) from its tensor leaves: None leaves put back."""
        found = iter(tensors)
        leaves = [next(found) if is_tensor else None for is_tensor in self.y_is_tensor]
        return pytree.tree_unflatten(leaves, self.y_spec)


def capture_body(
    *,
    fn: Callable[..., Any],
    state: State,
    lifted: Lifted,
    init: Sequence[torch.Tensor],
    carry_spec: pytree.TreeSpec,
    x: Sequence[torch.Tensor],
    x_spec: pytree.TreeSpec,
    options: Options,
    with_grad: bool,
    plan_for: LoopShape | None = None,
) -> ScanBody:
    """Trace ``fn`` on one iteration's values; trace again cloning outputs that alias.

    ``plan_for``, given with a peak budget, is the loop the body's plan is chosen for (Note
    [Peak budgets over a scan])."""
    chosen: list[ScanPeak] = []
    choose = None if plan_for is None else functools.partial(_choose, options, plan_for, chosen)
    carry = [_example(t, with_grad and differentiable(t)) for t in init]
    row = [_example(t, with_grad and t.requires_grad) for t in x]
    args = (pytree.tree_unflatten(carry, carry_spec), pytree.tree_unflatten(row, x_spec))
    traceable = signature_stage(fn, carry_and_x, args, {}, state, lifted, dims=None)
    clone: frozenset[int] | None = None  # None: the first trace
    while True:
        watch = watch_of(fn)  # Note [Side effects replayed]
        body = _checked(
            traceable.body, fn=fn, carry_spec=carry_spec, carry=carry, clone=clone or frozenset()
        )
        checks = functools.partial(_check_joint, fn, watch, clone is None)
        try:
            with torch.set_grad_enabled(with_grad):
                partitioned, compiled = _run(
                    replace(traceable, body=body, effects=watch), options, checks, choose
                )
        except _Aliasing as aliasing:  # Note [Outputs that alias]
            clone = aliasing.args[0]
            continue
        body_of = _body_of(partitioned, compiled, lifted.tensors, len(init), len(x), options)
        return replace(body_of, peak=chosen[-1] if chosen else None)


def _choose(
    options: Options, shape: LoopShape, chosen: list[ScanPeak], joint: JointGraph
) -> Partitioned:
    """A peak budget's plan for the loop; its predicted step peak goes to ``chosen``."""
    assert isinstance(options.partition, Budget), "a loop plans for a peak budget only"
    partitioned, peak = choose_for_peak(joint, options.partition, shape)
    chosen.append(peak)
    return partitioned


# Partitions a body's joint graph for the loop (a peak budget's choice).
Choose = Callable[[JointGraph], Partitioned]


def _run(
    traceable: Traceable,
    options: Options,
    checks: Callable[[JointGraph], None],
    choose: Choose | None,
) -> tuple[Partitioned, CompiledGraphs]:
    """The pipeline's driver, with ``choose`` as the partition stage when given."""
    if choose is None:
        return run(traceable, options, checks)
    with collector_paused():
        joint = capture_stage(traceable, options, checks)
        if not joint.has_backward:
            partitioned = partition_stage(joint, options)
        else:
            partitioned = choose(joint)
            if options.check:
                check_partitioned(partitioned)
    return partitioned, compile_stage(partitioned, options)


class _Aliasing(Exception):
    """The first trace found outputs that alias (``args[0]``): trace again cloning them."""


def _check_joint(fn: Callable[..., Any], watch: Watch, first: bool, joint: JointGraph) -> None:
    """Refuse what a scan body cannot do; ``_Aliasing`` when the first trace must be done
    again (Note [Outputs that alias])."""
    if watch.replay is not None:
        stores = ", ".join(str(d) for d in watch.replay.descriptors)
        raise UnsupportedSideEffectError(
            format_error(
                f"the scan body stores tensors in the user's objects ({stores}); a scan runs"
                " its graphs once per step and cannot store each step's value there",
                user_frame_of_function(fn),
                "Return those tensors among the body's ys (scan stacks them), or store them"
                " outside the body.",
            )
        )
    aliasing = _aliasing_outputs(joint) if first else None
    if aliasing:
        raise _Aliasing(aliasing)
    _check_no_mutation(fn, joint)


def _example(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().contiguous().requires_grad_(requires_grad)


def differentiable(t: torch.Tensor) -> bool:
    """Can ``t`` hold a gradient (floating point or complex)?"""
    return t.is_floating_point() or t.is_complex()


def _checked(
    inner: Body,
    *,
    fn: Callable[..., Any],
    carry_spec: pytree.TreeSpec,
    carry: Sequence[torch.Tensor],
    clone: frozenset[int],
) -> Body:
    """``inner`` whose result is checked to be ``(carry, y)`` and has ``clone``'s leaves cloned."""

    @contextlib.contextmanager
    def body(primals: list[torch.Tensor]) -> Iterator[Any]:
        with inner(primals) as result:
            yield _checked_result(result, fn, carry_spec, carry, clone)

    return body


def _checked_result(
    result: Any,
    fn: Callable[..., Any],
    carry_spec: pytree.TreeSpec,
    carry: Sequence[torch.Tensor],
    clone: frozenset[int],
) -> Any:
    where = user_frame_of_function(fn)
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise ScanError(
            format_error(
                f"a scan body must return (carry, y), got {type(result).__name__}",
                where,
                "return a pair: the new carry and this iteration's output (None for no output)",
            )
        )
    new_carry, spec = pytree.tree_flatten(result[0])
    if spec != carry_spec:
        raise ScanError(
            format_error(
                f"the scan body changed the carry's structure: init is {carry_spec}, the body"
                f" returned {spec}",
                where,
                "return a carry with the same structure as init",
            )
        )
    for k, (old, new) in enumerate(zip(carry, new_carry, strict=True)):
        _check_carry_leaf(k, old, new, fn)
    leaves, spec = pytree.tree_flatten(tuple(result))
    for leaf in leaves:
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise ScanError(
                format_error(
                    f"the scan body returned {type(leaf).__name__} {leaf!r}; scan stacks"
                    " tensors only",
                    where,
                    "return tensors (or None) in y, and tensors in the carry",
                )
            )
    leaves = [t.clone() if k in clone and t is not None else t for k, t in enumerate(leaves)]
    return pytree.tree_unflatten(leaves, spec)


def _check_carry_leaf(k: int, old: Any, new: Any, fn: Callable[..., Any]) -> None:
    if (
        isinstance(new, torch.Tensor)
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
    ):
        return
    got = (
        f"shape {tuple(new.shape)}, dtype {new.dtype}, device {new.device}"
        if isinstance(new, torch.Tensor)
        else type(new).__name__
    )
    raise ScanError(
        format_error(
            f"the scan body changed carry leaf {k}: init has shape {tuple(old.shape)}, dtype"
            f" {old.dtype}, device {old.device}; the body returned {got}",
            user_frame_of_function(fn),
            "the carry must keep its shapes and dtypes across iterations (cast or reshape it"
            " back before returning it)",
        )
    )


# Note [Outputs that alias]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A body that returns its carry unchanged (``return carry, y``) or a view of it
# returns an output that aliases an input. Under ``aotgrad.trace`` such an output
# gets no cotangent of its own (autograd routes it through the view), but the
# loop feeds each iteration's carry cotangent straight into the backward graph.
# So when the first trace finds aliasing outputs, the body is traced again with
# those outputs cloned: every output is then fresh and has its own cotangent::
#
#     def fn(carry, x): return carry, carry * x      # output[0] aliases carry
#     traced again as:  return carry.clone(), carry * x
def _aliasing_outputs(joint: JointGraph) -> frozenset[int]:
    """Positions, among the result's leaves, of outputs that alias an input or another output."""
    return frozenset(
        k
        for k, leaf in enumerate(joint.leaves)
        if isinstance(leaf, TensorOutput) and (leaf.alias is not None or joint.bases)
    )


def _check_no_mutation(fn: Callable[..., Any], joint: JointGraph) -> None:
    state = joint.state_at_backward  # Note [State updated by the backward]
    if joint.mutations or joint.member_mutations or joint.input_bases or state:
        mutated = dict.fromkeys([*(m.index for m in joint.mutations), *state])
        names = ", ".join(str(joint.graph_inputs[i]) for i in mutated) or "inputs that share memory"
        raise ScanError(
            format_error(
                f"the scan body mutates {names} in place; a scan cannot replay that mutation"
                " once per iteration",
                user_frame_of_function(fn),
                "compute new values out of place and return them in the carry",
            )
        )


def _body_of(
    partitioned: Partitioned,
    compiled: CompiledGraphs,
    lifted: tuple[torch.Tensor, ...],
    num_carry: int,
    num_x: int,
    options: Options,
) -> ScanBody:
    signature = partitioned.signature
    outputs = signature.outputs_in_forward
    tensor_outputs = range(outputs.start, outputs.stop)
    forward_outputs = next(iter(reversed(partitioned.forward.graph.nodes))).args[0]
    y_positions = tuple(tensor_outputs[num_carry:])
    traced = Traced(
        partitioned=partitioned,
        _compiled=compiled,
        _lifted=lifted,
        _autocast=autocast_state(),
        _options=options,
    )
    return ScanBody(
        traced=traced,
        forward=compiled.forward,
        backward=compiled.backward,
        plan=compiled.plan,
        num_lifted=len(lifted),
        num_carry=num_carry,
        num_x=num_x,
        carry_in_forward=tuple(tensor_outputs[:num_carry]),
        y_in_forward=y_positions,
        y_spec=partitioned.joint.out_spec.children()[1],
        y_is_tensor=tuple(
            isinstance(leaf, TensorOutput) for leaf in partitioned.joint.leaves[num_carry:]
        ),
        y_examples=tuple(_meta(forward_outputs[p].meta["val"]) for p in y_positions),
        cotangent_of=tuple(
            _owner(signature.outputs.index(c.of), num_carry) for c in signature.cotangents
        ),
        random=any(is_random(n.target) for n in partitioned.forward.graph.nodes),
    )


def _meta(val: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return val.shape, val.dtype, val.device


def _owner(output: int, num_carry: int) -> tuple[str, int]:
    return ("carry", output) if output < num_carry else ("y", output - num_carry)
