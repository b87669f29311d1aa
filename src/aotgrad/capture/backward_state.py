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

Two cases still differ from eager: the graph runs the whole backward, so a
region whose outputs no received cotangent reaches (eager's engine would not
visit it) still updates its state when another output of the same call gets a
gradient; and ``torch.autograd.grad`` asked for some inputs only does not
prune the recompute as eager's engine does.
"""

from __future__ import annotations

from collections.abc import Sequence

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


__all__ = ["backward_mutations", "mutation_counts", "read_state_at_backward"]
