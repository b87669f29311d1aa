"""Tensor subclass inputs the function changes in place, read as a whole.

Note [Subclass inputs changed in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The graphs see a subclass input's inner tensors (Note [Tensor subclasses]),
so functionalization reports an in-place op on ``x = TwoTensor(a, b)`` as
mutations of ``x.a`` and ``x.b``. That is not all eager leaves behind: the
caller's ``x`` itself is changed too, and the trace reads that off the
rebuilt ``x`` the body ran on:

- its size, stride and storage offset (``x.t_()``, ``x.unsqueeze_(0)``): a
  wrapper keeps its own metadata beside its inner tensors';
- its autograd history, when grad mode was on and ``x`` requires grad: an
  in-place op records a node on ``x``, not on ``x.a``, which requires no grad.

Worked example, ``x`` a non-leaf ``TwoTensor`` of shape (2, 3) requiring grad::

    def f(x):
        x.mul_(2)            # inner: data mutations of x.a and x.b
        x.t_()               # inner: metadata mutations; outer: (3, 2), strides (1, 3)
        return x + 1

    trace:    new values of x.a, x.b are taken from the rebuilt x, through its
              history (MulBackward, TBackward): they get cotangents
    epilogue: x.a.as_strided_((3, 2), (1, 3), 0), the same for x.b
              x.as_strided_((3, 2), (1, 3), 0)   on x alone, below its __torch_dispatch__
              x's new values written in, x's history now that of the new values
              (Note [Subclass inputs rebased] in runtime/subclass_inputs.py)

Eager's rules apply to the outer tensor: an in-place op with grad mode on, on
a leaf that requires grad, raises ``InPlaceOnLeafError`` at the user's line
(the inner tensors, leaves of the trace, could not tell). A change with grad
that writes only some of the inner tensors is refused: the untouched ones'
gradient would have no path to the old ``x``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from aotgrad.capture.analyses.aliasing import ViewMeta
from aotgrad.capture.analyses.mutation import InputMutation
from aotgrad.errors import InPlaceOnLeafError, UnsupportedMutationError, UserFrame, format_error
from aotgrad.signature.descriptors import Inner, PrimalDescriptor
from aotgrad.signature.subclasses import (
    InputChange,
    Layout,
    Subclasses,
    TracedInput,
    inner_tensors,
    meta_of,
    unwrapped,
)

# New values standing in for mutated inner graph inputs, by graph input position.
StandIns = dict[int, torch.Tensor]


def subclass_input_changes(
    subclasses: Subclasses,
    mutations: Sequence[InputMutation],
    sources: Sequence[tuple[int, ViewMeta | None]],
    graph_primals: Sequence[torch.Tensor],
    descriptors: Sequence[PrimalDescriptor],
    sites: Mapping[int, UserFrame | None],
    where: UserFrame | None,
) -> tuple[list[InputMutation], StandIns]:
    """Record how each subclass input changed as a whole (``subclasses.changes``); return the
    mutations with the new values that take the outer history marked differentiable, and those
    values (Note [Subclass inputs changed in place])."""
    changes: list[InputChange | None] = []
    out = list(mutations)
    stand_ins: StandIns = {}
    for traced, flat in zip(subclasses.traced, subclasses.inner_positions(), strict=True):
        if traced is None:
            changes.append(None)
            continue
        positions = tuple(sources[j][0] for j in flat)
        name = _outer_name(descriptors[flat[0]])
        change = _change_of(traced, positions, out, graph_primals, name, sites, where)
        if change is not None and any(sources[j][1] is not None for j in flat):
            _check_through_a_base(change, name, where)
            change = None  # the base's replay writes the data
        changes.append(change)
        if change is not None and change.with_grad:
            _take_new_values(traced.traced, change.positions, out, stand_ins, name, where)
    subclasses.changes[:] = changes
    return out, stand_ins


def _change_of(
    traced: TracedInput,
    positions: tuple[int, ...],
    mutations: Sequence[InputMutation],
    graph_primals: Sequence[torch.Tensor],
    name: str,
    sites: Mapping[int, UserFrame | None],
    where: UserFrame | None,
) -> InputChange | None:
    layout = _changed(traced.real, traced.traced)
    meta = meta_of(traced.real)
    assert meta is not None
    pairs = zip(inner_tensors(traced.real, meta), inner_tensors(traced.traced, meta), strict=True)
    inner_layouts = tuple(_changed(real, t) for real, t in pairs)
    written = any(m.index in positions for m in mutations)
    with_grad = traced.traced.grad_fn is not traced.grad_fn_before
    if not (written or with_grad or layout or any(inner_layouts)):
        return None
    if with_grad and traced.real.is_leaf and traced.real.requires_grad:
        site = next((s for p in positions if (s := sites.get(id(graph_primals[p])))), None)
        raise InPlaceOnLeafError(
            format_error(
                f"a leaf Variable that requires grad ({name}) is being used in an in-place"
                " operation (eager PyTorch raises the same error)",
                site or where,
                "Mutate a copy (x = x.clone(); x.mul_(2)), or wrap the update in"
                " torch.no_grad() if it must not be differentiated.",
            )
        )
    return InputChange(
        layout=layout,
        inner_layouts=inner_layouts,
        with_grad=with_grad and traced.traced.requires_grad,
        positions=positions,
    )


def _check_through_a_base(change: InputChange, name: str, where: UserFrame | None) -> None:
    """A change of a subclass input whose inner tensors a synthetic base stands for: the
    base's replay writes its data (Note [Inputs sharing memory without a common base]); a
    change of its layout or history is refused."""
    if change.layout is None and not any(change.inner_layouts) and not change.with_grad:
        return
    raise UnsupportedMutationError(
        format_error(
            f"the function changes the shape, strides or autograd history of the tensor"
            f" subclass input {name} in place, and its inner tensors share memory with another"
            " input's",
            where,
            "Clone the inputs before the call.",
        )
    )


def _take_new_values(
    traced: torch.Tensor,
    positions: tuple[int, ...],
    mutations: list[InputMutation],
    stand_ins: StandIns,
    name: str,
    where: UserFrame | None,
) -> None:
    """Mark the input's inner new values differentiable, taken from the rebuilt input through its
    history; a change with grad that writes some inner tensors and not others is refused."""
    written = {m.index for m in mutations if m.data and m.index in positions}
    if not written:
        return  # a metadata change alone: replayed on the outer tensor with grad
    if written != set(positions):
        raise UnsupportedMutationError(
            format_error(
                f"the function changes the tensor subclass input {name} in place with grad mode"
                " on, writing some of its inner tensors and not others; aotgrad cannot give"
                " the untouched ones' gradient a path to the old value",
                where,
                "Clone the input inside the function (x = x.clone()) before changing it.",
            )
        )
    pieces = unwrapped(traced)
    for k, m in enumerate(mutations):
        if m.index in written:
            mutations[k] = replace(m, requires_grad=True)
            stand_ins[m.index] = pieces[positions.index(m.index)]


def _changed(before: torch.Tensor, after: torch.Tensor) -> Layout | None:
    """``after``'s layout, when it differs from ``before``'s."""
    old, new = ViewMeta.of(before), ViewMeta.of(after)
    return None if old == new else (new.size, new.stride, new.storage_offset)


def _outer_name(descriptor: PrimalDescriptor) -> str:
    """The subclass input an inner tensor's descriptor names (``x`` for ``x.a``)."""
    while isinstance(descriptor, Inner):
        descriptor = descriptor.of
    return str(descriptor)
