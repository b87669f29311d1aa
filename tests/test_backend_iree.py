"""The flat exported programs compiled and run by IREE (docs/backends.md, "IREE").

Every model check runs one step of the programs in IREE and compares the loss, the buffers
after the step and every parameter's gradient with eager (tests/backend_check.py). Tolerances
are stated in each test; IREE computes in its own kernels, with its own summation order and
its own approximations of exp, tanh and erf, so float32 results differ from eager's in the
last bits (measured: up to ~1e-6 relative on these models); a wrong op is off by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

import aotgrad
from aotgrad.backends import iree, step
from aotgrad.backends.iree import compile_program
from aotgrad.errors import BackendError, CallError
from backend_check import check_backend
from models import GPT, ConvBN

pytestmark = pytest.mark.backends
slow = pytest.mark.backends_slow

# float32 through IREE's kernels: another summation order and other transcendental
# approximations than eager's; ~1e-6 relative measured, 1e-4 leaves room for larger sums.
RTOL, ATOL = 1e-4, 1e-5


def _library(name: str):
    library_models = pytest.importorskip("library_models")
    pytest.importorskip("transformers")
    return library_models.build(name)


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def _eager_step(fn, *inputs):
    """``fn``'s outputs and the gradients of ``sum(o.sum() for float outputs)`` in eager."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outputs = fn(*leaves)
    total = sum(o.sum() for o in outputs if o.is_floating_point() and o.requires_grad)
    total.backward()
    return outputs, leaves


# --- the fast subset (make test) --------------------------------------------------------


def test_gpt2():
    """transformers' GPT-2 (tied lm_head), Core ATen: IREE's step equals eager's."""
    case = _library("gpt2")
    check_backend(case.model, case.loss, case.args, case.kwargs, "iree", RTOL, ATOL)


def test_random_ops_refused():
    """A program that draws random numbers (its random ops kept: random="ops") is refused at
    compile time, naming the op and the user's line: IREE's generator cannot reproduce torch's
    dropout mask. (By default the draws are inputs: tests/test_random_draws.py.)"""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    programs = aotgrad.trace(lambda x: model(x).sum(), x).export(flat=True, random="ops")
    with pytest.raises(
        BackendError, match=r"(?s)forward program draws random.*aten\.\w+.*model\.1"
    ):
        step(programs, "iree")


@pytest.mark.parametrize("decompositions", ["core_aten", None])
def test_dropout_zero_runs(decompositions):
    """Dropout with p=0 draws nothing, and runs; with and without decompositions (GELU's
    backward is an op IREE lowers either way; LayerNorm's is not without decompositions)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    check_backend(model, lambda out: out.sum(), (x,), {}, "iree", RTOL, ATOL, decompositions)


def test_integer_bool_scalar_and_strided_inputs():
    """int64 (with values past 2**31: nothing demoted to int32), bool and 0-d inputs, a
    non-contiguous input, and int64 and bool outputs, against eager."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)

    def f(x, index, mask, scale, big):
        rows = (x @ w.t())[index].masked_fill(mask, 0.0) * scale
        return rows.sum(), big * 2**33 + index.sum(), mask.logical_not()

    x = torch.randn(3, 4).t()  # non-contiguous
    index, big = torch.tensor([0, 2, 3]), torch.tensor([3, -5])
    mask = torch.tensor([[True, False, True, False, True]] * 3)
    scale = torch.tensor(1.5, requires_grad=True)
    inputs = (x, index, mask, scale, big)
    programs = aotgrad.trace(f, *inputs, decompositions="core_aten").export(flat=True)
    result = step(programs, "iree")(*inputs)
    expected, leaves = _eager_step(f, *inputs)
    w_grad = w.grad
    for got, want in zip(result.outputs, expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
    grads = {getattr(d, "name", getattr(d, "path", None)): g for d, g in result.grads.items()}
    torch.testing.assert_close(grads["w"], w_grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grads["scale"], leaves[3].grad, rtol=RTOL, atol=ATOL)


def test_bfloat16_passes_as_bits():
    """bfloat16 tensors (no numpy dtype) travel as their bits, both ways, exactly."""
    x = torch.linspace(-3, 3, 6, dtype=torch.bfloat16).reshape(2, 3)

    def f(x):
        return x * 2 + 1, x.sum(0)

    programs = aotgrad.trace(f, x).export(flat=True)
    for got, want in zip(compile_program(programs.forward)(x), f(x), strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)


def test_float64_computes_in_float64():
    """IREE demotes float64 to float32 unless told not to (Note [IREE programs], 3): a
    float64 program must agree with eager to float64 precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    # float64 kernels of IREE: differences at ~1e-15 relative; float32 would give ~1e-7.
    check_backend(model, lambda out: out.exp().sum(), (x,), {}, "iree", 1e-10, 1e-12)


def test_results_are_fresh_tensors():
    """Every result is a new tensor: an output returned twice, or an input returned as it
    is, shares no memory with another result or with the caller's inputs."""

    def f(x):
        y = x * 2
        return y.sum(), y, y, x

    x = torch.randn(4, 3)
    programs = aotgrad.trace(f, x.requires_grad_()).export(flat=True)
    forward = compile_program(programs.forward)
    x = torch.randn(4, 3)
    total, y1, y2, x_out = forward(x)
    pointers = {t.untyped_storage().data_ptr() for t in (total, y1, y2, x_out, x)}
    assert len(pointers) == 5
    y1.add_(1)
    x_out.add_(1)
    torch.testing.assert_close(y2, x * 2)
    torch.testing.assert_close(x_out, x + 1)


def test_inputs_checked():
    """A call with an input of another shape or dtype than the program's is refused (the
    runtime would read int32 bytes as int64 ones)."""
    lin = nn.Linear(3, 2)
    programs = aotgrad.trace(lambda x: lin(x).sum(), torch.ones(4, 3)).export(flat=True)
    backward = compile_program(programs.backward)
    with pytest.raises(
        CallError, match=r"input 0 as \[4, 3\] torch.float32, got \[4, 3\] torch.float64"
    ):
        backward(torch.ones(4, 3, dtype=torch.float64), torch.ones(()))
    with pytest.raises(CallError, match=r"takes 2 input tensor\(s\), got 1"):
        backward(torch.ones(4, 3))
    grad_w, _ = backward(torch.ones(4, 3), torch.ones(()))
    torch.testing.assert_close(grad_w, torch.full((2, 3), 4.0))


def test_results_checked():
    """A result whose shape or dtype is not the program's output's raises, never returns."""
    lin = nn.Linear(3, 2)
    programs = aotgrad.trace(lambda x: lin(x).sum(), torch.ones(4, 3)).export(flat=True)
    backward = compile_program(programs.backward)
    backward.outputs = (backward.outputs[0], type(backward.outputs[1])((3,), torch.float32))
    with pytest.raises(BackendError, match=r"returned output 1 as \[2\] float32.*\[3\]"):
        backward(torch.ones(4, 3), torch.ones(()))


def test_not_flat_refused():
    """A program with parameters and mutations in its signature is refused: export flat."""
    model = ConvBN()
    x, target = torch.randn(2, 1, 8, 8), torch.randn(2, 10)
    programs = aotgrad.trace(model, x, target).export()
    with pytest.raises(BackendError, match=r"forward program.*export\(flat=True\)"):
        compile_program(programs.forward)


def test_unsupported_op_named():
    """An op IREE cannot lower is named with the user's line (here: batch norm without
    decompositions; Core ATen decomposes it)."""
    model = ConvBN()
    x, target = torch.randn(2, 1, 8, 8), torch.randn(2, 10)
    with pytest.raises(
        BackendError,
        match=r"(?s)could not compile aten\._native_batch_norm_legit_functional\.default"
        r" \(node \w+, [\w.]*bn1, at .*models\.py:\d+.*decompositions='core_aten'",
    ):
        check_backend(model, lambda out: out, (x, target), {}, "iree", RTOL, ATOL, None)


def test_compiler_error_names_its_node():
    """A compiler error names the one node it is about (Note [IREE programs], 3), not every
    node of the same op: of two convolutions, only the second (stride 2, padding 1, a 2x2
    map to 1x1) is one IREE 3.13 fails to compile."""
    model = nn.Sequential(nn.Conv2d(2, 2, 3, 1, 1), nn.Conv2d(2, 2, 3, 2, 1))
    x = torch.randn(1, 2, 2, 2)
    programs = aotgrad.trace(lambda x: model(x).sum(), x, decompositions="core_aten").export(
        flat=True
    )
    with pytest.raises(BackendError) as error:
        compile_program(programs.forward)
    message = str(error.value)
    assert "could not compile aten.convolution.default (node convolution_1," in message
    assert "(node convolution," not in message


def test_batch_norm_core_aten():
    """ConvBN in Core ATen (BatchNorm's aten.squeeze.dims rewritten, Note [IREE rewrites]):
    the loss, the running statistics after the step and the gradients equal eager's."""
    torch.manual_seed(0)
    x, target = torch.randn(4, 1, 8, 8), torch.randn(4, 10)
    check_backend(ConvBN(), lambda out: out, (x, target), {}, "iree", RTOL, ATOL)


def test_constant_tensor():
    """A tensor made at capture stays a constant of the program, inlined by the importer."""
    x = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return (x.sin() + torch.tensor([1.0, 2.0, 3.0, 4.0])).exp().sum()

    programs = aotgrad.trace(f, x).export(flat=True)
    result = step(programs, "iree")(x)
    expected, (leaf,) = _eager_step(lambda x: (f(x),), x)
    torch.testing.assert_close(result.outputs[0], expected[0].detach(), rtol=RTOL, atol=ATOL)
    (grad,) = result.grads.values()
    torch.testing.assert_close(grad, leaf.grad, rtol=RTOL, atol=ATOL)


def test_as_strided_of_strided_saved_value():
    """``as_strided`` of a non-contiguous saved value reads the right elements though IREE
    gets the value contiguous, and the importer's in-place rewrite of it works on a copy:
    the caller's program is left as it was."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)

    def f(x):
        y = x.t() * 2  # non-contiguous: strides (1, 4)
        return torch.as_strided(y, (3, 2), (1, 2), 1).sin().sum()

    programs = aotgrad.trace(f, x, decompositions="core_aten").export(flat=True)
    before = [str(program.graph) for program in (programs.forward, programs.backward)]
    result = step(programs, "iree")(x)
    assert [str(program.graph) for program in (programs.forward, programs.backward)] == before
    expected, (leaf,) = _eager_step(lambda x: (f(x),), x)
    torch.testing.assert_close(result.outputs[0], expected[0].detach(), rtol=RTOL, atol=ATOL)
    (grad,) = result.grads.values()
    torch.testing.assert_close(grad, leaf.grad, rtol=RTOL, atol=ATOL)


# --- the rest (make backends) -----------------------------------------------------------


@slow
def test_gpt_tied_weights():
    """tests/models.py's GPT, its embedding tied to its head (without decompositions its
    attention is refused, as test_library_model_without_decompositions shows)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    targets = torch.randint(0, 64, (2, 8))
    check_backend(GPT(), lambda out: out, (idx, targets), {}, "iree", RTOL, ATOL)


@slow
@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "bert",
        "t5",
        "roberta",
        "distilbert",
        "gpt2_cls",
        "opt",
        "gpt_neox",
        "mistral",
        "qwen2",
        "vit",
        "deit",
        "tv_vit",
        "bart",
        "whisper",
    ],
)
def test_library_model(name):
    """Library models that pass in Core ATen at their own sizes (docs/backends.md has the
    table)."""
    case = _library(name)
    check_backend(case.model, case.loss, case.args, case.kwargs, "iree", RTOL, ATOL)


@slow
@pytest.mark.parametrize(
    "name", ["convnext", "efficientnet", "shufflenet", "tv_regnet", "tv_efficientnet"]
)
def test_library_convnet(name):
    """Library convnets in Core ATen at batch 8 and 64x64 (at 32x32 some strided
    convolutions map 2x2 to 1x1, which IREE 3.13 cannot compile; batch 8 keeps BatchNorm's
    statistics over enough values to be compared at float32 tolerances)."""
    case = _library(name)
    check_backend(case.model, case.loss, (_images(8, 64),), {}, "iree", RTOL, ATOL)


@slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_library_model_without_decompositions(name):
    """Without decompositions, transformers' attention is one
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which IREE's importer does not
    know: refused, naming the op and the line (Core ATen decomposes it, and passes)."""
    case = _library(name)
    with pytest.raises(
        BackendError,
        match=r"(?s)could not compile aten\._scaled_dot_product_flash_attention_for_cpu\.default"
        r" \(node \w+, [\w.]+attn, at .*sdpa_attention\.py",
    ):
        check_backend(case.model, case.loss, case.args, case.kwargs, "iree", RTOL, ATOL, None)


@slow
def test_torchvision_resnet18():
    """torchvision's ResNet-18 with BatchNorm, at batch 8 and 64x64: at 32x32 its layer4
    convolution (stride 2, padding 1, a 2x2 map to 1x1) is one IREE 3.13 fails to compile,
    and at batch 2 its last BatchNorm normalizes over 2 values, amplifying last-bit
    differences; the inputs are made meaningful rather than the tolerance loose."""
    case = _library("resnet18")
    check_backend(case.model, case.loss, (_images(8, 64),), {}, "iree", RTOL, ATOL)


@slow
def test_strided_convolution_to_one_refused():
    """The convolution IREE 3.13 cannot compile (stride 2, padding 1, a 2x2 map to 1x1) is
    refused at compile time, naming the node and module."""
    case = _library("resnet18")
    with pytest.raises(
        BackendError, match=r"(?s)aten\.convolution\.default \(node \w+, model\.layer4"
    ):
        check_backend(case.model, case.loss, case.args, case.kwargs, "iree", RTOL, ATOL)


@slow
def test_timm_resnet_batch_norm():
    """timm's ResNet-18 (BatchNorm, max pool) from a random config, at batch 8 and 64x64.
    (timm's resnet10t downsamples with average pooling, whose backward IREE 3.13 does not
    lower: refused, naming ``aten.avg_pool2d_backward``.)"""
    pytest.importorskip("library_models")  # its torchvision shim, before timm imports it
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    loss = lambda out: F.cross_entropy(out, torch.arange(8) % 10)  # noqa: E731
    check_backend(model, loss, (_images(8, 64),), {}, "iree", RTOL, ATOL)


def test_in_place_op_refused():
    """A program that writes a tensor in place (an edited graph: aotgrad's are functional)
    is refused, naming the op: under IREE's value semantics the write would be lost."""

    def f(x):
        y = x * 2
        return (y * (y + 1)).sum(), y

    x = torch.randn(3, requires_grad=True)
    programs = aotgrad.trace(f, x).export(flat=True)
    (add,) = programs.forward.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
    add.target = torch.ops.aten.add_.Tensor  # y.add_(1): y itself changes
    with pytest.raises(BackendError, match=r"writes its tensors in place \(aten\.add_\.Tensor"):
        compile_program(programs.forward)


# --- Note [IREE rewrites] ------------------------------------------------------------------


def _forward(f, *inputs):
    """The forward program of ``f`` (Core ATen), compiled by IREE."""
    programs = aotgrad.trace(f, *inputs, decompositions="core_aten").export(flat=True)
    return compile_program(programs.forward)


def _assert_same_bits(got, want, what):
    """Equal values, NaN where NaN, and zeros of the same sign."""
    assert got.dtype == want.dtype, what
    torch.testing.assert_close(
        got, want, rtol=0, atol=0, equal_nan=True, msg=lambda message: f"{what}: {message}"
    )
    if got.is_floating_point():
        numbers = ~want.isnan()
        assert torch.equal(got[numbers].signbit(), want[numbers].signbit()), f"{what}: signs"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_fmod_integers_exact(dtype):
    """Integer ``fmod`` (``torch.roll``'s Core ATen index arithmetic) by tensors and
    scalars of either sign, and by a float scalar (computed in float32, as torch does),
    equal eager's: C's sign rule, the result takes the dividend's sign."""
    a = torch.arange(-20, 21, dtype=dtype)
    b = torch.tensor([3, -3, 7, -1, 1, 20, -20, 40, -40] * 5, dtype=dtype)[:41]

    def f(a, b):
        return torch.fmod(a, b), torch.fmod(a, 3), torch.fmod(a, -7), torch.fmod(a, 2.5)

    got = _forward(f, a, b)(a, b)
    for i, (g, want) in enumerate(zip(got, f(a, b), strict=True)):
        _assert_same_bits(g, want, f"output {i}")


def _fmod_by_tensor(a, b):
    return (torch.fmod(a, b),)


def _fmod_by_scalars(a, b):
    return torch.fmod(a, 0.1), torch.fmod(a, -3), torch.fmod(a, float("inf"))


@pytest.mark.parametrize("f", [_fmod_by_tensor, _fmod_by_scalars])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fmod_floats_exact(dtype, f):
    """Float ``fmod`` equals eager's bit for bit: quotients far past 2**24, signed zeros,
    infinities and NaN, by tensors and by scalars. (IREE compiles ``fmod.Tensor`` itself
    as ``a - b * trunc(a / b)``, which gave 685 of these 2144 float32 values wrong, silently.)"""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2000, generator=g) * 10.0 ** torch.randint(-3, 12, (2000,), generator=g)
    b = torch.randn(2000, generator=g) * 10.0 ** torch.randint(-3, 3, (2000,), generator=g)
    edge = torch.tensor([0.0, -0.0, 1.0, -1.0, 6.0, -6.0, 0.3, -7.5, 3.0])
    edge = torch.cat([edge, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    pairs = torch.cartesian_prod(edge, edge)
    a, b = torch.cat([a, pairs[:, 0]]).to(dtype), torch.cat([b, pairs[:, 1]]).to(dtype)
    got = _forward(f, a, b)(a, b)
    for i, (g, want) in enumerate(zip(got, f(a, b), strict=True)):
        _assert_same_bits(g, want, f"output {i}")


def test_fmod_mixed_dtypes_broadcast():
    """Operands of other dtypes than the result (cast first, as torch's type promotion
    does: an int8 tensor by a 0-d int64 tensor stays int8) and broadcast shapes."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 1, generator=g) * 100, torch.randn(1, 4, generator=g)
    ints, small = torch.arange(-6, 6).reshape(3, 4), torch.arange(-100, 100, dtype=torch.int8)

    def f(a, b, ints, small):
        wide = torch.tensor(0.7, dtype=torch.float64)
        return (
            *(torch.fmod(a, b), torch.fmod(b, a), torch.fmod(a, ints), torch.fmod(ints, b)),
            *(torch.fmod(a, wide), torch.fmod(small, torch.tensor(300))),
        )

    got = _forward(f, a, b, ints, small)(a, b, ints, small)
    for i, (g, want) in enumerate(zip(got, f(a, b, ints, small), strict=True)):
        _assert_same_bits(g, want, f"output {i}")


def test_fmod_float64_refused():
    """float64 ``fmod`` is refused, naming the op and the user's line: IREE's CPU
    executables do not link libm's ``fmod``, and its own lowering is inexact."""
    a = torch.randn(5, dtype=torch.float64)
    with pytest.raises(
        BackendError,
        match=r"aten\.fmod\.Tensor \(node fmod, .*test_backend_iree.*\) exactly in float64",
    ):
        _forward(lambda a: torch.fmod(a, a + 1), a)


def test_fmod_by_integer_zero_refused():
    """An integer ``fmod`` by 0 raises ZeroDivisionError in torch; refused, not run."""
    a = torch.arange(5)
    with pytest.raises(BackendError, match=r"aten\.fmod\.Scalar .* by an integer 0"):
        _forward(lambda a: torch.fmod(a, 0), a)


# Pads with negative amounts (crops), on their own and mixed with positive ones per side.
_PADS = [
    (0, 0, -1, 0),
    (-1, 2),
    (2, -1),
    (-1, -1, -2, 3),
    (-2, 0, 0, -3, 1, -1),
    (-3, 0),
    (-1, -1),
    (0, 0, 1, 0, 0, 0),  # CoaT's: its backward pads by -1
    (1, 1, 1, 1, 1, 1, 1, 1),
]


def test_constant_pad_negative_exact():
    """``F.pad`` with negative amounts in the forward, and the negative pads of every
    backward, equal eager's exactly (integer-valued cotangents: sums in any order agree)."""
    x = torch.randn(2, 4, 5, 3, generator=torch.Generator().manual_seed(0))

    def f(x):
        return tuple(F.pad(x, pad, value=0.5) for pad in _PADS)

    programs = aotgrad.trace(f, x.requires_grad_(), decompositions="core_aten").export(flat=True)
    outputs = f(x)
    g = torch.Generator().manual_seed(1)
    cotangents = [torch.randint(-8, 8, o.shape, generator=g).float() for o in outputs]
    result = step(programs, "iree")(x, cotangents=cotangents)
    for i, (got, want) in enumerate(zip(result.outputs, outputs, strict=True)):
        _assert_same_bits(got, want.detach(), f"output {i}")
    (grad,) = result.grads.values()
    (want,) = torch.autograd.grad(outputs, x, cotangents)
    _assert_same_bits(grad, want, "gradient")


def test_rewrite_checked(monkeypatch):
    """A rewrite whose result has another shape than the node's raises (never compiles)."""

    def transposed(emit, node):
        return emit(torch.ops.aten.t.default, node.args[0])

    monkeypatch.setitem(iree._REWRITES, torch.ops.aten.mm.default, transposed)
    x = torch.randn(2, 3)
    with pytest.raises(
        BackendError, match=r"expected a \[2, 2\] torch.float32 result, got \[3, 2\]"
    ):
        _forward(lambda x: x @ x.t() * 2, x)


def test_average_pooling_backward_runs():
    """``avg_pool2d_backward`` (densenet's transitions) and adaptive pooling's backward to more
    than 1x1, which IREE 3.13 cannot compile, run as the transposed convolution and matmuls
    they are (ops/backward_ops.py, IREE_AS_FORWARD_OPS), overlapping windows, padding
    and ceil_mode included."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.AvgPool2d(2),
        nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.AdaptiveAvgPool2d((2, 3)),
    )
    x = torch.randn(2, 3, 9, 9)
    check_backend(model, lambda out: out.square().sum(), (x,), {}, "iree", RTOL, ATOL)


@slow
@pytest.mark.parametrize("name", ["swin", "tv_swin", "coat"])
def test_library_windows(name):
    """Library models that need Note [IREE rewrites], at batch 8: timm's and torchvision's
    Swin roll their windows (``aten.fmod`` in Core ATen), CoaT pads by a row whose backward
    crops it (``aten.constant_pad_nd`` by -1)."""
    case = _library(name)
    args, kwargs = case.resized(8, 0)
    check_backend(case.model, case.loss, args, kwargs, "iree", RTOL, 1e-4)
