"""Backward ops a backend compiles no kernel for, written as the forward ops it has.

Core ATen keeps ``convolution_backward``, ``avg_pool{2,3}d_backward`` and
``_adaptive_avg_pool{2,3}d_backward``; PyTorch decomposes none of them, torch.onnx's exporter
has no ONNX function for them, and IREE 3.13 cannot compile average pooling's. Each is a
convolution, a transposed convolution or a matmul, which both backends take: a backend
decomposes the ops of ``AS_FORWARD_OPS`` it lacks before it compiles a program
(``decompose``). Each decomposition is tested against eager's kernel in float64
(tests/test_backend_onnxruntime.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram

__all__ = ["AS_FORWARD_OPS", "decompose"]

# Note [Convolution backward as convolutions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aten.convolution_backward`` is Core ATen, and neither PyTorch's decomposition tables nor the
# exporter's ONNX functions take it (torchlib's ``aten_convolution_backward`` raises
# NotImplementedError), so every backward program of a convnet would be refused. It is two
# convolutions and a sum, which ONNX has: before exporting, the backend decomposes it with
# ``_convolution_backward`` (``program.run_decompositions``). For a convolution of ``x`` (N,
# C_in, H) with ``w`` (C_out, C_in/g, k), stride s, padding p, dilation d, groups g, and the
# gradient ``gy`` (N, C_out, h) of its output:
#
#   grad of x   the transposed convolution of ``gy`` with ``w`` (same s, p, d, g), whose
#               output padding (H + 2p - d(k-1) - 1) mod s gives back H rows: the rows no window
#               reached get zeros, as eager's
#   grad of w   grad_w[o, c, i] = sum over n, y of x[n, c, y*s + i*d - p] * gy[n, o, y]: a
#               convolution of x with gy over the batch, stride and dilation swapped: x as
#               (C_in/g, g*N, H), gy as (C_out, N, h) in g groups, then the first k taps of
#               each output: (C_in/g, C_out, k) -> (C_out, C_in/g, k)
#   grad of b   gy summed over every dimension but C_out
#
# e.g. Conv2d(3, 4, 3, stride=2) on a (2, 3, 8, 8) image: gy is (2, 4, 3, 3); the grad of x is
# the transposed convolution with output padding (8 - 2 - 1) mod 2 = 1, (2, 3, 8, 8); the grad
# of w is x as (3, 2, 8, 8) convolved with gy as (4, 2, 3, 3) at stride 1, dilation 2: (3, 4, 4, 4),
# whose first 3 x 3 taps, transposed, are (4, 3, 3, 3). A transposed convolution's backward is
# left as it is, and the exporter refuses it by name. tests/test_backend_onnxruntime.py checks
# the decomposition against eager's kernel over strides, paddings, dilations, groups and 1-3
# spatial dimensions.

_aten = torch.ops.aten


def _per_dim(value: Sequence[int], dims: int) -> list[int]:
    return list(value) * dims if len(value) == 1 else list(value)


def _convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    """``aten.convolution_backward`` as convolutions (Note [Convolution backward as convolutions])."""
    if transposed:
        return NotImplemented
    dims = grad_output.dim() - 2
    stride, padding = _per_dim(stride, dims), _per_dim(padding, dims)
    dilation = _per_dim(dilation, dims)
    spatial, kernel = input.shape[2:], weight.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        reached = [
            (grad_output.shape[2 + i] - 1) * stride[i]
            - 2 * padding[i]
            + dilation[i] * (kernel[i] - 1)
            + 1
            for i in range(dims)
        ]
        extra = [spatial[i] - reached[i] for i in range(dims)]
        grad_input = _aten.convolution.default(
            grad_output, weight, None, stride, padding, dilation, True, extra, groups
        )
    if output_mask[1]:
        n, channels = input.shape[0], input.shape[1]
        per_group = channels // groups
        batch_major = (
            input.reshape(n, groups, per_group, *spatial)
            .permute(2, 1, 0, *range(3, 3 + dims))
            .reshape(per_group, groups * n, *spatial)
        )
        taps = _aten.convolution.default(
            batch_major,
            grad_output.transpose(0, 1),
            None,
            dilation,
            padding,
            stride,
            False,
            [0] * dims,
            groups,
        )
        grad_weight = taps.transpose(0, 1)
        for i in range(dims):
            grad_weight = grad_weight.narrow(2 + i, 0, kernel[i])
        grad_weight = grad_weight.contiguous()
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, 2 + dims)])
    return grad_input, grad_weight, grad_bias


# Note [Average pooling backward as a transposed convolution]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aten.avg_pool2d_backward`` is Core ATen (densenet's transitions, timm's resnet10t
# shortcuts), and, as for convolution's backward, neither PyTorch nor the exporter decomposes
# it (nor ``avg_pool3d_backward``). Each output position ``o`` of the pooling averaged one
# window, so its gradient divided by that window's divisor goes to every input element of
# the window: a transposed convolution, per channel, of ``gy / divisor`` with a kernel of ones
# at the pooling's stride (one ungrouped convolution, the channels folded into the batch:
# IREE 3.13 miscompiles the grouped form). The divisor is what the kernel divides by (``AvgPoolKernel.cpp``),
# per axis a count, the window's product over the axes:
#
#   start = o*s - p,  end = min(start + k, size + p)      (a ceil_mode window is clipped)
#   count_include_pad    end - start
#   otherwise            min(end, size) - max(start, 0)  (in-bounds elements only)
#   divisor_override     that number, for every window
#
# The transposed convolution without padding gives the gradient of the padded input,
# ``(out - 1)*s + k`` long on each axis; the input's ``size`` elements start at ``p``:
# it is sliced there, and zero-padded at the end where no window reached the last elements.
#
# e.g. ``avg_pool1d`` of 6 elements, k 2, s 2, p 1, ceil_mode, count_include_pad=False: 4
# windows start at -1, 1, 3, 5 and end at 1, 3, 5, 7 (at most size + p = 7: with k 3 the
# last would be clipped there); divisors 1, 2, 2, 1 (in-bounds elements).
# ``gy = (a, b, c, d)`` scaled is ``(a, b/2, c/2, d)``; its transposed convolution, ``(a, a, b/2, b/2, c/2, c/2, d, d)`` on the padded axis
# -1..6, sliced from p = 1: ``(a, b/2, b/2, c/2, c/2, d)``, eager's. With 7 elements, k 2,
# s 2, p 0, the 3 windows cover 0..5: element 6 gets the zero padding (no window read it).
# tests/test_backend_onnxruntime.py checks the decomposition against eager's kernel over
# kernels, strides, paddings, ceil_mode, count_include_pad, divisor_override and sizes no
# window fits exactly, in 2 and 3 dimensions.


def _window_counts(
    out: int, size: int, kernel: int, stride: int, padding: int, include_pad: bool, like: Any
) -> torch.Tensor:
    """Per output position of one axis, the number of elements its window averaged."""
    start = torch.arange(out, device=like.device) * stride - padding
    end = (start + kernel).clamp(max=size + padding)
    if include_pad:
        return end - start
    return end.clamp(max=size) - start.clamp(min=0)


def _avg_pool_backward(dims: int) -> Callable[..., torch.Tensor]:
    """``aten.avg_pool{dims}d_backward`` (Note [Average pooling backward as a transposed
    convolution])."""
    return functools.partial(_avg_pool_backward_nd, dims)


def _avg_pool_backward_nd(
    dims: int,
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """``aten.avg_pool{dims}d_backward`` as a transposed convolution with ones (Note [Average
    pooling backward as a transposed convolution]). ``ceil_mode`` is in ``grad_output``'s shape."""
    batched = input.dim() == dims + 2
    grad = grad_output if batched else grad_output.unsqueeze(0)
    x_shape = input.shape if batched else (1, *input.shape)
    kernel = _per_dim(kernel_size, dims)
    stride = _per_dim(stride, dims) if len(stride) else kernel
    padding = _per_dim(padding, dims)
    spatial, out = x_shape[2:], grad.shape[2:]
    dtype = grad.dtype
    if divisor_override:
        scaled = grad / divisor_override
    else:
        divisor = torch.ones((), dtype=dtype, device=grad.device)
        for i in range(dims):
            counts = _window_counts(
                out[i], spatial[i], kernel[i], stride[i], padding[i], count_include_pad, grad
            )
            divisor = divisor * counts.to(dtype).reshape(-1, *[1] * (dims - 1 - i))
        scaled = grad / divisor
    # Every channel alike: channels folded into the batch, one ungrouped transposed
    # convolution (IREE 3.13 miscompiles the grouped one: "collapse_shape ... expected rank").
    n, channels = scaled.shape[:2]
    ones = torch.ones((1, 1, *kernel), dtype=dtype, device=grad.device)
    folded = _aten.convolution.default(
        scaled.reshape(n * channels, 1, *out),
        ones,
        None,
        stride,
        [0] * dims,
        [1] * dims,
        True,
        [0] * dims,
        1,
    )
    padded = folded.reshape(n, channels, *folded.shape[2:])
    grad_input = padded
    short = []
    for i in range(dims):
        kept = min(padded.shape[2 + i] - padding[i], spatial[i])
        grad_input = grad_input.narrow(2 + i, padding[i], kept)
        short.append(spatial[i] - kept)
    if any(short):
        pads = [n for i in reversed(range(dims)) for n in (0, short[i])]
        grad_input = _aten.constant_pad_nd.default(grad_input, pads, 0.0)
    grad_input = grad_input.contiguous()
    return grad_input if batched else grad_input.squeeze(0)


# Note [Adaptive average pooling backward as matmuls]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aten._adaptive_avg_pool2d_backward`` (Core ATen; ``nn.AdaptiveAvgPool2d`` to more than one
# output) has no ONNX function either. Its windows are not strided alike: on an axis of
# ``size`` inputs and ``out`` outputs, output ``o`` averages ``[floor(o*size/out),
# ceil((o+1)*size/out))`` (``AdaptiveAvgPoolKernel.cpp``), and a window's count is the product
# of its axes' counts. So the pooling is separable: on each axis, a matrix ``A`` (out x size)
# with ``1/count`` over the window's inputs, and the backward applies each axis's ``A^T``:
# ``grad_x = A_h^T gy A_w``. e.g. 5 inputs to 2 outputs: windows [0, 3) and [2, 5),
# ``A = [[1/3, 1/3, 1/3, 0, 0], [0, 0, 1/3, 1/3, 1/3]]``; ``gy = (a, b)`` gives ``(a/3, a/3,
# a/3 + b/3, b/3, b/3)``, eager's. Checked against eager's kernel in float64 in
# tests/test_backend_onnxruntime.py.


def _adaptive_axis(out: int, size: int, like: torch.Tensor) -> torch.Tensor:
    """The (out, size) matrix of one axis: ``1/count`` over each output's window, else 0."""
    o = torch.arange(out, device=like.device).unsqueeze(1)
    i = torch.arange(size, device=like.device)
    start = torch.div(o * size, out, rounding_mode="floor")
    end = torch.div((o + 1) * size + out - 1, out, rounding_mode="floor")
    inside = torch.logical_and(i >= start, i < end)  # not `&`: IREE does not lower bool and_
    return inside.to(like.dtype) / (end - start).to(like.dtype)


def _adaptive_avg_pool_backward(dims: int) -> Callable[..., torch.Tensor]:
    """``aten._adaptive_avg_pool{dims}d_backward`` as one matmul per axis (Note [Adaptive
    average pooling backward as matmuls])."""

    def backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        grad = grad_output
        for axis in range(grad.dim() - dims, grad.dim()):
            matrix = _adaptive_axis(grad.shape[axis], input.shape[axis], grad)
            grad = torch.matmul(grad.movedim(axis, -1), matrix).movedim(-1, axis)
        return grad.contiguous()

    return backward


# The decompositions of this module, by op.
AS_FORWARD_OPS: dict[Any, Callable[..., Any]] = {
    _aten.convolution_backward.default: _convolution_backward,
    _aten.avg_pool2d_backward.default: _avg_pool_backward(2),
    _aten.avg_pool3d_backward.default: _avg_pool_backward(3),
    _aten._adaptive_avg_pool2d_backward.default: _adaptive_avg_pool_backward(2),
    _aten._adaptive_avg_pool3d_backward.default: _adaptive_avg_pool_backward(3),
}


def decompose(
    program: ExportedProgram,
    ops: Collection[Any],
    own: Mapping[Any, Callable[..., Any]] | None = None,
) -> ExportedProgram:
    """``program`` with its nodes of ``ops`` (keys of ``AS_FORWARD_OPS``) decomposed, and in
    the same pass those of ``own`` (a backend's own decompositions, by op); itself when it
    has none."""
    present = {n.target for n in program.graph.nodes if n.op == "call_function"}
    table = {op: AS_FORWARD_OPS[op] for op in ops if op in present}
    table.update((op, fn) for op, fn in (own or {}).items() if op in present)
    return program.run_decompositions(table) if table else program
