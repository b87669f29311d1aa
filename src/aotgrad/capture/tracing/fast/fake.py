"""The fast path's fake mode: layouts by rule, static views on the meta device (eager's
kernel, where the fake mode's are Python references) and ops straight on their meta kernels
(Notes [Layouts without decompositions], [Eager strides for views], [Straight to the meta kernel])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aotgrad._torch_compat import FakeTensor, no_dispatch
from aotgrad.capture.tracing.fake import EagerViewsFakeMode
from aotgrad.capture.tracing.fast.layouts import Layout, Layouts, fast_layouts
from aotgrad.capture.tracing.fast.meta_kernels import open_lists, run_meta
from aotgrad.capture.tracing.fast.view_writes import VIEWS


class FastFakeMode(EagerViewsFakeMode):
    """Capture's fake mode with the fast path's shortcuts (Note [The fast path as a layer])."""

    def dispatch(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        layouts = fast_layouts(func, args, kwargs)
        if layouts is not None:
            return self.eager_layouts(func, types, args, kwargs, self._empty(layouts))
        viewed = _static_view(func, args, kwargs)
        if viewed is not None:  # Note [Eager strides for views]: eager's, straight away
            func, args, kwargs = torch.ops.aten.as_strided.default, viewed, {}
        out = run_meta(self, func, args, kwargs)  # Note [Straight to the meta kernel]
        if out is None:
            return super().dispatch(func, types, args, kwargs)
        return self.eager_layouts(func, types, args, kwargs, out)

    def _empty(self, layouts: Layouts) -> object:
        """Fresh fake tensors of the given layouts (None stays None)."""
        made = [None if layout is None else self._fresh(layout) for layout in layouts.tensors]
        return tuple(made) if layouts.as_tuple else made[0]

    def _fresh(self, layout: Layout) -> FakeTensor:
        with no_dispatch():
            meta = torch.empty_strided(
                layout.shape, layout.strides, dtype=layout.dtype, device="meta"
            )
        return self.fake_tensor_converter.from_meta_and_device(self, meta, layout.device)


def _static_view(
    func: Any, args: Sequence[object], kwargs: Mapping[str, object] | None
) -> tuple[Any, ...] | None:
    """A view op of static sizes (``view``, ``t``, ``select`` ...) as ``as_strided`` arguments,
    laid out by the meta device's (eager's) kernel; None for anything else, or a view eager
    refuses (the fake mode then raises its error)."""
    rule = VIEWS.get(func)
    if rule is None or not rule.meta_layout or kwargs or not args:
        return None
    source, rest = args[0], args[1:]
    if not isinstance(source, FakeTensor) or source.layout is not torch.strided:
        return None
    if not _static(source, rest) or source.numel() == 0:
        return None
    with no_dispatch():
        extent = sum((n - 1) * st for n, st in zip(source.shape, source.stride(), strict=True))
        memory = torch.empty(source.storage_offset() + extent + 1, device="meta")
        stand_in = memory.as_strided(source.shape, source.stride(), source.storage_offset())
        try:
            view = func(stand_in, *rest)
        except (RuntimeError, IndexError):
            return None
        return (source, tuple(view.shape), tuple(view.stride()), view.storage_offset())


def _static(source: torch.Tensor, rest: Sequence[object]) -> bool:
    """No symbolic size anywhere, no tensor among the other arguments."""
    flat = [*source.shape, *source.stride(), source.storage_offset(), *open_lists(rest)]
    return all(not isinstance(n, torch.Tensor | torch.SymInt) for n in flat) and all(
        isinstance(n, int) for n in flat[: 2 * source.dim() + 1]
    )
