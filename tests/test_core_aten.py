"""decompositions="core_aten": every op of the forward and backward graphs is in PyTorch's Core
ATen opset, on every frontend, and the graphs stay equal to eager (Note [Core ATen graphs])."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad import aot_function, aot_module
from aotgrad.errors import ConfigError, UnsupportedOpError
from aotgrad.ops.core_aten import is_core, non_core_nodes
from aotgrad.runtime.boxing import nop
from aotgrad.testing import verify
from models import GPT, MLP, ConvBN, DeepMLP, SeedNet

aten = torch.ops.aten
RTOL, ATOL = 1e-4, 1e-5


def _offenders(graphs: list[torch.fx.GraphModule]) -> list[str]:
    return sorted({str(n.target) for gm in graphs for n in non_core_nodes(gm.graph)})


def _check_function(f, *args) -> None:
    """``f``'s outputs and gradients equal eager's, and its graphs hold Core ATen only."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    compile_fn = lambda fn: aot_function(  # noqa: E731
        fn, decompositions="core_aten", fw_compiler=record, bw_compiler=record
    )
    verify(f, *args, rtol=RTOL, atol=ATOL, compile_fn=compile_fn)
    assert graphs and not _offenders(graphs)


def _check_module(model: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    """Outputs and gradients equal eager's, and every compiled graph holds Core ATen only."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    def compile_fn(m):
        return aot_module(m, decompositions="core_aten", fw_compiler=record, bw_compiler=record)

    verify(model, *args, rtol=RTOL, atol=ATOL, compile_fn=compile_fn, **(kwargs or {}))
    assert len(graphs) == 2, "expected a forward and a backward graph"
    offenders = _offenders(graphs)
    assert not offenders, f"ops outside Core ATen in the graphs: {offenders}"
    ops = {n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert all(is_core(op) for op in ops)


def _seed_net_args():
    return torch.randn(1, 4, 4, 4), torch.randn(1)


SUITE = {
    "mlp": lambda: (MLP(), (torch.randn(4, 16),)),
    "deep_mlp": lambda: (DeepMLP(width=32, depth=3), (torch.randn(4, 32),)),
    "conv_bn": lambda: (ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))),
    "gpt": lambda: (GPT(), (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))),
    "seed_net": lambda: (SeedNet(), _seed_net_args()),
}


@pytest.mark.parametrize("name", sorted(SUITE))
def test_model_suite_is_core_aten_and_equal_to_eager(name):
    torch.manual_seed(0)
    model, args = SUITE[name]()
    _check_module(model, args)


LIBRARY = ["gpt2", "bert", "llama", "vit", "resnet18", "convnext", "bart", "whisper"]


@pytest.mark.parametrize("name", LIBRARY)
def test_library_models_are_core_aten_and_equal_to_eager(name):
    # The model table's core_aten check (tests/test_real_models.py, `make models` runs it on
    # every library model): compared with eager in float64, then Core ATen only.
    library_models = pytest.importorskip("library_models")
    from test_real_models import check_core_aten

    check_core_aten(library_models.build(name))


def test_eval_mode_batch_norm_is_core_aten():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    _check_module(model, (torch.randn(2, 3, 8, 8),))


def test_trace_takes_core_aten():
    def f(x, w):
        return F.silu(x @ w).softmax(-1)

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    default = aotgrad.trace(f, x, w)
    core = aotgrad.trace(f, x, w, decompositions="core_aten")
    assert _offenders([default.backward]), "the default capture keeps silu_backward"
    assert not _offenders([core.forward, core.backward])
    assert core.backward is not None


def test_attention_backward_in_core_ops_is_eager_grouped_heads_and_masks():
    # CPU flash attention's backward has no decomposition in PyTorch: aotgrad's, with GQA,
    # a causal mask and a float mask, against eager's kernel.
    def f(q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, scale=0.3)
        return a + b

    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(2))
    mask = torch.randn(5, 5)
    _check_function(f, q, k, v, mask)


def test_unknown_decomposition_set_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"'core_atn' is not a decomposition set.*'core_aten'"):
        aot_function(torch.sin, decompositions="core_atn")
    with pytest.raises(ConfigError, match="core"):
        aotgrad.trace(torch.sin, torch.randn(2), decompositions="core")


def test_an_op_without_a_core_decomposition_is_refused_by_name(monkeypatch):
    # An op left outside Core ATen is a loud error naming it, never a graph that breaks the
    # promise: here, as if PyTorch had no decomposition of silu.
    from aotgrad.ops import core_aten as opset

    table = dict(opset.decomposition_set("core_aten"))
    table.pop(aten.silu.default)
    monkeypatch.setattr(opset, "_core_aten_table", lambda: table)

    def f(x):
        return F.silu(x)

    with pytest.raises(UnsupportedOpError, match=r"aten\.silu\.default \(forward"):
        aotgrad.trace(f, torch.randn(3, 4, requires_grad=True), decompositions="core_aten")


def test_getitem_and_aotgrad_ops_are_allowed():
    assert is_core(operator.getitem)
    assert is_core(torch.ops.aotgrad.manual_seed.default)
    assert is_core(aten.mm.default) and not is_core(aten.silu_backward.default)


def test_disk_cache_keys_the_decomposition_set(tmp_path, monkeypatch):
    # A graph captured without core_aten is never served for a call that asks for it, nor
    # the reverse: the set's name is in the key.
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    def f(x):
        return F.silu(x) * 2

    x = torch.randn(3, 4, requires_grad=True)
    aot_function(f, fw_compiler=record)(x)
    assert _offenders(graphs[-1:])
    aot_function(f, fw_compiler=record, decompositions="core_aten")(x)
    assert not _offenders(graphs[-1:]), "a graph without core_aten was served from the disk"
    aot_function(f, fw_compiler=record)(x)
    assert _offenders(graphs[-1:]), "a core_aten graph was served to a default call"
    assert len(list(tmp_path.rglob("*"))) > 0


def test_dynamo_backend_takes_core_aten():
    import aotgrad.dynamo

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    def f(x):
        return F.silu(x).sum()

    torch._dynamo.reset()
    backend = aotgrad.dynamo.backend(record, record, decompositions="core_aten")
    x = torch.randn(5, requires_grad=True)
    out = torch.compile(f, backend=backend)(x)
    out.backward()
    torch._dynamo.reset()
    expected = torch.autograd.grad(f(x), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=RTOL, atol=ATOL)
    assert len(graphs) == 2 and not _offenders(graphs)


@pytest.mark.parametrize(
    "size, stride, offset", [((2, 3), (1, 2), 1), ((3,), (4,), 2), ((2, 2), (4, 1), 5)]
)
def test_as_strided_scatter_decomposition_is_the_op(size, stride, offset):
    from aotgrad.ops.core_aten import EXTRA_DECOMPOSITIONS

    decompose = EXTRA_DECOMPOSITIONS[aten.as_strided_scatter.default]
    base, src = torch.randn(3, 4), torch.randn(size)
    expected = aten.as_strided_scatter.default(base, src, size, stride, offset)
    torch.testing.assert_close(decompose(base, src, size, stride, offset), expected)
    with pytest.raises(UnsupportedOpError, match="non-contiguous"):
        decompose(base.t(), src, size, stride, offset)


def test_dropout_kept_in_the_graph_is_refused_by_name():
    # Eager's CPU dropout draws with bernoulli_ (not Core ATen); its decomposition would draw
    # other numbers, so with the random ops kept (random="ops") the capture is refused, naming
    # the op, why, and the option that takes draws out (tests/test_random_draws.py).
    x = torch.randn(4, 4, requires_grad=True)
    match = r"bernoulli\.p \(forward.*a random op.*random='inputs'"
    with pytest.raises(UnsupportedOpError, match=match):
        aotgrad.aot_function(lambda x: F.dropout(x, 0.5), decompositions="core_aten", random="ops")(
            x
        )


def test_scan_layers_takes_core_aten():
    # The body of scan_layers (one layer's forward and backward) is captured in Core ATen.
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.LayerNorm(4)) for _ in range(3)
    )
    eager = copy.deepcopy(layers)
    x = torch.randn(2, 4)
    y = aotgrad.scan_layers(
        layers, x, decompositions="core_aten", fw_compiler=record, bw_compiler=record
    )
    y.sum().backward()
    expected = x
    for layer in eager:
        expected = layer(expected)
    expected.sum().backward()
    torch.testing.assert_close(y, expected, rtol=RTOL, atol=ATOL)
    for p, e in zip(layers.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=RTOL, atol=ATOL)
    assert len(graphs) == 2 and not _offenders(graphs)


def test_create_graph_backward_under_core_aten_is_eager():
    compile_fn = lambda fn: aot_function(fn, decompositions="core_aten")  # noqa: E731
    x = torch.randn(4, requires_grad=True)
    verify(lambda x: F.silu(x).sum(), x, create_graph=True, compile_fn=compile_fn)


def test_tensor_constant_written_into_is_core_aten():
    # bart's and whisper's shift_tokens_right: torch.tensor(...) lifted (lift_fresh_copy),
    # then written into; and a buffer made with new_empty_strided. Both decompose exactly.
    def f(x):
        start = torch.tensor([[0.5, 1.5, 2.5]])
        start[:, 0] = 3.0
        buffer = x.new_empty_strided((3, 2), (1, 3))
        buffer.copy_(x.t() * start.t())
        return buffer.sin()

    x = torch.randn(2, 3, requires_grad=True)
    _check_function(f, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("masking", ["none", "causal", "float_mask"])
def test_flash_attention_decomposition_gives_the_kernels_logsumexp(dtype, masking):
    # PyTorch's decomposition returns the probabilities where the kernel returns logsumexp;
    # aotgrad's returns the kernel's (shape, dtype and values), so a graph decomposed after
    # capture hands its backward what the captured one did.
    from aotgrad.ops.core_aten import EXTRA_DECOMPOSITIONS

    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(2, 4, 5, 8, dtype=dtype)
    k, v = torch.randn(2, 2, 5, 8, dtype=dtype), torch.randn(2, 2, 5, 8, dtype=dtype)
    kwargs = {"attn_mask": torch.randn(5, 5, dtype=dtype)} if masking == "float_mask" else {}
    causal = masking == "causal"
    out, lse = op(q, k, v, 0.0, causal, **kwargs)
    got_out, got_lse = EXTRA_DECOMPOSITIONS[op](q, k, v, 0.0, causal, **kwargs)
    assert (got_lse.shape, got_lse.dtype) == (lse.shape, lse.dtype)
    torch.testing.assert_close(got_lse, lse)
    # The output is PyTorch's decomposition's, which rounds bfloat16 otherwise than the kernel.
    tolerance = {"atol": 1e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got_out, out, **tolerance)


def test_histc_is_refused_with_its_reason():
    # mixtral counts tokens per expert with histc: no exact decomposition, so it is refused
    # by name, with why, at the user's line.
    def f(x):
        return x * torch.histc(x.detach(), bins=4, min=0, max=3).sum()

    with pytest.raises(
        UnsupportedOpError, match=r"histc\.default \(forward.*no exact decomposition"
    ):
        aotgrad.trace(f, torch.rand(8, requires_grad=True), decompositions="core_aten")


@pytest.mark.parametrize(
    "size, layout", [((2, 3, 4), (0, 1, 2)), ((2, 3, 4), (2, 0, 1)), ((1, 3, 1), (1, 2, 0))]
)
def test_empty_permuted_decomposition_lays_out_as_the_op(size, layout):
    from aotgrad.ops.core_aten import EXTRA_DECOMPOSITIONS

    op = aten.empty_permuted.default
    got = EXTRA_DECOMPOSITIONS[op](list(size), list(layout), dtype=torch.float64)
    expected = op(size, layout, dtype=torch.float64)
    assert (got.shape, got.stride(), got.dtype) == (
        expected.shape,
        expected.stride(),
        expected.dtype,
    )


def test_empty_like_is_core_aten():
    # torch.empty_like records empty_permuted (mixtral's inverse permutation).
    def f(x):
        y = torch.empty_like(x.permute(1, 0))
        y.copy_(x.t().sin())
        return y * 2

    x = torch.randn(3, 4, requires_grad=True)
    traced = aotgrad.trace(f, x, decompositions="core_aten")
    assert not _offenders([traced.forward, traced.backward])
    torch.testing.assert_close(traced(x), f(x))


# Upsampling backward (Note [Upsampling backward in Core ATen]): (op, interpolating, dims).
UPSAMPLE_BACKWARDS = [
    (aten.upsample_nearest1d_backward.default, False, 1),
    (aten.upsample_nearest2d_backward.default, False, 2),
    (aten.upsample_nearest3d_backward.default, False, 3),
    (aten._upsample_nearest_exact1d_backward.default, False, 1),
    (aten._upsample_nearest_exact2d_backward.default, False, 2),
    (aten._upsample_nearest_exact3d_backward.default, False, 3),
    (aten.upsample_linear1d_backward.default, True, 1),
    (aten.upsample_bilinear2d_backward.default, True, 2),
    (aten.upsample_trilinear3d_backward.default, True, 3),
    (aten.upsample_bicubic2d_backward.default, True, 2),
]
# (input size, output size, scale factor or None) of one axis: up, down, equal, to and from 1.
UPSAMPLE_AXES = [
    (5, 9, None),
    (7, 3, None),
    (4, 4, None),
    (1, 3, None),
    (3, 1, None),
    (5, 8, 1.7),
    (7, 4, 0.6),
    (4, 8, 2.0),
    (6, 3, 0.5),
    (5, 11, 2.3),
]


@pytest.mark.parametrize("op, interpolating, dims", UPSAMPLE_BACKWARDS, ids=str)
def test_upsampling_backward_decomposition_is_eager_kernel(op, interpolating, dims):
    from aotgrad.ops.core_aten import EXTRA_DECOMPOSITIONS

    decompose = EXTRA_DECOMPOSITIONS[op]
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for first in range(len(UPSAMPLE_AXES)):
        # Each axis its own setting, rotating through the list.
        axes = [UPSAMPLE_AXES[(first + 3 * d) % len(UPSAMPLE_AXES)] for d in range(dims)]
        input_size = [2, 3, *(a[0] for a in axes)]
        output_size = [a[1] for a in axes]
        given = [a[2] for a in axes]
        for scales in ([None] * dims, given):
            for align in (False, True) if interpolating else (None,):
                grad = torch.randn(2, 3, *output_size, dtype=torch.float64, generator=gen)
                head = (align,) if interpolating else ()
                args = (grad, output_size, input_size, *head, *scales)
                torch.testing.assert_close(
                    decompose(*args),
                    op(*args),
                    rtol=1e-12,
                    atol=1e-12,
                    msg=lambda m, args=args: f"{args[1:]}: {m}",
                )
                checked += 1
    assert checked >= 20


INTERPOLATIONS = [
    (1, "nearest"),
    (2, "nearest"),
    (3, "nearest"),
    (2, "nearest-exact"),
    (1, "linear"),
    (2, "bilinear"),
    (3, "trilinear"),
    (2, "bicubic"),
]


@pytest.mark.parametrize("dims, mode", INTERPOLATIONS)
def test_interpolate_is_core_aten_and_eager(dims, mode):
    # F.interpolate (timm's mobilevit) captured in Core ATen, forward and backward against
    # eager's kernels in float64: sizes up and down, scale factors, align_corners, and
    # channels_last inputs.
    settings = [
        {"size": (9, 4, 6)[:dims]},
        {"scale_factor": (1.7, 0.6, 2.0)[:dims]},
        {"scale_factor": 2.0, "recompute_scale_factor": True},
    ]
    linear = mode in ("linear", "bilinear", "trilinear", "bicubic")
    for setting in settings:
        for align in (False, True) if linear else (None,):
            for channels_last in (False, True) if dims > 1 else (False,):
                kwargs = dict(setting, mode=mode)
                if linear:
                    kwargs["align_corners"] = align
                x = torch.randn(2, 3, *(5, 7, 4)[:dims], dtype=torch.float64)
                if channels_last:
                    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
                    x = x.contiguous(memory_format=fmt)
                x.requires_grad_(True)

                def f(x, kwargs=kwargs):
                    return F.interpolate(x.sin(), **kwargs).cos()

                traced = aotgrad.trace(f, x, decompositions="core_aten")
                assert not _offenders([traced.forward, traced.backward]), kwargs
                eager = f(x)
                grad_out = torch.randn_like(eager)
                (expected,) = torch.autograd.grad(eager, x, grad_out)
                compiled = aot_function(f, decompositions="core_aten")
                got = compiled(x)
                torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
                (grad,) = torch.autograd.grad(got, x, grad_out)
                torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12, msg=str(kwargs))
