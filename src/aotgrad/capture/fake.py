"""The fake tensor mode capture traces in: PyTorch's, with eager's strides for ``view``.

Note [Eager strides for views]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Fake tensors compute ``aten.view``'s result with a Python reference kernel
that agrees with eager on sizes but not always on the strides of size-1
dimensions. Those strides are invisible to the graph's math, but capture
records the layout of every output that views an input or another output,
and the runtime rebuilds it with ``as_strided`` (Note [Aliased outputs]):
the caller would see other strides than eager's. Worked example::

    a = torch.randn(1, 4, 2).permute(2, 1, 0)[1:]   # size (1, 4, 1), stride (1, 2, 8)
    a.view(1, 4, 1)   # eager (C++ computeStride): stride (8, 2, 8)
                      # fake (reference kernel):   stride (1, 2, 8)

So capture's fake mode asks the meta device, whose ``view`` is eager's C++
kernel, for the strides of each ``view`` (and ``_unsafe_view``, which
shares its kernel), and when they differ returns the fake result restrided
to eager's. For ``view`` and the common view ops (``t``, ``permute``,
``select``, ``slice`` ...) of static sizes it skips the fake mode's own kernels
(Python reference kernels, slow: ``bench/findings.md``) and returns the meta device's layout as an ``as_strided`` of the source. Symbolic layouts go through fake tensors' own Python port of
that C++ kernel (``_compute_stride``) instead: the meta device takes ints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from aotgrad._torch_compat import FakeTensor, FakeTensorMode, no_dispatch, view_stride
from aotgrad.capture.layouts import Layout, Layouts, fast_layouts
from aotgrad.capture.meta_kernels import run_meta

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
aten = torch.ops.aten
# Views the meta device lays out for the fake mode (Note [Eager strides for views]).
_META_VIEWS = frozenset(
    {
        aten.view.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.select.int,
        aten.slice.Tensor,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.expand.default,
    }
)


class CaptureFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` whose ``view`` strides are eager's (Note [Eager strides for views]),
    and which lays out some outputs without running decompositions (Note [Layouts without
    decompositions])."""

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
            return self._empty(layouts)
        viewed = _static_view(func, args, kwargs)
        if viewed is not None:  # Note [Eager strides for views]: eager's, straight away
            func, args, kwargs = torch.ops.aten.as_strided.default, viewed, {}
        out = run_meta(self, func, args, kwargs)  # Note [Straight to the meta kernel]
        if out is not None:
            return out
        out = super().dispatch(func, types, args, kwargs)
        if func not in _VIEWS or not isinstance(out, FakeTensor):
            return out
        source = args[0]
        assert isinstance(source, torch.Tensor)
        stride = _eager_view_stride(source, out.shape)
        if stride is None or all(map(statically_known_true, map(sym_eq, stride, out.stride()))):
            return out
        restrided = (source, out.shape, stride, source.storage_offset())
        return super().dispatch(torch.ops.aten.as_strided.default, types, restrided, {})

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
    if func not in _META_VIEWS or kwargs or not args:
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
    flat = [*source.shape, *source.stride(), source.storage_offset()]
    for a in rest:
        flat.extend(a if isinstance(a, list | tuple) else [a])
    return all(not isinstance(n, torch.Tensor | torch.SymInt) for n in flat) and all(
        isinstance(n, int) for n in flat[: 2 * source.dim() + 1]
    )


def _eager_view_stride(source: torch.Tensor, size: torch.Size) -> tuple[Any, ...] | None:
    """``source.view(size)``'s strides as eager computes them (None: not a view)."""
    layout = (*source.shape, *source.stride(), *size)
    if not all(isinstance(n, int) for n in layout):
        stride = view_stride(source.shape, source.stride(), size)
        return None if stride is None else tuple(stride)
    with no_dispatch():
        stand_in = torch.empty_strided(source.shape, source.stride(), device="meta")
        return tuple(stand_in.view(size).stride())
