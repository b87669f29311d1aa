"""One test per distinct bug the differential fuzzer found (tests/fuzz_programs.py).

Each is the fuzzer's failure, shrunk to a minimal program, checked with ``verify`` against
eager. A test of an unfixed bug is ``xfail(strict=True)`` naming the issue item (or ``NEW``):
when its fix merges the test passes, the strict xfail fails, and the marker is removed (with the
matching entry of ``fuzz_programs.KNOWN_BAD``). Where a loud, documented refusal would also be a
correct outcome, ``verify_or_refuse`` accepts an ``AotgradError``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import AotgradError
from aotgrad.testing import verify
from fuzz_programs import ReturnsInput, ReturnsView


def unfixed(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


def dynamic(f):
    return aotgrad.aot_function(f, dynamic=True)


def compiled(f):
    torch._dynamo.reset()
    return torch.compile(f, backend="aotgrad")


def verify_or_refuse(fn, *args, **kwargs):
    """Eager's behaviour, or a documented aotgrad refusal: never a raw error or a difference."""
    with contextlib.suppress(AotgradError):
        verify(fn, *args, **kwargs)


# --- bugs the issue lists --------------------------------------------------------------------


def test_inplace_clamp_under_dynamic_shapes():
    def fn(a):
        a.clamp_(-0.5, 0.5)
        return a * 2

    verify(fn, torch.randn(4), compile_fn=dynamic)


def test_dropout_on_a_transposed_tensor_draws_eagers_mask():
    verify(lambda a: F.dropout(a, 0.5), torch.randn(4, 2).t())


def test_custom_function_returning_its_input_uses_its_backward():
    verify(lambda a: ReturnsInput.apply(a), torch.randn(3, requires_grad=True))


def test_custom_function_returning_a_view_of_its_input_uses_its_backward():
    verify(lambda a: ReturnsView.apply(a), torch.randn(3, requires_grad=True))


def test_metadata_mutation_of_one_of_two_aliased_inputs():
    def fn(a0, a1):
        a0.t_()
        return a0 + 1

    b = torch.randn(2, 2)
    verify(fn, b, b[0:2])


def test_requires_grad_on_a_view_of_an_input():
    def fn(a):
        v = a.view(-1)
        v.requires_grad_(True)
        return v

    verify(fn, torch.randn(2, 2))


def test_requires_grad_on_an_input():
    def fn(a):
        a.requires_grad_(True)
        return a * 2

    verify(fn, torch.randn(2))


def test_requires_grad_on_an_input_after_using_it_and_under_dynamic_shapes():
    def fn(a, w):
        b = a * 3
        a.requires_grad_()
        with torch.no_grad():
            a.add_(1)
        return b, a * w, a.t()

    for compile_fn in (None, dynamic, compiled):
        verify(fn, torch.randn(2, 2), torch.randn(2, 2, requires_grad=True), compile_fn=compile_fn)


def test_requires_grad_on_an_input_reaches_the_callers_tensor_on_every_call():
    def fn(a):
        a.requires_grad_(True)
        return a * 2

    compiled_fn = aotgrad.aot_function(fn)
    for _ in range(3):  # a cache hit replays it too
        a = torch.randn(2)
        compiled_fn(a).sum().backward()
        assert a.requires_grad and a.is_leaf
        torch.testing.assert_close(a.grad, torch.full((2,), 2.0))


def test_view_of_an_input_taken_before_its_requires_grad_is_refused():
    def fn(a):
        v = a.view(-1)
        a.requires_grad_(True)
        return (v,)

    with pytest.raises(AotgradError, match="before the function called requires_grad_"):
        verify(fn, torch.randn(2, 1))


def test_detach_in_place_of_an_input_is_replayed_on_the_callers_tensor():
    def fn(a, w):
        a.mul_(w)
        a.detach_()
        return a.view(-1) * 2, a

    for compile_fn in (None, dynamic, compiled):
        a, w = torch.randn(3, requires_grad=True) * 1, torch.randn(3, requires_grad=True)
        verify(fn, a, w, compile_fn=compile_fn)


def test_enable_grad_inside_a_function_called_under_no_grad():
    def fn(a):
        with torch.enable_grad():
            return a * 2

    compiled_fn = aotgrad.aot_function(fn)

    def eager(a):
        with torch.no_grad():
            return fn(a)

    def under_no_grad(a):
        with torch.no_grad():
            return compiled_fn(a)

    verify(eager, torch.randn(3, requires_grad=True), compile_fn=lambda f: under_no_grad)


def test_compile_graph_break_at_enable_grad_after_metadata_mutation():
    def fn(a0):
        v0 = a0 * 2
        a0.squeeze_()
        with torch.enable_grad():
            a0.reshape(2)
        return (v0,)

    verify(fn, torch.randn(3, requires_grad=True)[1:], compile_fn=compiled)


# --- new bugs ----------------------------------------------------------------------------------


def test_resize_under_dynamic_shapes():
    def fn(a):
        a.resize_(2)
        return a * 2

    verify_or_refuse(fn, torch.randn(4), compile_fn=dynamic)


def test_output_returned_after_its_detached_alias_keeps_requires_grad():
    def fn(a):
        v = a + 1
        return v.detach(), v

    verify(fn, torch.randn(3, requires_grad=True))


def test_view_returned_with_a_detach_of_its_base_keeps_requires_grad():
    def fn(a):
        v = a + 1
        return v.detach(), v.view(-1)

    verify(fn, torch.randn(3, requires_grad=True))
    verify(fn, torch.randn(3, requires_grad=True), compile_fn=dynamic)


@unfixed("NEW F3: two inputs that are equal views of one base: the wrong one is returned")
def test_mutated_input_returned_is_that_input_when_another_is_an_equal_view():
    def fn(a0, a1):
        a1.mul_(2)
        return a1

    b = torch.randn(4)
    verify(fn, b[1:], b[1:])


@unfixed("NEW F4: a reshape view of a strided input gets other strides on size-1 dims")
def test_reshape_view_of_a_strided_input_keeps_eagers_strides():
    verify(lambda a: a.reshape(1, 4, 1), torch.randn(1, 4, 2).permute(2, 1, 0)[1:])


@unfixed("NEW F5: t_() of an input then an in-place op: spurious 'modified by an inplace op'")
def test_metadata_mutation_of_an_input_then_inplace_on_a_value_made_from_it():
    def fn(a):
        a.t_()
        v = a.sin()
        v.mul_(2)
        return v

    verify(fn, torch.randn(2, 1, requires_grad=True) * 1)


def test_no_grad_view_of_an_input_gets_no_gradient():
    def fn(a):
        with torch.no_grad():
            v = a.view(-1)
        return v.expand(2, 4)

    verify(fn, torch.randn(4, requires_grad=True))


def test_no_grad_view_of_an_intermediate_viewed_again_gets_no_gradient():
    def fn(a):
        v = a * 2
        with torch.no_grad():
            w = v.view(-1)
        return w.t(), v, w.expand(2, 4) * 3

    verify(fn, torch.randn(4, requires_grad=True))
    verify(fn, torch.randn(4, requires_grad=True), compile_fn=compiled)


@unfixed("NEW F7: an in-place op through an expanded view of an input differs from eager")
def test_inplace_through_an_expanded_view_of_an_input():
    def fn(a0, a1):
        v0 = a0.expand(2, *a0.shape)
        v0.masked_fill_(v0 > 0, 0.25)
        return a0 + a1.sum()

    b = torch.randn(3, 4)
    verify(fn, b, b.unsqueeze(0))


def test_mutated_input_that_no_output_uses_gets_no_gradient():
    def fn(a, c):
        a.add_(1.5)
        return c * 2

    verify(fn, torch.randn(3, requires_grad=True) * 1, torch.randn(2, requires_grad=True))


@unfixed("NEW F9: one view of an aliased input returned twice gets a wrong gradient")
def test_view_of_an_aliased_input_returned_twice():
    def fn(a0, a1):
        v0 = a1.t()
        return v0, v0

    b = torch.randn(3, 2, requires_grad=True)
    verify(fn, b[0], b)


@unfixed("NEW F10: in-place ops through a detach() of a mutated view input differ from eager")
def test_inplace_through_a_detached_alias_of_a_mutated_input():
    def fn(a0):
        a0.zero_()
        v0 = a0.detach()
        a0.zero_()
        v0.index_put_((torch.tensor([0]),), torch.tensor(2.5))
        return v0, v0, v0

    verify(fn, torch.randn(4, 2, 4)[1:])


@unfixed("NEW F11: a custom Function returning a mutated input that aliases another: not an alias")
def test_custom_function_returning_a_mutated_aliased_input_aliases_it():
    def fn(a0, a1):
        a1.add_(1.5)
        return ReturnsInput.apply(a1)

    b = torch.randn(3, requires_grad=True)
    verify(fn, b, b[1:])


@unfixed("NEW F12: a custom Function returning a size-1-strided input: other strides than eager")
def test_custom_function_returning_its_input_keeps_eagers_strides():
    verify(lambda a: ReturnsInput.apply(a), torch.randn(2, 1).permute(1, 0))


@unfixed(
    "NEW F13: torch.compile: requires_grad_() on an input mutated after a view of it was taken"
)
def test_compile_requires_grad_on_an_input_mutated_after_a_view():
    def fn(a0):
        v0 = a0.expand(2, *a0.shape)
        a0.add_(1.5)
        a0.requires_grad_(True)
        return v0, v0

    verify(fn, torch.randn(3, 2, 1).permute(2, 1, 0), compile_fn=compiled)


@unfixed("NEW F14: a view of a mutated size-1-strided input gets other strides than eager")
def test_view_of_a_mutated_size1_strided_input_keeps_eagers_strides():
    def fn(a0):
        a0.add_(1.5)
        return (a0.transpose(0, 0),)

    verify(fn, torch.randn(2, 1, 1).permute(2, 1, 0))


@unfixed("NEW F15: requires_grad_() on a no_grad view of an input: backward refuses the output")
def test_requires_grad_on_a_no_grad_view_of_an_input():
    def fn(a0):
        with torch.no_grad():
            v0 = a0.view(-1)
            v0.requires_grad_(True)
        return (v0,)

    verify(fn, torch.randn(1, requires_grad=True))
