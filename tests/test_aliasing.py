"""Aliased outputs: every output comes back, with eager's identity, views and gradients."""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.errors import UnsupportedMutationError
from aotgrad.signature import OutputBase
from aotgrad.testing import verify
from conftest import clone_inputs
from subclasses import TwoTensor


def inputs():
    torch.manual_seed(0)
    return torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)


CASES = {
    "same tensor twice": lambda x, w: _twice(x @ w),
    "view of intermediate and the intermediate": lambda x, w: _with_view(x @ w),
    "two views of an unreturned intermediate": lambda x, w: _views(x @ w),
    "view of an input": lambda x, w: (x.view(-1), (x @ w).sum()),
    "the input itself": lambda x, w: (x, w.sin()),
    "None and ints": lambda x, w: (None, 3, (x * w).sum(), 2.5, "tag"),
    "detached alias": lambda x, w: _detached(x * w),
    "slice chain": lambda x, w: _slices(x @ w),
    "integer and float outputs": lambda x, w: ((x @ w).argmax(dim=0), (x @ w).amax(dim=0)),
}


def _twice(a):
    return a, a


def _with_view(a):
    return a, a.t(), a[1:, :2]


def _views(a):
    return a.t(), a.view(-1), a[0]


def _detached(a):
    return a, a.detach()


def _slices(a):
    return a.view(-1)[2:10], a[1:3]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager(name):
    verify(CASES[name], *inputs())


def test_same_tensor_twice_is_the_same_object():
    out = aotgrad.aot_function(_twice)(torch.randn(3, requires_grad=True).sin())
    assert out[0] is out[1]


def test_output_that_is_the_input_is_the_input():
    x, w = inputs()
    out = aotgrad.aot_function(CASES["the input itself"])(x, w)
    assert out[0] is x


def test_view_of_an_input_is_a_real_view_of_it():
    x, w = clone_inputs(inputs())
    x.requires_grad_(False)
    out = aotgrad.aot_function(lambda x, w: (x.view(-1), (x @ w).sum()))(x, w)
    assert out[0]._base is x
    out[0].mul_(0)
    assert torch.count_nonzero(x) == 0, "writing through the output view must change the input"


def test_views_of_an_intermediate_share_memory_and_base():
    x, w = inputs()
    compiled = aotgrad.aot_function(CASES["two views of an unreturned intermediate"])
    out = compiled(x, w)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert out[0]._base is out[1]._base is not None
    traced = aotgrad.trace(CASES["two views of an unreturned intermediate"], x, w)
    assert any(isinstance(d, OutputBase) for d in traced.signature.forward_outputs)


def test_user_mutation_of_an_aliased_output_is_seen_by_its_alias():
    x, w = inputs()
    with torch.no_grad():
        out = aotgrad.aot_function(CASES["view of intermediate and the intermediate"])(x, w)
        out[0].zero_()
    assert torch.count_nonzero(out[1]) == 0


def test_gradients_flow_through_every_alias():
    x, w = inputs()
    ex, ew = clone_inputs((x, w))
    cx, cw = clone_inputs((x, w))
    eager = _views(ex @ ew)
    compiled = aotgrad.aot_function(lambda x, w: _views(x @ w))(cx, cw)
    weights = [torch.randn_like(t) for t in eager]
    torch.autograd.backward(eager, weights)
    torch.autograd.backward(compiled, weights)
    torch.testing.assert_close(cx.grad, ex.grad)
    torch.testing.assert_close(cw.grad, ew.grad)


def test_requires_grad_and_leafness_match_eager():
    x, w = inputs()
    eager = _detached(x * w)
    compiled = aotgrad.aot_function(_detached)(x * w)
    assert [t.requires_grad for t in compiled] == [t.requires_grad for t in eager]
    assert [t.grad_fn is None for t in compiled] == [t.grad_fn is None for t in eager]


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.fft.ihfft(x.sin()),  # a conj view of an intermediate
        lambda x: (lambda a: (a, a.conj()))(torch.fft.fft(x)),
        lambda x: x.to(torch.complex64).conj(),
        lambda x: (lambda a: (a, a.view(torch.int32)))(x.sin()),
    ],
    ids=["ihfft", "conj of an output", "conj of a cast", "dtype view"],
)
def test_views_that_as_strided_cannot_rebuild_keep_their_values(fn):
    verify(fn, torch.randn(5, 6, requires_grad=True))


class _Same(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_a_custom_view_of_a_mutated_input_is_refused_naming_the_function():
    def f(x):
        x.mul_(2)
        return _Same.apply(x)

    with pytest.raises(
        UnsupportedMutationError, match=r"custom autograd.Function returns .*\(_Same.apply\)"
    ):
        aotgrad.aot_function(f)(torch.ones(3, requires_grad=True) * 1)


@pytest.mark.parametrize("result", ["view", "unbind"])
def test_a_view_of_a_mutated_subclass_input_is_a_view_of_the_callers_tensor(result):
    # Refused before (as "a view of a tensor-subclass input"); now rebuilt from the caller's
    # tensor after the mutation's replay, as eager (Note [Aliased subclass outputs]).
    def f(x):
        x.mul_(2)
        return x.view(-1) if result == "view" else x.unbind(0)

    results = []
    for call in (f, aotgrad.aot_function(f)):
        root = TwoTensor(torch.ones(2, 3), torch.ones(2, 3) * 3).requires_grad_()
        x = root * 1
        out = call(x)
        first = out if result == "view" else out[0]
        assert first._base is x
        (first * torch.arange(first.numel()).view(first.shape)).sum().backward()
        results.append((x.a, x.b, root.grad.a, root.grad.b))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)
