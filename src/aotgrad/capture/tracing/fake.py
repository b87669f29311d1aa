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

from aotgrad._torch_compat import (
    FakeTensor,
    FakeTensorMode,
    is_non_overlapping_and_dense,
    no_dispatch,
    view_stride,
)
from aotgrad.ops.table import is_pointwise

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class EagerViewsFakeMode(FakeTensorMode):
    """PyTorch's ``FakeTensorMode``, with eager's ``view`` strides (Note [Eager strides for
    views]) and eager's layouts where a few other ops' meta functions differ from eager."""

    def dispatch(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = super().dispatch(func, types, args, kwargs or {})
        if func not in _VIEWS:
            return self.eager_layouts(func, types, args, kwargs or {}, out)
        if not isinstance(out, FakeTensor):
            return out
        source = args[0]
        assert isinstance(source, torch.Tensor)
        stride = _eager_view_stride(source, out.shape)
        if stride is None or _same_strides(stride, out.stride()):
            return out
        restrided = (source, out.shape, stride, source.storage_offset())
        return super().dispatch(torch.ops.aten.as_strided.default, types, restrided, {})

    def eager_layouts(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object],
        kwargs: Mapping[str, object],
        out: object,
    ) -> object:
        """``out``, at eager's sizes and strides where ``func``'s meta function gives others
        (Notes [Eager sizes of resizing kernels], [Eager strides of pointwise ops])."""
        resize = _EAGER_SIZES.get(func)
        if resize is not None:
            return resize(self, types, args, kwargs, out)
        stride = _same_layout_stride(func, args, kwargs, out)
        if stride is None:
            return out
        assert isinstance(out, FakeTensor)
        restrided = (out, out.shape, stride)
        return super().dispatch(torch.ops.aten.new_empty_strided.default, types, restrided, {})

    def new_empty(self, types: Sequence[type], like: torch.Tensor, size: list[Any]) -> object:
        """A fake tensor of ``size``, with ``like``'s dtype and device."""
        return super().dispatch(torch.ops.aten.new_empty.default, types, (like, size), {})


# Note [Eager strides of pointwise ops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager's pointwise kernels (TensorIterator) give the output the very strides
# of their operands when every operand has the output's shape and one
# non-overlapping, dense layout, size-1 dimensions' strides included. The fake
# mode's Python rule recomputes the strides and normalizes those of size-1
# dimensions. The graph's math does not see the difference, but ops that ask
# for a memory format do: ``group_norm`` makes its input contiguous in the
# format the strides suggest, a no-op on the fake (channels-last) strides that
# capture then drops, while the real tensor is neither format, and the kernel
# refuses it ("Expected X.is_contiguous(memory_format)"). A VAE at batch 1::
#
#     y = attention(x).transpose(-1, -2).reshape(1, c, h, w)   # stride (64, 1, 256, 64)
#     y = (y + x) / 1.0     eager: (64, 1, 256, 64)   fake: (1024, 1, 256, 64)
#     group_norm(y)         eager copies y first; the graph did not
#
# So capture gives such an op's output its operands' strides, as eager does.
def _same_layout_stride(
    func: Any, args: Sequence[object], kwargs: Mapping[str, object], out: object
) -> tuple[int, ...] | None:
    """The strides eager gives ``func``'s output when they differ from ``out``'s, else None
    (Note [Eager strides of pointwise ops])."""
    if not isinstance(out, FakeTensor) or not is_pointwise(func) or func._schema.is_mutable:
        return None
    if kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None  # clone(x, memory_format=...): the format asked for, not the operands'
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    layouts = [(*t.shape, *t.stride()) for t in (out, *tensors)]
    if len(tensors) == 0 or not all(type(n) is int for layout in layouts for n in layout):
        return None  # symbolic layouts keep the fake mode's rule
    stride = tuple(tensors[0].stride())
    if any(t.shape != out.shape or tuple(t.stride()) != stride for t in tensors):
        return None
    if stride == tuple(out.stride()) or not is_non_overlapping_and_dense(tensors[0]):
        return None
    return stride


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
