"""Inputs the backward updates: a checkpointed region's state, updated again by its recompute,
and inputs a custom Function's backward changes in place.

Note [State updated by the backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two kinds of user code change an input in place while eager's backward runs.

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

A custom ``autograd.Function``'s backward may change a tensor it saved (or
keeps on ``ctx``), an input requiring grad or not; eager changes the caller's
tensor when that backward runs, and the gradients read the changed value::

    class Fn(torch.autograd.Function):
        def forward(ctx, x): ctx.save_for_backward(x); return x * 3
        def backward(ctx, g): (x,) = ctx.saved_tensors; x.mul_(2); return g * x
    f = lambda x, y: Fn.apply(x) * y;  x = y = ones(3) requiring grad
    f(x, y).sum().backward()   # eager: x = 2, x.grad = 1 * 2 = 2, y.grad = 3

Capture counts each input's mutations around the backward
(``backward_mutations``), and the recorder notes what made each one
(``BackwardSite``: a recompute, the running custom Function's backward, or a
hook). A data mutation becomes *state updated by the backward*: the joint
graph gets one more placeholder per such input, ``StateAtBackward`` (its value
when the backward runs), after the cotangents, and every backward or
recomputed use of the input's value after the forward reads that placeholder
instead; the input's value after the backward is one more output, after the
grads::

    forward:   (x, w, b, rm, rv, nbt) -> (..., new rm, new rv, new nbt, *saved)
    backward:  (*saved, cotangent, rm at backward, rv at backward, nbt at backward)
               -> (*grads, new rm, new rv, new nbt)
    Fn above:  backward (cotangent, x at backward) -> (mul(x at backward, 2) * ..., ...,
               new value of x = mul(x at backward, 2))

The runtime's Function keeps the input tensors (not their values) on ``ctx``,
hands their values to the backward graph when it runs, and writes the new
values into them afterwards (``copy_`` under ``no_grad``, as eager's backward
runs with grad mode off: allowed on a leaf that requires grad). So the update
happens exactly when, and as often as, eager's happens: never without a
backward, once per backward (``retain_graph=True`` and a second backward:
twice, as in eager), and it composes with whatever changed the buffer in
between (two calls of the model, then one backward of their sum: each backward
reads the buffer as the other left it).

Eager checks the version of every tensor a node saved when the node unpacks
it. A tensor the custom Function saved (or another node saved: ``Fn.apply(x)
* x``) and the backward changes is unpacked again by a second backward
(``retain_graph=True``) after the change, and eager raises "one of the
variables needed for gradient computation has been modified by an inplace
operation"; so does a change by the caller between forward and backward. The
traced backward retains its graph, so capture reads, without unpacking, what
every node saved (``saved_by_nodes``); an input one of them holds is
``StateRegion.saved``: the runtime notes its version as eager saves it (after
the epilogue's replay of a change the forward made: ``x.add_(1)`` then
``Fn.apply(x)`` saves version 1) and raises eager's error
(``SavedVersionError``, a ``RuntimeError``) when the backward finds another
one. (A Function inside a checkpointed region saves
through the checkpoint's hooks, which hide the tensor: taken as saved, as the
checkpoint saves its inputs.) A buffer the Function keeps as ``ctx.buf``, that
no node saved, is not checked and changes twice, as in eager.

Eager runs a backward only when it runs its autograd node: not when no
gradient reaches the node's outputs (another output of the call got one), nor
under ``torch.autograd.grad(..., inputs=)`` that needs nothing from it. The
compiled backward runs as one graph, so capture records, per state input,
where its backward starts (``state_regions``): the cotangents that reach it
and the graph inputs whose gradients it feeds. The runtime writes a new value
only when one of those cotangents was given and the engine uses one of those
gradients::

    def f(x):                        # x -> checkpoint(conv, bn) -> a;  x -> linear -> b
        return region(x), head(x)
    a, b = f(x); b.sum().backward()  # eager: no recompute; bn's stats updated once
    compiled: cotangent of a missing -> the region's new state is not written

A custom Function's backward is the backward ops carrying its node's sequence
number (``Fn``'s ``mul(x, 2)`` and ``g * x``, even when the change feeds no
gradient, ``ctx.buf.add_(1)``). A recompute is found by the trace's order: a
checkpoint re-runs its region at once, so the backward nodes no cotangent
reaches that sit together with the ops computing a new value
(``num_batches_tracked + 1`` beside the BatchNorm) are one recompute.

Where the graphs cannot carry the change, aotgrad refuses and names what
makes it (the Function's class and the line of the in-place op, a hook, or
the checkpointed region): a change of size or strides, of inputs sharing
memory, a change made by a hook (tensor hooks run before the node they belong
to, outside any node the trace can attribute them to), a real tensor that is
no input (``capture/user_state/closed_over.py``: the capture would write it), ``create_graph=True``
through a change of an input that requires grad or a checkpoint's recompute
(``DoubleBackwardError``; for a leaf that requires grad eager raises there
too), ``export`` (``CallError``), a scan body (``ScanError``). Under
``create_graph=True`` a custom Function's change of inputs that do not require
grad is replayed: the differentiable backward ``G`` reads their values at
backward as inputs (Note [Differentiable backward]), and the runtime writes
the new values the first-order backward graph computes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import mutation_counter, saved_data
from aotgrad.capture.provenance import Phase, node_info, phase_of, set_phase
from aotgrad.errors import UnsupportedMutationError, UserFrame, format_error
from aotgrad.signature import Descriptor, InputBase

Layout = tuple[tuple[object, ...], tuple[object, ...]]

# torch.utils.checkpoint's file, matched by its tail (importing it here would load it with
# aotgrad).
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")

# What a refusal tells the user to do, by what changed the input.
_RECOMPUTE_TODO = (
    "Move the in-place change out of the checkpointed region, or turn gradient checkpointing"
    " off for the compiled model (aotgrad's partition= / aotgrad.budget choose what to"
    " recompute without it)."
)
_BACKWARD_TODO = (
    "Change a copy in the backward (x = x.clone()), or make the change outside the compiled"
    " function."
)


@dataclass(frozen=True)
class BackwardSite:
    """What changed a tensor in place while the traced backward ran (Note [State updated by
    the backward])."""

    # What ran the in-place op: "the backward of custom autograd.Function Scale", "a
    # checkpointed region's recompute", "a hook running in the backward (MulBackward0)".
    what: str
    # The user's line of the in-place op.
    where: UserFrame | None
    # "recompute" (``torch.utils.checkpoint`` re-running its region: on the stack),
    # "function" (a custom Function's backward) or "hook" (anything else).
    kind: str
    # The running custom Function's saved tensors went through saved-tensor hooks (a
    # checkpointed region's): which tensors they stand for is not known, so the change is
    # taken as one of a saved tensor (eager's version check on a later unpack: loud at worst).
    hooked: bool = False

    @staticmethod
    def of(node: Any, where: UserFrame | None) -> BackwardSite:
        """The site of an in-place op while autograd node ``node`` (None: no
        node) runs in the traced backward."""
        if _in_checkpoint():
            return BackwardSite("a checkpointed region's recompute", where, "recompute")
        function = getattr(node, "_forward_cls", None)
        if function is None:
            name = "" if node is None else f" ({type(node).__name__})"
            return BackwardSite(f"a hook running in the backward{name}", where, "hook")
        what = f"the backward of custom autograd.Function {function.__qualname__}"
        hooked = any(not isinstance(data, torch.Tensor) for data in saved_data(node))
        return BackwardSite(what, where, "function", hooked)


def _in_checkpoint() -> bool:
    """Is ``torch.utils.checkpoint`` re-running a region (either flavour) on this stack?"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


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
    sites: Mapping[int, BackwardSite],
) -> list[int]:
    """Graph input positions whose data the backward changed (Note [State updated by the
    backward]); refuse a change aotgrad cannot replay there, naming what made it."""
    changed = [
        i
        for i, (p, (count, layout)) in enumerate(zip(primals, before, strict=True))
        if mutation_counter(p.elem) != count  # type: ignore[attr-defined]
        or (tuple(p.shape), tuple(p.stride())) != layout  # t_(): no data changed
    ]
    for i in changed:
        site = site_of(primals[i], sites)
        if isinstance(descriptors[i], InputBase):
            why = "it shares memory with another input, which aotgrad does not replay there"
        elif (tuple(primals[i].shape), tuple(primals[i].stride())) != before[i][1]:
            why = "it changes its size or strides, which aotgrad does not replay there"
        elif site is not None and site.kind == "hook":
            why = (
                "aotgrad replays changes made by a custom Function's backward or a"
                " checkpoint's recompute, not by hooks"
            )
        else:
            continue
        what = "the backward" if site is None else site.what
        todo = _RECOMPUTE_TODO if site is not None and site.kind == "recompute" else _BACKWARD_TODO
        raise UnsupportedMutationError(
            format_error(
                f"{what} changes {descriptors[i]} in place, and {why}"
                " (Note [State updated by the backward])",
                where if site is None or site.where is None else site.where,
                todo,
            )
        )
    return changed


def saved_by_nodes(primals: Sequence[torch.Tensor], nodes: Sequence[Any]) -> list[bool]:
    """Per primal: did an autograd node save it (or a view of it)? Eager checks its version
    at every unpack (Note [State updated by the backward])."""
    ids = set()
    for node in nodes:
        for data in saved_data(node):
            ids.add(id(data))
            if isinstance(data, torch.Tensor) and data._base is not None:
                ids.add(id(data._base))
    return [id(p) in ids for p in primals]


def site_of(primal: torch.Tensor, sites: Mapping[int, BackwardSite]) -> BackwardSite | None:
    """What changed ``primal`` in the backward: the site noted on it, else (it was changed
    through a view) the first noted site."""
    return sites.get(id(primal), next(iter(sites.values()), None))


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
    """Where the backward that updates one state input runs (Note [State updated by the
    backward])."""

    # Bit ``j``: cotangent ``j`` reaches the region's backward.
    cotangents: int
    # Graph input positions whose gradients the region's backward feeds.
    feeds: tuple[int, ...]
    # An autograd node saved the input: the runtime checks its version as eager's unpack
    # would, so that a later change (a second backward, the caller's) raises as in eager.
    saved: bool = False
    # What changes the input, for messages ("the backward of custom autograd.Function
    # Scale at model.py:12"); empty: a checkpointed region's recompute.
    what: str = ""


def state_regions(
    graph: fx.Graph,
    cotangents: Sequence[fx.Node],
    new_state: Sequence[fx.Node],
    grads: Sequence[fx.Node | None],
    sites: Sequence[BackwardSite | None],
    saved: Sequence[bool],
) -> list[StateRegion]:
    """Per new state value: its region's backward (Note [State updated by the backward])."""
    masks: dict[fx.Node, int] = {node: 1 << k for k, node in enumerate(cotangents)}
    for node in graph.nodes:
        mask = masks.get(node, 0)
        for value in node.all_input_nodes:
            mask |= masks.get(value, 0)
        masks[node] = mask
    runs = _recompute_runs(graph, masks)
    regions = []
    for value, site, is_saved in zip(new_state, sites, saved, strict=True):
        function = site is not None and site.kind == "function"
        starts = _node_backward(graph, value) if function else None
        if starts is None:  # a checkpoint's recompute
            region = _region(value, masks, runs, grads)
        else:
            mask = 0
            for node in starts:
                mask |= masks[node]
            region = StateRegion(mask, _feeds(starts, grads))
        if site is not None and function:
            where = "" if site.where is None else f" at {site.where.filename}:{site.where.lineno}"
            region = replace(region, what=site.what + where)
        regions.append(replace(region, saved=is_saved))
    return regions


def _node_backward(graph: fx.Graph, new_value: fx.Node) -> set[fx.Node] | None:
    """The backward ops of the autograd node whose backward computed ``new_value``: those with
    its sequence number (None: it has none)."""
    seq = node_info(new_value).seq_nr if new_value.op == "call_function" else None
    if seq is None:
        return None
    return {
        n
        for n in graph.nodes
        if n.op == "call_function" and phase_of(n) is Phase.BACKWARD and node_info(n).seq_nr == seq
    }


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
    "BackwardSite",
    "StateRegion",
    "backward_mutations",
    "mutation_counts",
    "read_state_at_backward",
    "saved_by_nodes",
    "site_of",
    "state_regions",
]
