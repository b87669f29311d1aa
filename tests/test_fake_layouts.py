"""Note [Layouts without decompositions]: each shortcut gives the layouts the fake mode's own
decomposition gives, and declines what it does not cover."""

from __future__ import annotations

import itertools

import pytest
import torch

import aotgrad
from aotgrad._torch_compat import FakeTensorMode
from aotgrad.capture.tracing.fast.layouts import LAYOUTS, Layout, Pointwise, fast_layouts

aten = torch.ops.aten

SHAPES = [(2, 8, 4, 4), (2, 8, 1, 1), (2, 1, 3, 5), (3, 8), (2, 4, 6)]
FORMATS = [torch.contiguous_format, torch.channels_last]
DTYPES = [torch.float32, torch.float64]


def _required(op):
    return [a for a in op._schema.arguments if not a.kwarg_only and not a.has_default_value()]


def _keywords(op):
    return [a for a in op._schema.arguments if a.kwarg_only]


def _inputs(shape, memory_format, dtype):
    x = torch.empty(shape, dtype=dtype)
    if memory_format is torch.channels_last and len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _calls(x):
    c = x.shape[1]
    v = lambda: torch.empty(c, dtype=x.dtype)  # noqa: E731
    g = torch.empty_like(x)
    return {
        "batch norm": (
            aten._native_batch_norm_legit_functional.default,
            (x, v(), v(), v(), v(), True, 0.1, 1e-5),
        ),
        "batch norm backward": (
            aten.native_batch_norm_backward.default,
            (g, x, v(), v(), v(), v(), v(), True, 1e-5, [True, True, True]),
        ),
        "batch norm backward, no weight grad": (
            aten.native_batch_norm_backward.default,
            (g, x, v(), v(), v(), v(), v(), True, 1e-5, [True, False, True]),
        ),
        "hardswish": (aten.hardswish.default, (x,)),
        "hardsigmoid": (aten.hardsigmoid.default, (x,)),
        "hardswish_backward": (aten.hardswish_backward.default, (g, x)),
        "hardsigmoid_backward": (aten.hardsigmoid_backward.default, (g, x)),
        "silu_backward": (aten.silu_backward.default, (g, x)),
        "gelu_backward": (aten.gelu_backward.default, (g, x)),
        "gelu_backward tanh": (aten.gelu_backward.default, (g, x), {"approximate": "tanh"}),
        "threshold_backward": (aten.threshold_backward.default, (g, x, 0.0)),
        **{str(op): (op, (x,)) for op in UNARY},
        **{str(op): (op, (x, 0.5)) for op in SCALAR},
        **{str(op): (op, (g, x)) for op in BINARY},
        "gelu tanh": (aten.gelu.default, (x,), {"approximate": "tanh"}),
        "add alpha": (aten.add.Tensor, (g, x), {"alpha": 2}),
        "div floor": (aten.div.Tensor_mode, (g, x), {"rounding_mode": "floor"}),
        "pow int": (aten.pow.Tensor_Scalar, (x, 2)),
        "leaky_relu slope": (aten.leaky_relu.default, (x, 0.2)),
    }


POINTWISE_UNARY = [op for op, rule in LAYOUTS.items() if rule == Pointwise(1)]
POINTWISE_BINARY = [op for op, rule in LAYOUTS.items() if rule == Pointwise(2)]
UNARY = [op for op in POINTWISE_UNARY if len(_required(op)) == 1]
SCALAR = [op for op in POINTWISE_UNARY if len(_required(op)) == 2]  # a tensor and a number
# div.Tensor_mode takes a rounding mode by keyword: its own entry in _calls
BINARY = [
    op
    for op in POINTWISE_BINARY
    if len(_required(op)) == 2 and all(a.has_default_value() for a in _keywords(op))
]


def _layer_norm_calls(x):
    n = list(x.shape[-1:])
    v = lambda: torch.empty(n, dtype=x.dtype)  # noqa: E731
    out, mean, rstd = aten.native_layer_norm.default(x, n, v(), v(), 1e-5)
    g = torch.empty_like(out)
    return {
        "layer norm": (aten.native_layer_norm.default, (x, n, v(), v(), 1e-5)),
        "layer norm backward": (
            aten.native_layer_norm_backward.default,
            (g, x, n, mean, rstd, v(), v(), [True, True, True]),
        ),
        "layer norm backward, input only": (
            aten.native_layer_norm_backward.default,
            (g, x, n, mean, rstd, v(), v(), [True, False, False]),
        ),
    }


# (shape, permutation): layer norm normalizes the last dimension of x.permute(...)
LAYER_NORM_INPUTS = [((2, 8, 4, 4), (0, 2, 3, 1)), ((2, 4, 8), None), ((3, 5, 8), (1, 0, 2))]


@pytest.mark.parametrize(("shape", "perm"), LAYER_NORM_INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_shortcuts_give_the_decompositions_layouts(shape, perm, dtype):
    mode = FakeTensorMode()
    mode.cache_enabled = False
    with mode:
        x = torch.empty(shape, dtype=dtype)
        x = x.permute(*perm) if perm else x
        for name, (op, args) in _layer_norm_calls(x).items():
            found = fast_layouts(op, args, {})
            assert found is not None, name
            assert found.tensors == tuple(_layouts(op(*args))), name


def test_layer_norm_over_size_one_dimensions_takes_the_decomposition():
    # the decomposition lays out (2, 1, 1, 8) otherwise than eager does; kept as it is
    with FakeTensorMode():
        x = torch.empty(2, 8, 1, 1).permute(0, 2, 3, 1)
        op, args = _layer_norm_calls(x)["layer norm"]
        assert fast_layouts(op, args, {}) is None


def _layouts(out):
    outs = out if isinstance(out, tuple | list) else (out,)
    return [None if o is None else Layout.like(o) for o in outs]


@pytest.mark.parametrize(
    ("shape", "memory_format", "dtype"), list(itertools.product(SHAPES, FORMATS, DTYPES))
)
def test_shortcuts_give_the_decompositions_layouts(shape, memory_format, dtype):
    mode = FakeTensorMode()
    mode.cache_enabled = False
    with mode:
        x = _inputs(shape, memory_format, dtype)
        for name, (op, args, *kwargs) in _calls(x).items():
            found = fast_layouts(op, args, kwargs[0] if kwargs else {})
            assert found is not None, name
            expected = op(*args, **(kwargs[0] if kwargs else {}))
            assert found.tensors == tuple(_layouts(expected)), name
            assert found.as_tuple == isinstance(expected, tuple | list), name


def test_shortcuts_decline_other_layouts_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(2, 8, 4, 4)
        sliced = x[:, :4]  # not dense
        g = torch.empty(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
        v = torch.empty(8)
        assert fast_layouts(aten.silu_backward.default, (sliced, sliced), {}) is None
        assert fast_layouts(aten.silu_backward.default, (g, x), {}) is None  # two layouts
        ints = torch.empty(2, 3, dtype=torch.int64)
        assert fast_layouts(aten.hardswish.default, (ints,), {}) is None
        single = torch.empty(1, 8, 1, 1)  # one value per channel: eager's error
        args = (single, v, v, v, v, True, 0.1, 1e-5)
        assert fast_layouts(aten._native_batch_norm_legit_functional.default, args, {}) is None
        args = (x, v, v, v, v, False, 0.1, 1e-5)  # eval mode: other shapes
        assert fast_layouts(aten._native_batch_norm_legit_functional.default, args, {}) is None
        short = torch.empty(4)
        args = (x, short, v, v, v, True, 0.1, 1e-5)  # a weight of the wrong size: eager's error
        assert fast_layouts(aten._native_batch_norm_legit_functional.default, args, {}) is None
    assert fast_layouts(aten.hardswish.default, (torch.empty(2),), {}) is None  # not fake
    with FakeTensorMode() as mode:
        sparse = mode.from_tensor(torch.eye(3).to_sparse())
        vector = mode.from_tensor(torch.ones(3).to_sparse())
        assert fast_layouts(aten.hardswish.default, (sparse,), {}) is None
        x, v = torch.empty(2, 3, 4, 4), torch.empty(3)
        args = (x, vector, v, v, v, True, 0.1, 1e-5)
        assert fast_layouts(aten._native_batch_norm_legit_functional.default, args, {}) is None


@pytest.mark.fast_path
def test_a_convnet_captures_the_same_graph_with_and_without_shortcuts(monkeypatch):
    from aotgrad.capture.tracing.fast import fake
    from models import ConvBN

    model, x, y = ConvBN(), torch.randn(2, 1, 8, 8), torch.randn(2, 10)
    taken = []

    def counting(*args):
        found = fast_layouts(*args)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(fake, "fast_layouts", counting)
    fast = aotgrad.trace(model, x, y)
    assert any(taken)  # batch norm and its backward took the shortcut
    monkeypatch.setattr(fake, "fast_layouts", lambda *a: None)
    slow = aotgrad.trace(model, x, y)
    assert fast.joint.code == slow.joint.code
    assert [
        Layout.like(n.meta["val"])
        for n in fast.joint.graph.nodes
        if "val" in n.meta and isinstance(n.meta["val"], torch.Tensor)
    ] == [
        Layout.like(n.meta["val"])
        for n in slow.joint.graph.nodes
        if "val" in n.meta and isinstance(n.meta["val"], torch.Tensor)
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("memory_format", FORMATS)
def test_pointwise_shortcuts_keep_half_precision(dtype, memory_format):
    mode = FakeTensorMode()
    mode.cache_enabled = False
    with mode:
        x = _inputs((2, 8, 4, 4), memory_format, dtype)
        g = torch.empty_like(x)
        calls = [(op, (x,)) for op in UNARY] + [(op, (x, 0.5)) for op in SCALAR]
        for op, args in calls + [(op, (g, x)) for op in BINARY]:
            found = fast_layouts(op, args, {})
            assert found is not None, op
            assert found.tensors == tuple(_layouts(op(*args))), op


def test_pointwise_shortcuts_decline_what_could_change_the_dtype():
    with FakeTensorMode():
        x = torch.empty(2, 3)
        assert fast_layouts(aten.mul.Scalar, (x, 1j), {}) is None  # complex result
        assert (
            fast_layouts(aten.add.Tensor, (x, torch.empty(2, 3, dtype=torch.float64)), {}) is None
        )
        assert fast_layouts(aten.add.Tensor, (x, torch.empty(3)), {}) is None  # broadcasts
        assert fast_layouts(aten.relu.default, (torch.empty(2, 3, dtype=torch.int64),), {}) is None


def test_a_tensor_of_known_value_keeps_the_fake_modes_path():
    mode = FakeTensorMode()
    known = mode.fake_tensor_converter.from_real_tensor(
        mode, torch.tensor([2.0]), make_constant=True
    )
    assert fast_layouts(aten.add.Tensor, (known, known), {}) is None
    with mode:
        assert (known + known).constant is not None  # the fake mode computes the value


def test_every_pointwise_rule_is_checked():
    with FakeTensorMode():
        checked = {call[0] for call in _calls(torch.empty(2, 3, 4, 5)).values()}
    assert set(POINTWISE_UNARY) | set(POINTWISE_BINARY) <= checked
