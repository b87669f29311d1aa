"""The flat exported programs run by ONNX Runtime, against eager (docs/backends.md, "ONNX Runtime").

Tolerances: ONNX Runtime computes in float32 with its own kernels (its own GEMM blocking and
summation order, its own ``erf``/``exp``/``tanh``), and its graph optimizer fuses layer norm,
GELU and attention into kernels of its own. That rounds differently from eager by about 1e-6
relative per op; over a model's forward and backward (tens of ops, reductions over hundreds of
values) it compounds to about 1e-5. ``rtol=1e-4, atol=1e-5`` (the real-model suite's) leaves
margin while a wrong mask, a stale input fed in the wrong place or a zero-filled saved value shows
as an O(1) difference. Tiny programs of a few ops are held to ``1e-5 / 1e-6``.

``make test`` runs the fast part (one small model both ways, the refusals, the conversions);
``make backends`` runs the library models too (``backends_slow``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad.backends import step
from aotgrad.errors import BackendError, CallError
from aotgrad.ops import backward_ops
from aotgrad.signature.descriptors import Input
from backend_check import check_backend

pytest.importorskip("onnxruntime")
from aotgrad.backends import onnxruntime as ort_backend

pytestmark = pytest.mark.backends

BACKEND = "onnxruntime"
# Tiny programs (a few ops): float32 rounding of one kernel, and no more.
TINY = {"rtol": 1e-5, "atol": 1e-6}
# Models: see the module docstring.
MODEL = {"rtol": 1e-4, "atol": 1e-5}
# Convnets with BatchNorm: a weight gradient sums thousands of products per element, and
# BatchNorm's backward subtracts nearly equal sums. Against float64, eager's float32 gradients of
# torchvision's ResNet-18 at batch 8 are off by up to 1.6e-5 of each parameter's largest
# gradient, ONNX Runtime's by 1.8e-5 (the same rounding, in another order); gradients reach ~3,
# so elements near zero differ by up to ~5e-5 between the two float32 runs.
CONVNET = {"rtol": 1e-4, "atol": 1e-4}


def mlp_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4))


def test_mlp_batchnorm() -> None:
    """Loss, BatchNorm's running stats after the step and every gradient equal eager's."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    _, result = check_backend(
        mlp_batchnorm(), lambda y: y.square().mean(), (x,), {}, BACKEND, **TINY
    )
    assert len(result.mutations) == 3  # running_mean, running_var, num_batches_tracked
    assert len(result.grads) == 6


def test_default_decompositions() -> None:
    """Captured with the default table (layer norm, GELU, log-softmax and their backwards as
    aten's own ops)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    loss = lambda y: (F.log_softmax(y, -1) * torch.arange(4.0)).sum()  # noqa: E731
    check_backend(model, loss, (x,), {}, BACKEND, decompositions=None, **TINY)


def test_cross_entropy_total_weight_is_refused() -> None:
    """The exporter's ``nll_loss_forward`` returns the number of outputs (1 for a mean) as
    ``total_weight``, which ``nll_loss_backward`` divides by: with the default table, every
    gradient of a cross-entropy would come out N times too large. Refused; Core ATen runs."""
    fn = lambda x: F.cross_entropy(x, torch.arange(6) % 4)  # noqa: E731
    programs = aotgrad.trace(fn, x_(6, 4), decompositions=None).export(flat=True)
    with pytest.raises(BackendError, match=r"(?s)does not\s+compute.*aten\.nll_loss_forward"):
        step(programs, BACKEND)
    check_function(fn, x_(6, 4))


def test_batchnorm_in_training_mode_is_refused() -> None:
    """The exporter writes batch norm in inference mode whatever the program says: a training
    step would normalize with the running statistics and leave them as they were (Note [ONNX
    functions that ignore an argument]). Refused with the default table; Core ATen runs
    (``test_mlp_batchnorm``)."""
    model = mlp_batchnorm()
    x = torch.randn(6, 8)
    programs = aotgrad.trace(lambda x: model(x).sum(), x, decompositions=None).export(flat=True)
    with pytest.raises(
        BackendError,
        match=r"(?s)ignores an argument.*_native_batch_norm_legit_functional"
        r".*test_backend_onnxruntime.py.*training=True",
    ):
        step(programs, BACKEND)


def test_compile_is_quiet() -> None:
    """The exporter's progress, its optimizer's log lines and torch's deprecation warnings
    stay out of the user's stdout, stderr and warnings."""
    x = torch.randn(6, 8)
    model = mlp_batchnorm()
    programs = aotgrad.trace(lambda x: model(x).sum(), x, decompositions="core_aten").export(
        flat=True
    )
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        ort_backend.compile_program(programs.forward)
        ort_backend.compile_program(programs.backward)
    assert out.getvalue() == ""
    assert err.getvalue() == ""
    assert [str(w.message) for w in caught] == []


def check_function(
    fn: Callable[..., Any], *args: torch.Tensor, decompositions: str | None = "core_aten"
) -> None:
    """``fn``'s outputs and the gradient of every float input (of the sum of the outputs),
    run in ONNX Runtime, against eager."""
    eager_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    expected = fn(*eager_args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    sum(e.sum() for e in expected).backward()
    programs = aotgrad.trace(fn, *args, decompositions=decompositions).export(flat=True)
    result = step(programs, BACKEND)(*args)
    assert len(result.outputs) == len(expected)
    for got, want in zip(result.outputs, expected, strict=True):
        torch.testing.assert_close(got, want.detach(), **TINY)
    grads = {d: g for d, g in result.grads.items() if isinstance(d, Input)}
    inputs = [d for d in programs.forward_inputs if isinstance(d, Input)]
    for desc, arg in zip(inputs, eager_args, strict=True):
        if arg.requires_grad:
            torch.testing.assert_close(grads[desc], arg.grad, **TINY)


def x_(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=g).requires_grad_()


def test_non_contiguous_input() -> None:
    """A transposed input is fed as its values (NumPy gets a contiguous copy), not its storage."""
    check_function(lambda x: (x.sin() * torch.arange(4.0)).sum(), x_(4, 6).t())


def test_zero_dim_input_and_output() -> None:
    check_function(lambda x, y: (x * y).sum() * y, x_(4, 6), torch.tensor(3.0, requires_grad=True))


def test_integer_and_bool_inputs() -> None:
    """int64 indices and a bool mask go through unchanged."""
    index = torch.tensor([0, 2, 3])
    mask = torch.tensor([True, False, True, True, False, True])
    check_function(lambda x, y, z: (x[y] * z).sum(), x_(4, 6), index, mask)


def test_unused_input() -> None:
    check_function(lambda x, y: x.cos().sum(), x_(4, 6), torch.ones(3))


def test_input_returned_as_output() -> None:
    """The forward returns the inputs it saves for the backward; the exporter then renames each
    (``arg_0`` -> ``arg_0_orig``, with an ``Identity`` to the output): feeding by the model's
    own names still feeds each value to its place."""
    fn = lambda x, y: (x * y.exp()).sum()  # noqa: E731
    check_function(fn, x_(4, 6), x_(4, 6) + 1)
    programs = aotgrad.trace(fn, x_(4, 6), x_(4, 6) + 1).export(flat=True)
    run = ort_backend.compile_program(programs.forward)
    inputs = [i.name for i in run.session.get_inputs()]
    assert sorted(n for n in run.feeds if n is not None) == sorted(inputs)
    assert any(name.endswith("_orig") for name in inputs), inputs


def test_one_value_returned_twice() -> None:
    """``exp`` is the output and the value the backward saves: one value, two outputs (the
    exporter adds an ``Identity`` for the second)."""
    check_function(lambda x: x.exp(), x_(4, 6))


@pytest.mark.backends_slow
def test_tied_gpt() -> None:
    """tests/models.py's GPT: its head shares the token embedding's weight; one gradient."""
    from models import GPT

    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    check_backend(GPT(), lambda loss: loss, (idx, idx.roll(1, 1)), {}, BACKEND, **MODEL)


# ---------------------------------------------------------------- refusals


def test_dropout_is_refused() -> None:
    """ONNX Runtime cannot draw torch's mask: compiling a program that keeps dropout p > 0
    (random="ops") raises, naming the op and the user's line. (By default the draws are inputs,
    and the step runs: tests/test_random_draws.py.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    traced = aotgrad.trace(lambda x: model(x).sum(), torch.randn(4, 8))
    programs = traced.export(flat=True, random="ops")
    with pytest.raises(
        BackendError, match=r"(?s)draws random numbers.*bernoulli.*test_backend_onnxruntime.py"
    ):
        step(programs, BACKEND)


def test_dropout_at_zero_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0))
    check_backend(model, lambda y: y.sum(), (torch.randn(4, 8),), {}, BACKEND, **TINY)


def test_attention_logsumexp_is_refused() -> None:
    """The exporter's ONNX function for CPU flash attention returns zeros as ``logsumexp``;
    a training forward saves it for the backward. Refused, not run with zeros."""
    q = x_(2, 2, 8, 16)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()  # noqa: E731
    programs = aotgrad.trace(fn, q, decompositions=None).export(flat=True)
    with pytest.raises(
        BackendError, match=r"(?s)does not\s+compute.*_scaled_dot_product_flash_attention_for_cpu"
    ):
        ort_backend.compile_program(programs.forward)
    # Core ATen writes attention as matmuls and a softmax: it runs.
    check_function(fn, q)


def test_unsupported_op_is_named() -> None:
    """An op the exporter has no ONNX function for: the error names it and the user's line."""
    fn = lambda x: torch.kthvalue(x, 2)[0].sum()  # noqa: E731
    programs = aotgrad.trace(fn, x_(4, 6), decompositions=None).export(flat=True)
    with pytest.raises(
        BackendError,
        match=r"(?s)could not take.*aten\.kthvalue\.default at .*test_backend_onnxruntime.py",
    ):
        ort_backend.compile_program(programs.forward)


def test_bfloat16_input_is_refused() -> None:
    programs = aotgrad.trace(lambda x: x.float().sum(), x_(4, 6).bfloat16()).export(flat=True)
    with pytest.raises(BackendError, match="bfloat16"):
        ort_backend.compile_program(programs.forward)


def test_wrong_input_is_a_call_error() -> None:
    programs = aotgrad.trace(lambda x: x.sin().sum(), x_(4, 6)).export(flat=True)
    run = ort_backend.compile_program(programs.forward)
    with pytest.raises(CallError, match=r"expected float32\[4, 6\], got float32\[6, 4\]"):
        run(torch.ones(6, 4))
    with pytest.raises(CallError, match=r"expected float32\[4, 6\], got int64\[4, 6\]"):
        run(torch.ones(4, 6, dtype=torch.long))


class FakeSession:
    """An ONNX Runtime session that returns what it is given: a result of another dtype or
    shape than the program's must raise, never be cast."""

    def __init__(self, session: Any, result: Any) -> None:
        self.session, self.result = session, result

    def get_outputs(self) -> Any:
        return self.session.get_outputs()

    def run(self, names: Any, feeds: Any) -> Any:
        return [self.result, *self.session.run(names, feeds)[1:]]


@pytest.mark.parametrize(
    "result, message",
    [
        (torch.zeros((), dtype=torch.float64).numpy(), r"expected float32\[\], got float64\[\]"),
        (torch.zeros(1).numpy(), r"expected float32\[\], got float32\[1\]"),
    ],
)
def test_output_of_another_dtype_or_shape_raises(result: Any, message: str) -> None:
    programs = aotgrad.trace(lambda x: x.sin().sum(), x_(4, 6)).export(flat=True)
    run = ort_backend.compile_program(programs.forward)
    run.session = FakeSession(run.session, result)
    with pytest.raises(BackendError, match=message):
        run(*programs.lifted, x_(4, 6))


# ---------------------------------------------------------------- convolution backward


CONVOLUTIONS = [
    # (spatial dims, stride, padding, dilation, groups, size, kernel)
    *itertools.product([1, 2], [1, 2, 3], [0, 1, 2], [1, 2], [1, 2], [7, 8], [1, 3]),
    *itertools.product([3], [1, 2], [0, 1], [1, 2], [1, 2], [5], [3]),
]


def test_convolution_backward_decomposition_equals_eager() -> None:
    """Note [Convolution backward as convolutions]: the three gradients equal eager's kernel's over
    strides, paddings, dilations, groups, 1-3 spatial dims and sizes no window fits exactly
    (float64: the decomposition must be exact, not close)."""
    aten = torch.ops.aten
    checked = 0
    for dims, stride, padding, dilation, groups, size, kernel in CONVOLUTIONS:
        x = torch.randn(2, 2 * groups, *[size] * dims, dtype=torch.float64)
        w = torch.randn(3 * groups, 2, *[kernel] * dims, dtype=torch.float64)
        s, p, d = [stride] * dims, [padding] * dims, [dilation] * dims
        y = aten.convolution(x, w, None, s, p, d, False, [0] * dims, groups)
        if y.numel() == 0:
            continue
        args = (torch.randn_like(y), x, w, [w.shape[0]], s, p, d, False, [0] * dims, groups)
        for mask in ([True, True, True], [True, False, False], [False, True, False]):
            expected = aten.convolution_backward(*args, mask)
            got = backward_ops._convolution_backward(*args, mask)
            for g, e in zip(got, expected, strict=True):
                if e is None:
                    assert g is None
                else:
                    torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 100


AVG_POOLS = [
    # (spatial dims, kernel, stride, padding, ceil_mode, count_include_pad, divisor, size)
    *(
        c
        for c in itertools.product(
            [2], [1, 2, 3, 4], [1, 2, 3], [0, 1, 2], [False, True], [False, True], [None, 3], [5, 8]
        )
        if 2 * c[3] <= c[1]
    ),
    *(
        c
        for c in itertools.product(
            [3], [2, 3], [1, 2], [0, 1], [False, True], [False, True], [None, 3], [5]
        )
        if 2 * c[3] <= c[1]
    ),
]


def test_avg_pool_backward_decomposition_equals_eager() -> None:
    """Note [Average pooling backward as a transposed convolution]: the gradient equals eager's kernel's over
    kernels, strides, paddings, ceil_mode (clipped windows), count_include_pad,
    divisor_override and sizes no window fits exactly; in float64, so exact, not close."""
    aten = torch.ops.aten
    checked = 0
    for dims, kernel, stride, padding, ceil, include, divisor, size in AVG_POOLS:
        op = aten.avg_pool2d_backward if dims == 2 else aten.avg_pool3d_backward
        pool = F.avg_pool2d if dims == 2 else F.avg_pool3d
        x = torch.randn(2, 3, *[size + i for i in range(dims)], dtype=torch.float64)
        y = pool(x, kernel, stride, padding, ceil, include, divisor)
        k, s, p = [kernel] * dims, [stride] * dims, [padding] * dims
        args = (torch.randn_like(y), x, k, s, p, ceil, include, divisor)
        got = backward_ops.AS_FORWARD_OPS[op.default](*args)
        torch.testing.assert_close(got, op(*args), rtol=1e-12, atol=1e-12, msg=str(args[2:]))
        checked += 1
    assert checked > 200
    # Unbatched input, a kernel and stride per axis or one for all, the stride left out (the
    # kernel's).
    decompose = backward_ops.AS_FORWARD_OPS[aten.avg_pool2d_backward.default]
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    for kernel, stride, padding in [
        ([3, 2], [2, 1], [1, 0]),
        ([3, 2], [], [1, 0]),
        ([3], [2], [1]),
    ]:
        y = aten.avg_pool2d(x, kernel, stride, padding, True, False)
        args = (torch.randn_like(y), x, kernel, stride, padding, True, False, None)
        torch.testing.assert_close(decompose(*args), aten.avg_pool2d_backward(*args))


ADAPTIVE_POOLS = [
    # (input sizes, output sizes): down, not dividing, up, to 1, unbatched
    ((2, 3, 8, 8), (2, 2)),
    ((2, 3, 7, 5), (3, 2)),
    ((2, 3, 3, 4), (5, 7)),
    ((2, 3, 6, 5), (1, 3)),
    ((3, 7, 5), (4, 3)),
    ((2, 3, 5, 7, 6), (2, 3, 4)),
    ((3, 4, 5, 6), (3, 2, 5)),
]


def test_adaptive_avg_pool_backward_decomposition_equals_eager() -> None:
    """Note [Adaptive average pooling backward as matmuls], in float64."""
    aten = torch.ops.aten
    for size, out in ADAPTIVE_POOLS:
        x = torch.randn(size, dtype=torch.float64)
        pool, op = (
            (aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward)
            if len(out) == 2
            else (aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward)
        )
        grad = torch.randn_like(pool(x, list(out)))
        got = backward_ops.AS_FORWARD_OPS[op.default](grad, x)
        torch.testing.assert_close(got, op(grad, x), rtol=1e-12, atol=1e-12, msg=str(size))


class AvgPoolNet(nn.Module):
    """densenet's transition (a strided average pool), a ceil_mode pool that counts only
    the input's elements, and an adaptive pool whose windows overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.transition = nn.AvgPool2d(2, stride=2)
        self.clipped = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.adaptive = nn.AdaptiveAvgPool2d((3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adaptive(self.clipped(self.transition(self.conv(x)).relu())).flatten(1)


def test_avg_pool_backward_runs() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 13, 11, generator=torch.Generator().manual_seed(1))
    check_backend(AvgPoolNet(), lambda y: y.square().sum(), (x,), {}, BACKEND, **TINY)


class BroadcastingCopies(nn.Module):
    """Writes that broadcast their source (``aten.copy`` of another shape): a 0-d tensor into
    a column read through ``unsqueeze`` (BART's ``shifted[:, 0] = start``), and a 0-d int and
    a row into a buffer only its sum is saved from, where a copy that kept its source's shape
    would give a wrong loss and gradient without an error."""

    def __init__(self, column: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.column = column

    def forward(self, start: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        shifted = self.w.clone()
        if self.column:
            shifted[:, 0] = start
        filled = torch.zeros(3, 4)
        filled.copy_(start.to(torch.int64) + 1)
        rows = torch.zeros(3, 4)
        rows.copy_(row)
        return (shifted.unsqueeze(1) * filled.sum() * rows.sum() * self.w.unsqueeze(1)).sum()


@pytest.mark.parametrize("column", [True, False], ids=["column", "sums_only"])
def test_broadcasting_copy_is_eager(column: bool) -> None:
    """Note [ONNX copy drops the destination's shape]: ``sums_only`` ran, wrong, before."""
    args = (torch.tensor(2.5), torch.arange(4.0))
    check_backend(BroadcastingCopies(column), lambda y: y, args, {}, BACKEND, **TINY)


def test_broadcasting_copy_left_by_the_exporter_is_refused() -> None:
    class Copy(nn.Module):
        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.copy.default(x, t).sum()

    program = torch.export.export(Copy(), (torch.zeros(3, 4), torch.tensor(1.0)))
    message = ort_backend._broadcasting_copies(program)
    assert message is not None and "aten.copy.default" in message
    same = torch.export.export(Copy(), (torch.zeros(3, 4), torch.ones(3, 4)))
    assert ort_backend._broadcasting_copies(same) is None


class ConvNet(nn.Module):
    """Strided, dilated and grouped convolutions, BatchNorm, a residual and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = x + self.grouped(x)
        return self.head(x.mean((2, 3)))


@pytest.mark.backends_slow
def test_convnet() -> None:
    torch.manual_seed(0)
    images = torch.randn(8, 3, 15, 15)
    check_backend(
        ConvNet(),
        lambda y: F.cross_entropy(y, torch.arange(8) % 10),
        (images,),
        {},
        BACKEND,
        **MODEL,
    )


# ---------------------------------------------------------------- library models


def library_case(
    name: str, resize: tuple[int, int] | None
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import library_models

    case = library_models.build(name)
    args, kwargs = case.resized(*resize) if resize else case.inputs
    return case, args, kwargs


# (model, inputs at (batch, size) or the case's own, decompositions). The vision models with
# BatchNorm run at batch 8: at batch 2, torchvision's ResNet-18 normalizes 2 values per channel
# at its last 1x1 stage, where the gradient is ill-conditioned and any rounding is amplified.
LIBRARY = [
    ("gpt2", None, "core_aten", MODEL),
    ("llama", None, "core_aten", MODEL),
    ("bert", None, "core_aten", MODEL),
    ("t5", None, "core_aten", MODEL),
    ("mistral", None, "core_aten", MODEL),
    ("qwen2", None, "core_aten", MODEL),
    ("efficientnet", (8, 0), "core_aten", CONVNET),
    ("resnet18", (8, 0), "core_aten", CONVNET),
    ("mobilenet_v3", (8, 0), "core_aten", CONVNET),
    ("convnext", None, "core_aten", MODEL),
    ("vit", None, "core_aten", MODEL),
    ("swin", None, "core_aten", MODEL),
    ("tv_vit", None, "core_aten", MODEL),
    ("deit", None, "core_aten", MODEL),
    # avg_pool2d_backward (Note [Average pooling backward as a transposed convolution]) and F.interpolate's
    # (Note [Upsampling backward in Core ATen]).
    ("densenet", (8, 0), "core_aten", CONVNET),
    ("mobilevit", (8, 0), "core_aten", CONVNET),
    # Writes whose source broadcasts (Note [ONNX copy drops the destination's shape]).
    ("bart", None, "core_aten", MODEL),
    ("whisper", None, "core_aten", MODEL),
    ("tv_swin", (8, 0), "core_aten", MODEL),
]


@pytest.mark.backends_slow
@pytest.mark.parametrize(
    "name, resize, decompositions, tolerance", LIBRARY, ids=[m[0] for m in LIBRARY]
)
def test_library_model(
    name: str, resize: tuple[int, int] | None, decompositions: str, tolerance: dict[str, float]
) -> None:
    case, args, kwargs = library_case(name, resize)
    check_backend(
        case.model, case.loss, args, kwargs, BACKEND, decompositions=decompositions, **tolerance
    )


@pytest.mark.backends_slow
@pytest.mark.parametrize("name", ["resnet18", "resnet10t"])
def test_timm_resnet_with_batchnorm(name: str) -> None:
    # resnet10t's shortcuts average-pool (Note [Average pooling backward as a transposed convolution]).
    import timm

    import library_models  # noqa: F401  (the torchvision shim, before timm imports it)

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    loss = lambda y: F.cross_entropy(y, torch.arange(8) % 10)  # noqa: E731
    check_backend(model, loss, (images,), {}, BACKEND, **CONVNET)


@pytest.mark.backends_slow
def test_gpt2_with_dropout_kept_is_refused() -> None:
    import library_models

    case = library_models.gpt2(0.1)
    programs = aotgrad.trace(case.model, *case.args, decompositions=None, **case.kwargs).export(
        flat=True, random="ops"
    )
    with pytest.raises(BackendError, match=r"(?s)draws random numbers.*transformers"):
        step(programs, BACKEND)


@pytest.mark.backends_slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_default_decompositions_refuse_attention(name: str) -> None:
    """Captured with the default table, the decoders keep CPU flash attention, whose
    ``logsumexp`` the exporter fills with zeros: refused by name (Note [ONNX functions with
    filler outputs]); their Core ATen capture runs (``test_library_model``)."""
    case, args, kwargs = library_case(name, None)
    programs = aotgrad.trace(case.model, *args, decompositions=None, **kwargs).export(flat=True)
    with pytest.raises(BackendError, match="_scaled_dot_product_flash_attention_for_cpu"):
        step(programs, BACKEND)


@pytest.mark.parametrize(
    "message",
    [
        "Node (node_unsqueeze) Op (Unsqueeze) [ShapeInferenceError] Unexpected axis value",
        "Load model failed: node with name 'node_unsqueeze' has an invalid input",
    ],
)
def test_load_error_names_the_aten_node(message: str) -> None:
    """Both ways ONNX Runtime names a node lead to the aten node it was made from."""
    import onnx

    node = onnx.helper.make_node("Unsqueeze", ["x", "axes"], ["y"], name="node_unsqueeze")
    entry = node.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.fx_node", "%unsqueeze = aten.unsqueeze.default"
    graph = onnx.helper.make_graph([node], "g", [], [])
    origin = ort_backend._onnx_node_origin(onnx.helper.make_model(graph), message)
    assert "node_unsqueeze (Unsqueeze) made from %unsqueeze = aten.unsqueeze.default" in origin
