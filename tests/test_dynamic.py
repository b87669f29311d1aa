"""Dynamic shapes: one trace with symbolic sizes serves every size its guards allow."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import aotgrad
from aotgrad.testing import verify
from models import MLP


def test_one_entry_serves_batch_sizes_2_to_64_with_eager_gradients():
    torch.manual_seed(0)
    model = MLP()
    ours = copy.deepcopy(model)
    compiled = aotgrad.aot_module(ours, dynamic=True)
    for batch in (2, 3, 8, 17, 64):
        x = torch.randn(batch, 16)
        out = compiled(x)
        ref = model(x)
        torch.testing.assert_close(out, ref)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
    for p, q in zip(model.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    info = aotgrad.cache_info(compiled)
    assert (info.misses, info.hits, info.entries) == (1, 4, 1)


def test_symbolic_sizes_appear_in_the_graphs_and_signature():
    def f(x, w):
        return (x.reshape(x.shape[0], -1) @ w).relu()

    x, w = torch.randn(8, 4, 4, requires_grad=True), torch.randn(16, 3, requires_grad=True)
    traced = aotgrad.trace(f, x, w, dynamic=True)
    assert "sym_size" in traced.forward.code
    sizes = [s for s in traced.saved if s.is_size]
    assert sizes and all(
        str(d).startswith("saved: sym_size") for d in traced.signature.saved if "sym" in str(d)
    )


def test_parameters_stay_static_under_dynamic_true():
    traced = aotgrad.trace(MLP(), torch.randn(8, 16), dynamic=True)
    assert "sym_size" not in traced.forward.code
    assert traced.partitioned.joint.guards is not None
    expression = traced.partitioned.joint.guards.expression() or ""
    assert "param" not in expression and "L['t0']" not in expression  # only x is symbolic


def test_marked_dimensions_are_dynamic_and_others_specialize():
    f = aotgrad.aot_function(lambda x, w: (x @ w).relu())
    w = torch.randn(16, 4, requires_grad=True)
    for batch in (4, 9, 30):
        x = aotgrad.dynamic(torch.randn(batch, 16), dim=0)
        torch.testing.assert_close(f(x, w), (x @ w).relu())
    assert aotgrad.cache_info(f).entries == 1
    f(aotgrad.dynamic(torch.randn(4, 32), dim=0), torch.randn(32, 4))
    assert aotgrad.cache_info(f).entries == 2  # the unmarked dimension changed


def test_a_size_outside_the_guards_traces_again():
    f = aotgrad.aot_function(lambda x: x.sin() * 2, dynamic=True)
    f(torch.randn(8))
    f(torch.randn(1))  # size 1 is specialized
    assert aotgrad.cache_info(f).entries == 2


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.view(-1),
        lambda x: x[1:].t(),
        lambda x: (lambda a: (a, a.t(), a[1:]))(x.sin()),
        lambda x: ((x * 2).t(), (x * 2).view(-1)),
        lambda x: F.pad(x, (0, 1)).reshape(-1),
    ],
    ids=["input_view", "input_slice_t", "output_and_views", "two_views", "pad_reshape"],
)
def test_views_with_symbolic_layouts_are_rebuilt_at_each_size(fn):
    """Note [Symbolic layouts]: one entry, the right view at every size."""
    f = aotgrad.aot_function(fn, dynamic=True)
    for shape in [(4, 3), (5, 6), (7, 2)]:
        x = torch.randn(shape, requires_grad=True)
        outs, refs = pytree.tree_leaves(f(x)), pytree.tree_leaves(fn(x))
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref)
            assert (out.shape, out.stride()) == (ref.shape, ref.stride())
    assert aotgrad.cache_info(f).entries == 1
    verify(fn, torch.randn(5, 6, requires_grad=True), compile_fn=_dynamic)


def test_metadata_mutation_with_symbolic_layout_is_replayed():
    def f(x):
        x.t_()
        return x.mul_(2)

    compiled = aotgrad.aot_function(f, dynamic=True)
    for shape in [(4, 3), (5, 6)]:
        x = torch.randn(shape)
        y = x.clone()
        torch.testing.assert_close(compiled(x), f(y))
        assert (x.shape, x.stride()) == (y.shape, y.stride())
        torch.testing.assert_close(x, y)


_net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _net_loss(x):
    return _net(x).tanh().sum()


def test_mincut_partitions_dynamic_graphs_at_the_example_sizes():
    """Note [Weights at the example sizes]: one capture serves every batch, eager's gradients."""
    torch.manual_seed(0)
    compiled = aotgrad.aot_function(_net_loss, partition="mincut", dynamic=True)
    for batch in (3, 8, 17):
        x = torch.randn(batch, 16, requires_grad=True)
        _net.zero_grad()
        compiled(x).backward()
        got = [x.grad, *(p.grad for p in _net.parameters())]
        x.grad = None
        _net.zero_grad()
        _net_loss(x).backward()
        want = [x.grad, *(p.grad for p in _net.parameters())]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    info = aotgrad.cache_info(compiled)
    assert (info.misses, info.entries) == (1, 1)
    assert compiled.partitioned.strategy == "mincut"
    assert compiled.partitioned.recomputed  # the cut recomputes GELU's pointwise ops
    module = aotgrad.aot_module(MLP(), dynamic=True, partition="mincut")
    module(torch.randn(5, 16)).sum().backward()


def test_dynamic_traces_match_eager():
    compile_fn = lambda fn: aotgrad.aot_function(fn, dynamic=True)  # noqa: E731
    verify(
        lambda x: torch.softmax(x * 3, -1),
        torch.randn(5, 7, requires_grad=True),
        compile_fn=compile_fn,
    )


def _dynamic(fn):
    return aotgrad.aot_function(fn, dynamic=True)


# Note [Specializations are guards]: what a trace specialized on is checked on every call.


def test_a_size_the_trace_read_as_an_int_is_guarded():
    f = aotgrad.aot_function(lambda y: y * int(y.shape[1]), dynamic=True)
    torch.testing.assert_close(f(torch.ones(2, 4)), torch.full((2, 4), 4.0))
    torch.testing.assert_close(f(torch.ones(2, 6)), torch.full((2, 6), 6.0))
    torch.testing.assert_close(f(torch.ones(3, 4)), torch.full((3, 4), 4.0))
    info = aotgrad.cache_info(f)
    assert (info.entries, info.misses, info.hits) == (2, 2, 1)
    assert info.reasons[1] == "shape guard y.size()[1] == 4 failed"


def test_pad_then_reshape_has_the_size_of_each_call():
    f = aotgrad.aot_function(lambda y: F.pad(y, (0, 1)).reshape(-1), dynamic=True)
    assert f(torch.randn(2, 4)).shape == (10,)
    assert f(torch.randn(2, 6)).shape == (14,)
    assert f(torch.randn(3, 6)).shape == (21,)


def test_specialized_entries_are_kept_side_by_side():
    f = aotgrad.aot_function(lambda y: y * int(y.shape[1]), dynamic=True)
    for width in (4, 6, 4, 6):
        torch.testing.assert_close(f(torch.ones(2, width)), torch.full((2, width), float(width)))
    info = aotgrad.cache_info(f)
    assert (info.entries, info.misses, info.hits) == (2, 2, 2)


def test_a_guard_on_a_stride_is_checked():
    f = aotgrad.aot_function(lambda y: y * y.stride(0), dynamic=True)
    for width in (6, 8):  # both non-contiguous, strides 6 and 8
        torch.testing.assert_close(f(torch.ones(4, width)[:, :3]), torch.full((4, 3), width * 1.0))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (x * 2).clamp_(-1, 1),
        lambda x: (x * 2).clamp_min_(0),
        lambda x: (x * 2).clamp_(min=torch.zeros(x.shape[-1])),
        lambda x: F.hardswish(x * 2, inplace=True),
        lambda x: F.hardsigmoid(x * 2, inplace=True),
        lambda x: F.relu6(x * 2, inplace=True),
    ],
    ids=["clamp_", "clamp_min_", "clamp_tensor_", "hardswish_", "hardsigmoid_", "relu6_"],
)
def test_in_place_clamp_family_under_dynamic_shapes(fn):
    """C++ composite kernels read sizes as ints: capture runs the Python dispatcher."""
    for shape in [(4, 3), (6, 3)]:
        verify(fn, torch.randn(shape, requires_grad=True), compile_fn=_dynamic)


# Note [Dynamo's number inputs]: a Python number that changes between calls.


def _compiled_matches_eager(fn, values, **options):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotgrad", **options)
    for value in values:
        a = torch.randn(3, requires_grad=True)
        out, ref = compiled(a, value), fn(a, value)
        torch.testing.assert_close(out, ref)
        (grad,) = torch.autograd.grad(out.sum(), a)
        (expected,) = torch.autograd.grad(ref.sum(), a)
        torch.testing.assert_close(grad, expected)


def test_dynamo_int_argument_that_changes_between_calls():
    _compiled_matches_eager(lambda a, n: a * n + n, [2, 3, 4, 3])


def test_dynamo_float_argument_that_changes_between_calls():
    _compiled_matches_eager(lambda a, x: (a * x).sin() * x, [2.0, 3.5, 0.5])


def test_dynamo_item_after_a_graph_break():
    def fn(a, scale):
        v = (a * scale).sum().item()  # graph break; the rest reads v
        return a * v

    _compiled_matches_eager(fn, [1.0, 2.0, 3.0])


def test_dynamo_numbers_with_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, n: (a * n).sum(0), backend="aotgrad", dynamic=True)
    for rows, n in [(3, 2), (5, 3), (4, 2)]:
        a = torch.randn(rows, 4)
        torch.testing.assert_close(compiled(a, n), (a * n).sum(0))


def test_a_size_stored_on_the_module_is_an_int_after_a_dynamic_capture():
    """Note [Sizes left in module attributes] (transformers' Swin stores window sizes)."""

    class Windowed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.size, self.window = 4, (1, 1)

        def forward(self, x):
            self.size, self.window = x.shape[0], (x.shape[0], 2)
            return self.lin(x) * self.size

    model = Windowed()
    compiled = aotgrad.aot_module(model, dynamic=True)
    compiled(torch.randn(3, 4))
    assert type(model.size) is int and model.size == 3
    assert model.window == (3, 2) and all(type(n) is int for n in model.window)
    x = torch.randn(5, 4)
    torch.testing.assert_close(compiled(x), model.lin(x) * 5)


def test_sizes_among_the_outputs_are_this_calls_sizes():
    """Note [Sizes among the outputs]: a SymInt output is evaluated at each call's sizes."""
    compiled = aotgrad.aot_function(
        lambda x: (x * 2, x.shape[0] * 2 + x.shape[1], x.size()), dynamic=True
    )
    for rows in (3, 5, 5, 7, 3):
        x = torch.randn(rows, 2)
        out, number, size = compiled(x)
        assert type(number) is int and number == rows * 2 + 2
        assert size == torch.Size([rows, 2]) and all(type(n) is int for n in size)
        torch.testing.assert_close(out, x * 2)
