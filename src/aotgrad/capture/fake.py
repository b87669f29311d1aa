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
Capture also corrects the sizes of the few kernels whose meta function
disagrees with eager (Note [Eager sizes of resizing kernels]); the fast path
adds its speed shortcuts on top (Note [The fast path as a layer]).

Note [Eager sizes of resizing kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``fused_moving_avg_obs_fake_quant`` (QAT's ``FusedMovingAvgObsFakeQuantize``)
with a per-channel observer resizes ``running_min``, ``running_max``,
``scale`` and ``zero_point`` to one entry per channel of ``x`` (along
``ch_axis``) before writing them; its meta function returns them at the
sizes they came with. The sizes depend on ``x``'s shape and the flag only,
never on data, so capture gives the functional op's results eager's sizes
(the input is then replayed as resized: Note [Inputs a kernel resizes])::

    x: (4, 3, 3, 3), ch_axis 0, per_row_fake_quant=True, scale: (1,)
    meta:  scale' (1,)      eager: scale resized to (4,)      capture: scale' (4,)
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
        if func in _EAGER_SIZES:
            return self.eager_sizes(func, types, args, kwargs or {}, out)
        if func not in _VIEWS or not isinstance(out, FakeTensor):
            return out
        source = args[0]
        assert isinstance(source, torch.Tensor)
        stride = _eager_view_stride(source, out.shape)
        if stride is None or _same_strides(stride, out.stride()):
            return out
        restrided = (source, out.shape, stride, source.storage_offset())
        return super().dispatch(torch.ops.aten.as_strided.default, types, restrided, {})

    def eager_sizes(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object],
        kwargs: Mapping[str, object],
        out: object,
    ) -> object:
        """``out``, at eager's sizes where ``func``'s meta function gives others (Note [Eager
        sizes of resizing kernels])."""
        resize = _EAGER_SIZES.get(func)
        return out if resize is None else resize(self, types, args, kwargs, out)

    def new_empty(self, types: Sequence[type], like: torch.Tensor, size: list[Any]) -> object:
        """A fake tensor of ``size``, with ``like``'s dtype and device."""
        return super().dispatch(torch.ops.aten.new_empty.default, types, (like, size), {})


def _fused_observer_sizes(
    mode: EagerViewsFakeMode,
    types: Sequence[type],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    out: Any,
) -> object:
    """``_fused_moving_avg_obs_fq_helper_functional``'s results at eager's sizes: per channel,
    the observer's state has ``x.size(ch_axis)`` entries (Note [Eager sizes of resizing kernels])."""
    per_row = kwargs.get("per_row_fake_quant", args[11] if len(args) > 11 else False)
    if not per_row:
        return out
    x = args[0]
    assert isinstance(x, torch.Tensor)
    size = [x.shape[kwargs.get("ch_axis", args[10])]]
    return (*out[:2], *(mode.new_empty(types, t, size) for t in out[2:]))


_EAGER_SIZES = {
    torch.ops.aten._fused_moving_avg_obs_fq_helper_functional.default: _fused_observer_sizes,
}


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
