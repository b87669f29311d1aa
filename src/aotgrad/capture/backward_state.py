"""Inputs the backward updates: a checkpointed region's state, updated again by its recompute.

Note [State updated by the backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.utils.checkpoint`` re-runs its region in the backward, side effects
included: a BatchNorm in training mode updates its running statistics in the
forward *and* again when the backward recomputes it (either flavour of
checkpoint; timm's ``set_grad_checkpointing()``, transformers'
``gradient_checkpointing_enable()``). The recompute reads the buffer as it is
*when the backward runs* (after the forward's update), and its batch
statistics are the forward's (same input). With momentum 0.1, one step from
``running_mean = 0`` on a batch of mean 1::

    eager forward:   running_mean = 0.9 * 0    + 0.1 * 1 = 0.1    num_batches_tracked = 1
    eager backward:  running_mean = 0.9 * 0.1  + 0.1 * 1 = 0.19   num_batches_tracked = 2
    forward only (no backward, or under no_grad): 0.1 and 1

Capture counts each input's mutations around the backward
(``backward_mutations``). A data mutation of an input that does not require
grad becomes *state updated by the backward*: the joint graph gets one more
placeholder per such input, ``StateAtBackward`` (its value when the backward
runs), after the cotangents, and every backward or recomputed use of the
input's value after the forward reads that placeholder instead; the input's
value after the backward is one more output, after the grads::

    forward:   (x, w, b, rm, rv, nbt) -> (..., new rm, new rv, new nbt, *saved)
    backward:  (*saved, cotangent, rm at backward, rv at backward, nbt at backward)
               -> (*grads, new rm, new rv, new nbt)

The runtime's Function keeps the input tensors (not their values) on ``ctx``,
hands their values to the backward graph when it runs, and writes the new
values into them afterwards. So the update happens exactly when, and as often
as, eager's recompute happens: never without a backward, once per backward
(``retain_graph=True`` and a second backward: twice, as in eager), and it
composes with whatever changed the buffer in between (two calls of the model,
then one backward of their sum: each backward reads the buffer as the other
left it). A mutation aotgrad cannot replay that way (of an input that
requires grad, or of its size or strides) is refused.

Eager's engine recomputes a region only when it runs one of the region's
backward nodes: not when no gradient reaches the region's outputs (another
output of the call got one), nor under ``torch.autograd.grad(..., inputs=)``
that needs nothing from the region. The compiled backward runs as one graph,
so capture records, per state input, where its region's backward starts
(``state_regions``): the first nodes downstream of the recompute that read a
cotangent, the cotangents that reach them, and the graph inputs whose
gradients they feed. The runtime writes a new value only when one of those
cotangents was given and the engine uses one of those gradients::

    def f(x):                        # x -> checkpoint(conv, bn) -> a;  x -> linear -> b
        return region(x), head(x)
    a, b = f(x); b.sum().backward()  # eager: no recompute; bn's stats updated once
    compiled: cotangent of a missing -> the region's new state is not written

A region is found by the trace's order: a checkpoint re-runs its region at
once, so the backward nodes no cotangent reaches that sit together with the
ops computing a new value (``num_batches_tracked + 1`` beside the BatchNorm)
are one recompute. Where the graphs cannot carry the state, aotgrad refuses:
``create_graph=True`` (``DoubleBackwardError``), ``export`` (``CallError``), a
scan body (``ScanError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotgrad._torch_compat import mutation_counter
from aotgrad.capture.provenance import Phase, phase_of, set_phase
from aotgrad.errors import UnsupportedMutationError, UserFrame, format_error
from aotgrad.signature import Descriptor, InputBase

Layout = tuple[tuple[object, ...], tuple[object, ...]]


def mutation_counts(primals: Sequence[torch.Tensor]) -> list[tuple[int, Layout]]:
    """Per (functional) primal: how many times functionalization has seen it mutated, and its
    size and strides."""
    return [
        (mutation_counter(p.elem), (tuple(p.shape), tuple(p.stride())))  # type: ignore[attr-defined]
        for p in primals
    ]


def backward_mutations(
    primals: Sequence[torch.Tensor],
    before: Sequence[tuple[int, Layout]],
    descriptors: Sequence[Descriptor],
    where: UserFrame | None,
) -> list[int]:
    """Graph input positions whose data the backward changed (Note [State updated by the
    backward]); refuse a change aotgrad cannot replay there."""
    changed = [
        i
        for i, (p, (count, _)) in enumerate(zip(primals, before, strict=True))
        if mutation_counter(p.elem) != count  # type: ignore[attr-defined]
    ]
    refused = [
        str(descriptors[i])
        for i in changed
        if primals[i].requires_grad
        or isinstance(descriptors[i], InputBase)
        or (tuple(primals[i].shape), tuple(primals[i].stride())) != before[i][1]
    ]
    if refused:
        named = ", ".join(refused[:3]) + (
            f" and {len(refused) - 3} more" if len(refused) > 3 else ""
        )
        raise UnsupportedMutationError(
            format_error(
                f"the backward mutates {named}: a checkpointed region that changes an input in"
                " place runs again when the backward recomputes it, and eager PyTorch changes"
                " the input a second time then; aotgrad replays that for the data of inputs"
                " that do not require grad (a BatchNorm's running statistics), not for an input"
                " that requires grad, several inputs sharing memory, or a change of size or"
                " strides (Note [State updated by the backward])",
                where,
                "Move the in-place change out of the checkpointed region, or turn gradient"
                " checkpointing off for the compiled model (aotgrad's partition= /"
                " aotgrad.budget choose what to recompute without it).",
            )
        )
    return changed


def read_state_at_backward(
    gm: fx.GraphModule, state: Sequence[int], after_forward: Sequence[fx.Node]
) -> None:
    """Add a ``StateAtBackward`` placeholder per input in ``state`` (graph input positions),
    after the cotangents; backward uses of the input's value after the forward
    (``after_forward``) read it instead (Note [State updated by the backward])."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for k, (index, value) in enumerate(zip(state, after_forward, strict=True)):
        with graph.inserting_after(last):
            last = graph.placeholder(f"state_{index}_{k}")
        last.meta["val"] = value.meta.get("val")
        set_phase(last, Phase.BACKWARD)
        for user in list(value.users):
            if user.op != "output" and phase_of(user) in (Phase.BACKWARD, Phase.RECOMPUTE):
                user.replace_input_with(value, last)


@dataclass(frozen=True)
class StateRegion:
    """Where the backward of the region that updates one state input runs (Note [State
    updated by the backward])."""

    # Bit ``j``: cotangent ``j`` reaches the region's backward.
    cotangents: int
    # Graph input positions whose gradients the region's backward feeds.
    feeds: tuple[int, ...]


def state_regions(
    graph: fx.Graph,
    cotangents: Sequence[fx.Node],
    new_state: Sequence[fx.Node],
    grads: Sequence[fx.Node | None],
) -> list[StateRegion]:
    """Per new state value: its region's backward (Note [State updated by the backward])."""
    masks: dict[fx.Node, int] = {node: 1 << k for k, node in enumerate(cotangents)}
    for node in graph.nodes:
        mask = masks.get(node, 0)
        for value in node.all_input_nodes:
            mask |= masks.get(value, 0)
        masks[node] = mask
    runs = _recompute_runs(graph, masks)
    return [_region(value, masks, runs, grads) for value in new_state]


def _recompute_runs(graph: fx.Graph, masks: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Backward nodes no cotangent reaches, numbered by the run of such nodes they sit in,
    in the trace's order: one run per recompute (a checkpoint re-runs its region at once,
    ``num_batches_tracked.add_(1)`` beside the BatchNorm it counts for)."""
    runs: dict[fx.Node, int] = {}
    run = 0
    for node in graph.nodes:
        inside = node.op == "call_function" and not masks[node]
        if inside and phase_of(node) is not Phase.FORWARD:
            runs[node] = run
        else:
            run += 1
    return runs


def _region(
    new_value: fx.Node,
    masks: dict[fx.Node, int],
    runs: dict[fx.Node, int],
    grads: Sequence[fx.Node | None],
) -> StateRegion:
    # The recompute: the runs that compute the new value.
    quiet, stack = set(), [new_value]
    while stack:
        node = stack.pop()
        if node in quiet or node not in runs:
            continue
        quiet.add(node)
        stack.extend(node.all_input_nodes)
    mine = {runs[n] for n in quiet}
    quiet |= {n for n, run in runs.items() if run in mine}
    # Downstream through values no cotangent reaches; the first that one reaches start the
    # region's backward.
    starts: set[fx.Node] = set()
    stack = list(quiet)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "output" or user in quiet:
                continue
            if masks[user]:
                starts.add(user)
            else:
                quiet.add(user)
                stack.append(user)
    cotangents = 0
    for node in starts:
        cotangents |= masks[node]
    return StateRegion(cotangents, _feeds(starts, grads))


def _feeds(starts: set[fx.Node], grads: Sequence[fx.Node | None]) -> tuple[int, ...]:
    """Positions of the grads computed from ``starts``."""
    seen, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(u for u in node.users if u.op != "output")
    return tuple(i for i, g in enumerate(grads) if g is not None and g in seen)


__all__ = [
    "StateRegion",
    "backward_mutations",
    "mutation_counts",
    "read_state_at_backward",
    "state_regions",
]
