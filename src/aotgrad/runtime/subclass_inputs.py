"""The caller's tensor subclass inputs changed as the function changed them.

Note [Subclass inputs rebased]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The Function takes a subclass input's inner tensors (Note [Tensor
subclasses]); the epilogue leaves those inner graph inputs alone and hands
their replays here, where they reach the caller's own tensors
(Note [Subclass inputs changed in place] in ``capture/analyses/subclass_inputs.py``).
For ``x.mul_(2); x.t_()`` on a non-leaf ``x = TwoTensor(a, b)``::

    x.a.as_strided_((3, 2), (1, 3), 0)     inner metadata, under no_grad, the version
    x.b.as_strided_((3, 2), (1, 3), 0)     kept (Note [Replayed metadata keeps the version])
    x.as_strided_((3, 2), (1, 3), 0)       the wrapper's own metadata, below its
                                           __torch_dispatch__ (which would restride a and b
                                           again, with the outer's geometry)
    _Rebase(x, new a, new b)               writes the new values into x.a, x.b and marks x
                                           dirty: x's history is now the new values', whose
                                           cotangents the backward graph takes

The inner tensors were given to the Function as views (``_Unwrap``), so
restriding those would not reach ``x.a``; and an inner tensor requires no grad,
so a ``copy_`` into it would leave ``x``'s history that of the old value (the
gradient of a later use of ``x`` silently skips the ``mul_``). Without grad
(``x`` requires none, or the change ran under ``no_grad``) the new values are
copied into ``x.a``, ``x.b`` and ``x``'s version moves on, as eager's in-place
op on ``x`` moves it; a metadata change with grad restrides ``x`` with grad
mode on, recording the change on ``x``'s history, as for a plain input. A
``x.resize_((4, 3))`` that grew the inner tensors grew the wrapper's own
storage in eager too (its ``__torch_dispatch__`` resizes it below itself):
the replay resizes it before restriding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aotgrad._torch_compat import DisableTorchDispatch
from aotgrad.capture.analyses.aliasing import ViewMeta
from aotgrad.capture.analyses.mutation import InputMutation
from aotgrad.runtime.function import _replay_mutation
from aotgrad.signature.subclasses import (
    InputChange,
    Layout,
    Subclasses,
    SubclassMeta,
    inner_tensors,
    rebase,
)


class SubclassReplay:
    """One call's subclass inputs, to be changed as the trace found them."""

    def __init__(self, subclasses: Subclasses, primals: Sequence[torch.Tensor]) -> None:
        self.inputs = [
            (p, meta, change)
            for p, meta, change in zip(primals, subclasses.metas, subclasses.changes, strict=True)
            if meta is not None and change is not None
        ]
        # Inner graph input positions whose replays are this object's.
        self.positions = frozenset(i for _, _, c in self.inputs for i in c.positions)
        self._written: dict[int, tuple[InputMutation, torch.Tensor | None]] = {}

    def take(self, mutation: InputMutation, new: torch.Tensor | None) -> None:
        """Keep an inner input's mutation and new value, for :meth:`replay`."""
        self._written[mutation.index] = (mutation, new)

    def replay(self) -> None:
        for x, meta, change in self.inputs:
            _replay(x, meta, change, self._written)


def _replay(
    x: torch.Tensor,
    meta: SubclassMeta,
    change: InputChange,
    written: dict[int, tuple[InputMutation, torch.Tensor | None]],
) -> None:
    """Change the caller's ``x`` as the function changed it (Note [Subclass inputs rebased])."""
    inner = inner_tensors(x, meta)
    for t, layout in zip(inner, change.inner_layouts, strict=True):
        if layout is not None:
            _restride(t, layout)
    if change.layout is not None:
        size, stride, offset = change.layout
        with DisableTorchDispatch(), torch.set_grad_enabled(change.with_grad):
            needed = ViewMeta(size, stride, offset).extent * x.element_size()
            if needed > x.untyped_storage().nbytes():  # x.resize_(...) grew the wrapper too
                with torch.no_grad():
                    x.resize_(needed // x.element_size())
            x.as_strided_(size, stride, offset)
    news = [written[i][1] if i in written else None for i in change.positions]
    if all(n is None for n in news):
        return
    if change.with_grad:
        rebase(x, news)
        return
    with torch.no_grad():
        for t, new in zip(inner, news, strict=True):
            if new is not None:
                t.copy_(new)
    torch.autograd.graph.increment_version(x)


def _restride(t: torch.Tensor, layout: Layout) -> None:
    """An inner tensor's new layout: under no_grad, its version kept, its storage grown if
    needed (Note [Replayed metadata keeps the version])."""
    mutation = InputMutation(
        index=-1, data=False, metadata=ViewMeta(*layout), with_grad=False, requires_grad=False
    )
    _replay_mutation(t, mutation, None)
