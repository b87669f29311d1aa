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
to eager's. Symbolic layouts go through fake tensors' own Python port of
that C++ kernel (``_compute_stride``) instead: the meta device takes ints.
This is the one thing capture changes in PyTorch's fake mode for
correctness; the fast path adds its speed shortcuts on top (Note [The fast
path as a layer]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aotgrad._torch_compat import FakeTensor, FakeTensorMode, no_dispatch, view_stride

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class EagerViewsFakeMode(FakeTensorMode):
    """PyTorch's ``FakeTensorMode``, with eager's ``view`` strides (Note [Eager strides for views])."""

    def dispatch(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = super().dispatch(func, types, args, kwargs or {})
        if func not in _VIEWS or not isinstance(out, FakeTensor):
            return out
        source = args[0]
        assert isinstance(source, torch.Tensor)
        stride = _eager_view_stride(source, out.shape)
        if stride is None or _same_strides(stride, out.stride()):
            return out
        restrided = (source, out.shape, stride, source.storage_offset())
        return super().dispatch(torch.ops.aten.as_strided.default, types, restrided, {})


def _eager_view_stride(source: torch.Tensor, size: torch.Size) -> tuple[Any, ...] | None:
    """``source.view(size)``'s strides as eager computes them (None: not a view)."""
    layout = (*source.shape, *source.stride(), *size)
    if not all(isinstance(n, int) for n in layout):
        stride = view_stride(source.shape, source.stride(), size)
        return None if stride is None else tuple(stride)
    with no_dispatch():
        stand_in = torch.empty_strided(source.shape, source.stride(), device="meta")
        return tuple(stand_in.view(size).stride())


def _same_strides(expected: Sequence[Any], found: Sequence[Any]) -> bool:
    """Equal strides; symbolic ones only when provably equal (their module loads with symbols)."""
    if all(type(v) is int for v in (*expected, *found)):
        return tuple(expected) == tuple(found)
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return all(map(statically_known_true, map(sym_eq, expected, found)))
