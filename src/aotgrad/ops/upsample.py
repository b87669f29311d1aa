"""The backwards of ``F.interpolate`` (nearest, nearest-exact, linear, bilinear, trilinear,
bicubic) in Core ATen ops, for ``decompositions="core_aten"`` (Note [Upsampling backward in
Core ATen]). PyTorch decomposes the forwards (``torch._decomp``) but none of the backwards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Note [Upsampling backward in Core ATen]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every ``F.interpolate`` mode aotgrad decomposes is a linear gather: along each spatial axis,
# output position ``o`` reads a few input positions ("taps") ``i_t(o)`` with weights
# ``w_t(o)``, and an output element is the product over the axes of those weights times the
# input element at the taps' indices, summed over every combination of taps. Its backward is
# the transposed scatter: for every combination of taps, ``grad_input.index_put_(taps'
# indices, grad_output * product of the taps' weights, accumulate=True)``, into zeros.
# The taps are computed with the arithmetic of torch's forward decompositions
# (``torch/_decomp/decompositions.py``: ``_compute_upsample_nearest_indices``,
# ``_upsample_linear``, ``upsample_bicubic2d_default``), which are the forward graph of a
# ``core_aten`` capture, so the backward is that graph's exact transpose:
#
#   nearest     one tap: ``trunc((o + offset) * scale)`` in float32, weight 1 (offset 0.5
#               for nearest-exact); ``scale = isize / osize``, or ``1 / scale_factor`` given
#   linear      two taps: ``x = clamp(src(o), min=0)``, ``i0 = trunc(x)``, ``i1 = min(i0 + 1,
#               isize - 1)``; ``l = clamp(x - i0, 0, 1)``, weights ``1 - l`` and ``l``; ``src(o)
#               = scale * o`` with align_corners (``scale = (isize - 1) / (osize - 1)``, 0 for
#               one output), else ``scale * (o + 0.5) - 0.5``
#   cubic       four taps: ``x = src(o)`` (not clamped), ``f = floor(x)``, indices
#               ``clamp(f - 1 + k, 0, isize - 1)``, ``t = clamp(x - f, 0, 1)``, weights the
#               cubic convolution (A = -0.75) at ``t + 1, t, 1 - t, 2 - t``
#
# e.g. ``F.interpolate(x, size=3, mode="linear")`` of ``x`` of 2 elements, no align_corners:
# scale 2/3, ``src = (-1/6, 1/2, 7/6)``, clamped ``(0, 1/2, 7/6)``; ``i0 = (0, 0, 1)``,
# ``i1 = (1, 1, 1)``, ``l = (0, 1/2, 1/6)``. For ``grad_output = (g0, g1, g2)``: the first tap
# adds ``(g0, g1/2, 5 g2/6)`` at ``(0, 0, 1)``, the second ``(0, g1/2, g2/6)`` at ``(1, 1, 1)``:
# ``grad_input = (g0 + g1/2, g1/2 + g2)``, what eager's kernel gives. Taps that land on the same
# index (clamped at an edge) add up, as they do in eager's kernel. Computed in float32 for
# half-precision gradients (the forwards compute there too), then cast back.
# tests/test_core_aten.py compares each with eager's kernels in float64 over sizes up and down,
# align_corners, scale factors given or not, 1-3 spatial dimensions and channels_last inputs.

_aten = torch.ops.aten

# One tap of one axis: the input index each output position reads, and its weight (None: 1).
_Tap = tuple[torch.Tensor, torch.Tensor | None]
# The taps of one axis, from (input size, output size, scale factor or None, device, the
# dtype the weights are computed in).
_Taps = Callable[[int, int, "float | None", torch.device, torch.dtype], list[_Tap]]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward decompositions interpolate in (``pw_cast_for_opmath``)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _nearest_taps(exact: bool) -> _Taps:
    def taps(
        isize: int, osize: int, scale: float | None, device: torch.device, dtype: torch.dtype
    ) -> list[_Tap]:
        offset = 0.5 if exact else 0.0
        step = isize / (isize * scale) if scale is not None and scale > 0 else isize / osize
        positions = torch.arange(osize, dtype=torch.float32, device=device)
        return [(((positions + offset) * step).to(torch.int64), None)]

    return taps


def _source_index(
    isize: int, osize: int, scale: float | None, align_corners: bool, positions: torch.Tensor
) -> torch.Tensor:
    """torch's ``_compute_scale`` and ``_compute_source_index`` (UpSample.h)."""
    if align_corners:
        step = (isize - 1.0) / (osize - 1.0) if osize > 1 else 0
        return step * positions
    step = 1.0 / scale if scale is not None and scale > 0 else isize / osize
    return step * (positions + 0.5) - 0.5


def _linear_taps(align_corners: bool) -> _Taps:
    def taps(
        isize: int, osize: int, scale: float | None, device: torch.device, dtype: torch.dtype
    ) -> list[_Tap]:
        positions = torch.arange(osize, device=device).to(dtype=dtype)
        source = _source_index(isize, osize, scale, align_corners, positions).clamp(min=0.0)
        low = source.to(torch.int64)
        high = (low + 1).clamp(max=isize - 1)
        weight = (source - low).clamp(0.0, 1.0).to(dtype)
        return [(low, 1 - weight), (high, weight)]

    return taps


def _cubic_1(x: torch.Tensor, a: float) -> torch.Tensor:
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _cubic_2(x: torch.Tensor, a: float) -> torch.Tensor:
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _cubic_taps(align_corners: bool) -> _Taps:
    def taps(
        isize: int, osize: int, scale: float | None, device: torch.device, dtype: torch.dtype
    ) -> list[_Tap]:
        positions = torch.arange(osize, device=device).to(dtype=dtype)
        source = _source_index(isize, osize, scale, align_corners, positions)
        floor = source.floor()
        t = (source - floor).clamp(0.0, 1.0)
        first = floor.to(torch.int64)
        a = -0.75
        weights = (_cubic_2(t + 1.0, a), _cubic_1(t, a), _cubic_1(1.0 - t, a), _cubic_2(2.0 - t, a))
        return [((first + k - 1).clamp(0, isize - 1), weight) for k, weight in enumerate(weights)]

    return taps


def _scatter_taps(
    grad_output: torch.Tensor,
    output_size: Sequence[int],
    input_size: Sequence[int],
    scales: Sequence[float | None],
    taps: _Taps,
) -> torch.Tensor:
    """The transposed gather (Note [Upsampling backward in Core ATen])."""
    dims = len(output_size)
    if len(input_size) != dims + 2 or tuple(grad_output.shape[2:]) != tuple(output_size):
        raise AssertionError(
            f"expected an upsampling backward of {dims} spatial dims, got input size"
            f" {list(input_size)} and a gradient of shape {list(grad_output.shape)}"
        )
    dtype = _compute_dtype(grad_output.dtype)
    grad = grad_output.to(dtype)
    per_axis = []
    for d in range(dims):
        trailing = [1] * (dims - 1 - d)
        axis = taps(input_size[2 + d], output_size[d], scales[d], grad.device, dtype)
        per_axis.append(
            [
                (index.reshape(-1, *trailing), None if w is None else w.reshape(-1, *trailing))
                for index, w in axis
            ]
        )
    grad_input = torch.zeros(list(input_size), dtype=dtype, device=grad.device)
    for combination in itertools.product(*per_axis):
        values = grad
        for _, weight in combination:
            if weight is not None:
                values = values * weight
        indices: list[torch.Tensor | None] = [None, None, *(index for index, _ in combination)]
        grad_input = _aten.index_put.default(grad_input, indices, values, True)
    return grad_input.to(grad_output.dtype)


def _scales(given: Sequence[float | None], dims: int) -> list[float | None]:
    return list(given) if given else [None] * dims


def _nearest_backward(exact: bool) -> Callable[..., torch.Tensor]:
    def backward(
        grad_output: torch.Tensor,
        output_size: Sequence[int],
        input_size: Sequence[int],
        *scales: float | None,
    ) -> torch.Tensor:
        dims = len(output_size)
        return _scatter_taps(
            grad_output, output_size, input_size, _scales(scales, dims), _nearest_taps(exact)
        )

    return backward


def _interpolating_backward(
    taps: Callable[[bool], _Taps],
) -> Callable[..., torch.Tensor]:
    def backward(
        grad_output: torch.Tensor,
        output_size: Sequence[int],
        input_size: Sequence[int],
        align_corners: bool,
        *scales: float | None,
    ) -> torch.Tensor:
        dims = len(output_size)
        return _scatter_taps(
            grad_output, output_size, input_size, _scales(scales, dims), taps(align_corners)
        )

    return backward


# The upsampling backwards aotgrad decomposes, keyed by op (Note [Upsampling backward in Core
# ATen]). Antialiased bilinear and bicubic (``antialias=True``) are left to refusal.
UPSAMPLE_BACKWARD_DECOMPOSITIONS: dict[Any, Callable[..., torch.Tensor]] = {
    _aten.upsample_nearest1d_backward.default: _nearest_backward(exact=False),
    _aten.upsample_nearest2d_backward.default: _nearest_backward(exact=False),
    _aten.upsample_nearest3d_backward.default: _nearest_backward(exact=False),
    _aten._upsample_nearest_exact1d_backward.default: _nearest_backward(exact=True),
    _aten._upsample_nearest_exact2d_backward.default: _nearest_backward(exact=True),
    _aten._upsample_nearest_exact3d_backward.default: _nearest_backward(exact=True),
    _aten.upsample_linear1d_backward.default: _interpolating_backward(_linear_taps),
    _aten.upsample_bilinear2d_backward.default: _interpolating_backward(_linear_taps),
    _aten.upsample_trilinear3d_backward.default: _interpolating_backward(_linear_taps),
    _aten.upsample_bicubic2d_backward.default: _interpolating_backward(_cubic_taps),
}
