"""Output layouts of a few ops the fake tensor mode would otherwise decompose to learn them.

Note [Layouts without decompositions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A fake tensor knows only its layout (size, strides, dtype, device); capture
needs nothing else from an op. For most aten ops the fake mode gets that
layout from a C++ meta kernel. Ops without one (batch norm in training and its
backward, the backward of most activations) it decomposes in Python into a
dozen smaller ops, each dispatched through the fake mode in turn, and its
cache helps only when the same op meets the same shapes again, which a
convnet's layers of ever-changing widths rarely do (capture times, dated, with
the command: ``bench/findings.md``).

For these ops the layout is simple whenever the inputs are laid out simply,
so capture's fake mode makes the outputs directly (fresh fake tensors of the
right layout) when every tensor argument is dense in the standard
(contiguous) or channels-last order and of one floating dtype; anything else
takes the decomposition as before::

    _native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
        x: (2, 32, 8, 8) channels-last, float32
        -> out like x; save_mean, save_rstd, new rm, new rv: (32,) float32
    silu_backward(grad, x), grad and x alike -> like x

The same rule covers the common pointwise ops whose meta kernels are Python
references of many small ops (``relu``, ``gelu``, ``add``, ``mul`` ... with
alike tensors and plain numbers); a complex number, a dtype or a second
layout among the arguments declines.

``tests/test_fake_layouts.py`` checks every rule against the decomposition's
own result on a grid of shapes and layouts (size-1 dimensions included), and
the graphs do not change (both tracers use this mode). Layer norm and its
backward follow the same way (the output is contiguous whatever the input's
order); over size-1 dimensions the decomposition's strides differ from eager's,
and those keep the decomposition's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from aotgrad._torch_compat import FakeTensor

aten = torch.ops.aten

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Other arguments of a pointwise op that leave a floating result's dtype as its inputs'.
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Layout:
    """What a fake tensor is: size, strides, dtype, device."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def like(t: torch.Tensor) -> Layout:
        return Layout(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    @staticmethod
    def vector(n: int, like: torch.Tensor) -> Layout:
        return Layout((n,), (1,), like.dtype, like.device)


@dataclass(frozen=True)
class Layouts:
    """The outputs of one op: a tuple of (maybe absent) tensors, or one tensor."""

    tensors: tuple[Layout | None, ...]
    as_tuple: bool


Rule = Callable[[Sequence[object], Mapping[str, object]], Layouts | None]
# The one table of layout rules: op -> its rule, each registered beside the rule (``_layout``).
LAYOUTS: dict[Any, Rule] = {}


def _layout(*ops: Any) -> Callable[[Rule], Rule]:
    """Register the decorated rule for ``ops``."""

    def register(rule: Rule) -> Rule:
        LAYOUTS.update(dict.fromkeys(ops, rule))
        return rule

    return register


def fast_layouts(
    func: Any, args: Sequence[object], kwargs: Mapping[str, object] | None
) -> Layouts | None:
    """The layouts of ``func(*args, **kwargs)``'s outputs, or None: ask the fake mode.

    >>> from aotgrad._torch_compat import FakeTensorMode
    >>> with FakeTensorMode():
    ...     x = torch.empty(2, 3)
    ...     found = fast_layouts(aten.silu_backward.default, (x, x), {})
    >>> found.tensors[0].shape, found.tensors[0].strides, found.as_tuple
    ((2, 3), (3, 1), False)
    """
    rule = LAYOUTS.get(func)
    return None if rule is None else rule(args, kwargs or {})


def _simple(t: object) -> bool:
    """A fake tensor of a floating dtype, dense in the standard or channels-last order, whose
    value the fake mode does not know (it propagates known values through ops)."""
    if not _strided(t) or t.dtype not in _FLOATS or t.constant is not None:
        return False
    if not all(isinstance(n, int) for n in (*t.shape, *t.stride())):
        return False
    shape, strides = tuple(t.shape), tuple(t.stride())
    return strides == _contiguous(shape) or (len(shape) == 4 and strides == _channels_last(shape))


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))


def _channels_last(shape: Sequence[int]) -> tuple[int, ...]:
    _, c, h, w = (max(d, 1) for d in shape)
    return (h * w * c, 1, w * c, c)


def _alike(tensors: Sequence[object]) -> bool:
    """All simple fake tensors of one layout."""
    first = tensors[0]
    return all(_simple(t) for t in tensors) and all(
        isinstance(t, torch.Tensor)
        and isinstance(first, torch.Tensor)
        and Layout.like(t) == Layout.like(first)
        for t in tensors
    )


def _vectors(tensors: Sequence[object], n: int, like: torch.Tensor) -> bool:
    """All fake vectors of length ``n`` with ``like``'s dtype and device."""
    return all(
        _strided(t)
        and Layout.like(t) == Layout.vector(n, like)
        and t.fake_mode is getattr(like, "fake_mode", None)
        for t in tensors
    )


@dataclass(frozen=True)
class Pointwise:
    """An op whose result is laid out like its ``arity`` first arguments, when those are alike."""

    arity: int

    def __call__(self, args: Sequence[object], kwargs: Mapping[str, object]) -> Layouts | None:
        tensors = args[: self.arity]
        rest = [*args[self.arity :], *kwargs.values()]
        # a tensor, a complex number or a dtype among the others could change the result's type
        if len(tensors) != self.arity or not all(isinstance(a, _PLAIN) for a in rest):
            return None
        if not _alike(tensors) or len({id(getattr(t, "fake_mode", None)) for t in tensors}) != 1:
            return None
        first = tensors[0]
        assert isinstance(first, torch.Tensor)
        return Layouts(tensors=(Layout.like(first),), as_tuple=False)


# Pointwise ops whose result has the dtype of their floating inputs (one tensor and maybe a
# number; two tensors); their meta kernels are Python references of a dozen small ops each.
_layout(
    *(aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default),
    *(aten.tanh.default, aten.neg.default, aten.exp.default, aten.log.default),
    *(aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default, aten.erf.default),
    *(aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default),
    *(aten.hardswish.default, aten.hardsigmoid.default, aten.pow.Tensor_Scalar),
    *(aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar),
)(Pointwise(1))
_layout(
    *(aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor),
    *(aten.div.Tensor_mode, aten.maximum.default, aten.minimum.default),
    *(aten.sigmoid_backward.default, aten.tanh_backward.default),
    *(aten.hardswish_backward.default, aten.hardsigmoid_backward.default),
    *(aten.silu_backward.default, aten.gelu_backward.default, aten.threshold_backward.default),
)(Pointwise(2))


@_layout(aten._native_batch_norm_legit_functional.default)
def _batch_norm(args: Sequence[object], kwargs: Mapping[str, object]) -> Layouts | None:
    """``_native_batch_norm_legit_functional`` in training: out, mean, rstd, new stats."""
    if kwargs or len(args) != 8 or args[5] is not True:
        return None
    x, stats = args[0], args[1:5]
    if not _simple(x) or not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    channels = x.shape[1]
    if x.numel() <= channels or not _vectors(stats, channels, x):
        return None  # one value per channel: the decomposition's error, not a layout
    vector = Layout.vector(channels, x)
    return Layouts(tensors=(Layout.like(x), vector, vector, vector, vector), as_tuple=True)


@_layout(aten.native_batch_norm_backward.default)
def _batch_norm_backward(args: Sequence[object], kwargs: Mapping[str, object]) -> Layouts | None:
    """``native_batch_norm_backward`` in training: grad of input, weight, bias (by mask)."""
    if kwargs or len(args) != 10 or args[7] is not True:
        return None
    grad, x, weight, _, _, save_mean, save_invstd = args[:7]
    mask = args[9]
    if not isinstance(mask, list | tuple) or len(mask) != 3 or not _alike((grad, x)):
        return None
    assert isinstance(x, torch.Tensor)
    channels = x.shape[1] if x.dim() >= 2 else -1
    if x.numel() <= channels or not _vectors((weight, save_mean, save_invstd), channels, x):
        return None
    vector = Layout.vector(channels, x)
    return _by_mask((Layout.like(x), vector, vector), mask)


def _layer_norm_input(x: object, normalized: object) -> tuple[torch.Tensor, int] | None:
    """``x`` and where its normalized dimensions start, when the shortcut covers it: a fake
    tensor of one float dtype, no size-1 dimension (the decomposition lays those out
    otherwise than eager; it keeps them), normalizing its trailing dimensions."""
    if not _strided(x) or x.dtype not in (torch.float32, torch.float64):
        return None
    if not isinstance(normalized, list | tuple) or not normalized:
        return None
    shape = tuple(x.shape)
    if not all(isinstance(n, int) and n > 1 for n in shape) or not all(
        isinstance(n, int) for n in x.stride()
    ):
        return None
    axis = len(shape) - len(normalized)
    return None if axis < 0 or tuple(shape[axis:]) != tuple(normalized) else (x, axis)


def _contiguous_layout(shape: Sequence[int], like: torch.Tensor) -> Layout:
    return Layout(tuple(shape), _contiguous(shape), like.dtype, like.device)


@_layout(aten.native_layer_norm.default)
def _layer_norm(args: Sequence[object], kwargs: Mapping[str, object]) -> Layouts | None:
    """``native_layer_norm``: out (contiguous, whatever the input's order), mean, rstd."""
    if kwargs or len(args) != 5:
        return None
    found = _layer_norm_input(args[0], args[1])
    if found is None:
        return None
    x, axis = found
    if not _affine(args[2:4], tuple(x.shape[axis:]), x):
        return None
    stats = _contiguous_layout((*x.shape[:axis], *[1] * (x.dim() - axis)), x)
    return Layouts(tensors=(_contiguous_layout(x.shape, x), stats, stats), as_tuple=True)


@_layout(aten.native_layer_norm_backward.default)
def _layer_norm_backward(args: Sequence[object], kwargs: Mapping[str, object]) -> Layouts | None:
    """``native_layer_norm_backward``: grads of input (contiguous), weight, bias (by mask)."""
    if kwargs or len(args) != 8:
        return None
    grad, x, normalized, mean, rstd, weight, bias, mask = args
    found = _layer_norm_input(x, normalized)
    if found is None or not isinstance(mask, list | tuple) or len(mask) != 3:
        return None
    x, axis = found
    stats = _contiguous_layout((*x.shape[:axis], *[1] * (x.dim() - axis)), x)
    if not (
        _strided(grad)
        and Layout.like(grad) == _contiguous_layout(x.shape, x)
        and all(_strided(t) and Layout.like(t) == stats for t in (mean, rstd))
        and _affine((weight, bias), tuple(x.shape[axis:]), x)
    ):
        return None
    params = _contiguous_layout(x.shape[axis:], x)
    return _by_mask((_contiguous_layout(x.shape, x), params, params), mask)


def _by_mask(wanted: tuple[Layout, ...], mask: Sequence[object]) -> Layouts:
    """A backward's grads: the ``mask``'s wanted ones, None for the others."""
    return Layouts(tuple(w if m else None for w, m in zip(wanted, mask, strict=True)), True)


def _affine(tensors: Sequence[object], shape: tuple[int, ...], like: torch.Tensor) -> bool:
    """Weight and bias both given, contiguous, of the normalized shape, ``like``'s dtype."""
    return all(_strided(t) and Layout.like(t) == _contiguous_layout(shape, like) for t in tensors)


def _strided(t: object) -> TypeGuard[FakeTensor]:
    """A fake tensor with strides (not sparse)."""
    return isinstance(t, FakeTensor) and t.layout is torch.strided


__all__ = ["LAYOUTS", "Layout", "Layouts", "Pointwise", "fast_layouts"]
