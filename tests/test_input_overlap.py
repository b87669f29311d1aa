"""Writes that read partially overlapping memory: refused as eager refuses them.

Note [Writes that read overlapping memory] (capture/analyses/mutation.py) and Note [Inputs
that share memory] (capture/analyses/dynamic.py).
"""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.capture.analyses.mutation import EAGER_PARTIAL_OVERLAP
from aotgrad.errors import OpRuntimeError, UnsupportedMutationError


def add_to_a(a, b):
    a.add_(b)
    return a * 2


def add_to_b(a, b):
    b.add_(a)
    return b * 2


def out_of_place(a, b):
    return a + b * 2


def _eager_and_compiled(fn, compiled, slices, n=10):
    """Run ``fn`` and ``compiled`` on views of two equal fresh bases; return both outcomes."""
    outcomes = []
    for f in (fn, compiled):
        base = torch.arange(float(n))
        args = [base[s] for s in slices]
        try:
            outcomes.append((f(*args), base))
        except RuntimeError as e:
            outcomes.append((e, base))
    return outcomes


def _assert_as_eager(fn, compiled, slices, n=10):
    (expected, eager_base), (got, base) = _eager_and_compiled(fn, compiled, slices, n)
    if isinstance(expected, Exception):
        assert isinstance(got, RuntimeError), got
        assert EAGER_PARTIAL_OVERLAP in str(expected)
        assert EAGER_PARTIAL_OVERLAP in str(got)
    else:
        assert not isinstance(got, Exception), got
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(base, eager_base)  # the base is written exactly as eager writes it


DISJOINT = (slice(0, 4), slice(4, 8))
PARTIAL = (slice(0, 4), slice(2, 6))


@pytest.mark.parametrize("fn", [add_to_a, add_to_b, out_of_place], ids=lambda f: f.__name__)
@pytest.mark.parametrize("tracer", ["auto", "full"])
def test_overlap_on_a_later_call_is_refused_like_eager(fn, tracer):
    compiled = aotgrad.aot_function(fn, tracer=tracer)
    for slices in (DISJOINT, PARTIAL, DISJOINT, PARTIAL):
        _assert_as_eager(fn, compiled, slices)


@pytest.mark.parametrize("fn", [add_to_a, add_to_b, out_of_place], ids=lambda f: f.__name__)
def test_overlap_on_the_first_call_is_refused_like_eager(fn):
    compiled = aotgrad.aot_function(fn)
    for slices in (PARTIAL, DISJOINT):
        _assert_as_eager(fn, compiled, slices)


def test_the_refusal_names_the_op_and_the_users_line():
    base = torch.arange(10.0)
    with pytest.raises(OpRuntimeError) as info:
        aotgrad.aot_function(add_to_a)(base[0:4], base[2:6])
    message = str(info.value)
    assert "aten.add_.Tensor raised RuntimeError during capture" in message
    assert "a.add_(b)" in message
    assert torch.equal(base, torch.arange(10.0))


def test_the_same_tensor_twice_is_full_overlap_which_eager_runs():
    compiled = aotgrad.aot_function(add_to_a)
    for same in (False, True, False):
        results = []
        for f in (add_to_a, compiled):
            x = torch.arange(4.0)
            results.append((f(x, x if same else x.clone()), x))
        torch.testing.assert_close(results[1], results[0])


def test_equal_views_are_full_overlap_which_eager_runs():
    compiled = aotgrad.aot_function(add_to_a)
    _assert_as_eager(add_to_a, compiled, (slice(2, 6), slice(2, 6)))


def test_a_module_refuses_like_eager():
    class AddInPlace(torch.nn.Module):
        def forward(self, a, b):
            a.add_(b)
            return a.sum()

    compiled = aotgrad.aot_module(AddInPlace())
    for slices in (DISJOINT, PARTIAL):
        _assert_as_eager(AddInPlace(), compiled, slices)


def test_dynamic_shapes_trace_inputs_that_share_memory_at_their_own_sizes():
    # Note [Inputs that share memory]: the same offsets; sizes that make them overlap, or not
    compiled = aotgrad.aot_function(add_to_a, dynamic=True)
    for n in (4, 3, 6, 5, 4):
        _assert_as_eager(add_to_a, compiled, (slice(0, n), slice(5, 5 + n)), n=12)


def test_a_shorter_storage_around_the_same_views():
    compiled = aotgrad.aot_function(add_to_a)
    for n in (10, 8, 20):
        _assert_as_eager(add_to_a, compiled, DISJOINT, n=n)


@pytest.mark.parametrize("tracer", [pytest.param("direct", marks=pytest.mark.fast_path), "full"])
def test_views_of_an_intermediate_that_overlap_are_refused(tracer):
    def f(x):
        t = x.clone()
        t[0:4].add_(t[2:6])
        return t

    with pytest.raises(RuntimeError, match="some elements of the input tensor"):
        f(torch.arange(10.0))
    with pytest.raises(OpRuntimeError, match="some elements of the input tensor"):
        aotgrad.aot_function(f, tracer=tracer)(torch.arange(10.0))


@pytest.mark.parametrize("tracer", [pytest.param("direct", marks=pytest.mark.fast_path), "full"])
def test_disjoint_columns_of_one_tensor_are_written_as_eager(tracer):
    def f(x):
        t = x.clone()
        t[:, 0].add_(t[:, 1])
        t[:, 2].copy_(t[:, 3])
        return t

    x = torch.randn(5, 4, requires_grad=True)
    expected = f(x)
    got = aotgrad.aot_function(f, tracer=tracer)(x)
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(grad, expected_grad)


def test_strided_views_that_share_elements_are_refused():
    # Not dense: eager skips its check and runs the kernel over the shared elements in its
    # own order; capture cannot promise that order, so it refuses.
    def f(x):
        t = x.clone()
        t[0:8:2].add_(t[2:10:2])
        return t

    with pytest.raises(UnsupportedMutationError, match="shares some memory locations") as caught:
        aotgrad.aot_function(f)(torch.arange(10.0))
    assert "t[0:8:2].add_(t[2:10:2])" in str(caught.value)  # the user's line


def test_strided_views_that_share_no_element_are_written_as_eager():
    def f(x):
        t = x.clone()
        t[0:8:2].add_(t[1:9:2])  # interleaved: the ranges cross, the elements do not
        return t

    x = torch.arange(10.0)
    torch.testing.assert_close(aotgrad.aot_function(f)(x), f(x))


def test_copy_between_partially_overlapping_inputs_is_refused():
    def f(a, b):
        a.copy_(b)
        return a

    compiled = aotgrad.aot_function(f)
    for slices in (DISJOINT, PARTIAL):
        _assert_as_eager(f, compiled, slices)


def test_a_traced_refuses_inputs_that_share_memory_otherwise_than_at_capture():
    base = torch.arange(10.0)
    traced = aotgrad.trace(add_to_a, base[0:4], base[4:8])
    again = torch.arange(10.0)
    torch.testing.assert_close(traced(again[0:4], again[4:8]), add_to_a(base[0:4], base[4:8]))
    for args in (
        (again[0:4], again[2:6]),  # overlapping: eager refuses
        (torch.zeros(4), torch.ones(4)),  # two storages: the graph re-derives b from a's base
    ):
        before = [a.clone() for a in args]
        with pytest.raises(
            aotgrad.errors.CallError, match=r"storage offset 4 != [02]|share memory"
        ):
            traced(*args)
        assert all(torch.equal(a, b) for a, b in zip(args, before, strict=True))


def test_a_traced_refuses_a_tensor_passed_twice_when_captured_with_two():
    def f(a, b):
        return a * 2 + b

    x, y = torch.ones(3), torch.zeros(3)
    traced = aotgrad.trace(f, x, x)  # the second placeholder is read through the first
    with pytest.raises(aotgrad.errors.CallError, match="the same tensor as a"):
        traced(x, y)
    torch.testing.assert_close(traced(y, y), f(y, y))


@pytest.mark.parametrize("share", ["detach", "data"])
def test_inputs_sharing_a_storage_without_a_view_are_told_apart_from_distinct_ones(share):
    # x and x.detach() share memory, yet neither is a view: the key (and the last entry's
    # guard) must not take them for two distinct tensors of a disjoint capture.
    def f(a, b):
        b.mul_(2)
        return a + 1

    compiled = aotgrad.aot_function(f)
    x, y = torch.ones(3), torch.ones(3)
    torch.testing.assert_close(compiled(x, y), f(torch.ones(3), torch.ones(3)))
    compiled(torch.ones(3), torch.ones(3))  # the last entry, remembered
    x, xe = torch.ones(3), torch.ones(3)
    other, other_e = (x.detach(), xe.detach()) if share == "detach" else (x.data, xe.data)
    # Supported since Note [Inputs sharing memory without a common base]: neither requires
    # grad, so the synthetic base is cut from the storage; eager's b.mul_(2) changes a too.
    torch.testing.assert_close(compiled(x, other), f(xe, other_e))
    torch.testing.assert_close(x, xe)
    assert compiled.info.misses == 2
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(UnsupportedMutationError, match="share memory without a common base"):
        compiled(x, x.detach())
    assert torch.equal(x, torch.ones(3))
