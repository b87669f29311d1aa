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
from aotgrad.errors import AotgradError, DoubleBackwardError, UnsupportedMutationError
from aotgrad.testing import verify
from fuzz_programs import MarksDirty, OnceDifferentiable, ReturnsInput, ReturnsView


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


def test_mutated_input_returned_is_that_input_when_another_is_an_equal_view():
    def fn(a0, a1):
        a1.mul_(2)
        return a1

    b = torch.randn(4)
    verify(fn, b[1:], b[1:])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_equal_views_passed_together_stay_distinct_inputs(requires_grad):
    def fn(a0, a1, a2):
        a0.add_(1)
        return a1, a0 * a1, a0.t(), a2[1]

    b = torch.randn(4, 4, requires_grad=requires_grad) * 1
    verify(fn, b[1:], b[1:], b[1:, 1:])


def test_reshape_view_of_a_strided_input_keeps_eagers_strides():
    verify(lambda a: a.reshape(1, 4, 1), torch.randn(1, 4, 2).permute(2, 1, 0)[1:])


@pytest.mark.parametrize(
    "make, size",
    [
        (lambda: torch.randn(4, 1).t(), (4, 1)),
        (lambda: torch.randn(3, 1, 4)[:, :, ::2], (1, 3, 2)),
        (lambda: torch.randn(2, 1, 3, 1).permute(3, 2, 1, 0), (3, 1, 2)),
        (lambda: torch.randn(6)[1::2].unsqueeze(1), (1, 3, 1)),
    ],
)
def test_view_with_size1_dims_keeps_eagers_strides(make, size):
    """Note [Eager strides for views]: of an input, and of an intermediate returned with it."""

    def of_an_intermediate(a):
        y = (a * 2).transpose(0, -1)
        return y, y.transpose(0, -1).view(size)

    verify(lambda a: a.view(size), make())
    verify(of_an_intermediate, make())
    verify(lambda a: a.view(size), make().requires_grad_(), compile_fn=dynamic)


def test_metadata_mutation_of_an_input_then_inplace_on_a_value_made_from_it():
    def fn(a):
        a.t_()
        v = a.sin()
        v.mul_(2)
        return v

    verify(fn, torch.randn(2, 1, requires_grad=True) * 1)


def _restride_t(a):
    a.t_()
    return a.sin()


def _restride_unsqueeze(a):
    a.unsqueeze_(0)
    return a * a.exp(), a


def _restride_as_strided(a):
    a.as_strided_((2, 2), (1, 2), 1)
    return a.sin()


def _restride_squeeze_then_data(a):
    a.squeeze_()
    a.mul_(2)
    return a.sin() * a


@pytest.mark.parametrize(
    "fn",
    [_restride_t, _restride_unsqueeze, _restride_as_strided, _restride_squeeze_then_data],
    ids=lambda f: f.__name__.removeprefix("_restride_"),
)
@pytest.mark.parametrize("compile_fn", [None, dynamic], ids=["static", "dynamic"])
def test_saved_input_restrided_in_place_keeps_the_layout_the_backward_read(fn, compile_fn):
    """Note [Replayed metadata keeps the version]: no spurious error, no transposed gradient."""
    a = torch.randn(3, 1, requires_grad=True) * 1
    if fn is _restride_as_strided:
        a = torch.randn(6, requires_grad=True) * 1
    verify(fn, a, compile_fn=compile_fn)


def test_saved_restrided_input_that_shares_memory_with_another():
    def fn(a0, a1):
        a0.t_()
        return a0.sin(), a1.cos()

    b = torch.randn(3, 3, requires_grad=True) * 1
    verify(fn, b[1:], b)


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


def test_inplace_through_an_expanded_view_of_an_input():
    def fn(a0, a1):
        v0 = a0.expand(2, *a0.shape)
        v0.masked_fill_(v0 > 0, 0.25)
        return a0 + a1.sum()

    b = torch.randn(3, 4)
    verify_or_refuse(fn, b, b.unsqueeze(0))


def _fill_expanded(a):
    a.expand(2, *a.shape).zero_()
    return a + 1


def _fill_expanded_column(a):
    a[:, :1].expand(3, 4).fill_(2.0)
    return a * 2


def _fill_expanded_intermediate(a):
    y = a * 1
    y.expand(2, *y.shape).masked_fill_(y > 0, 0.25)
    return y


def _fill_overlapping_as_strided(a):
    a.as_strided((3, 3), (1, 1)).fill_(1.0)
    return a.sin()


def _fill_unfolded(a):
    a.view(-1).unfold(0, 4, 2).fill_(0.5)
    return a.cos()


def _fill_expanded_in_a_list(a):
    torch._foreach_zero_([a.expand(2, *a.shape)])  # a list argument is written too
    return a + 1


@pytest.mark.parametrize(
    "fn",
    [
        _fill_expanded,
        _fill_expanded_column,
        _fill_expanded_intermediate,
        _fill_overlapping_as_strided,
        _fill_unfolded,
        _fill_expanded_in_a_list,
    ],
)
def test_write_through_an_overlapping_view_is_refused(fn):
    """Note [Writes through overlapping views]: eager allows fills; the functional graph differs."""
    fn(torch.randn(3, 4))  # eager runs it
    with pytest.raises(UnsupportedMutationError, match="share one memory location"):
        aotgrad.aot_function(fn)(torch.randn(3, 4))


def test_write_through_a_non_overlapping_strided_view_is_not_refused():
    def fn(a):
        a.as_strided((2, 2), (1, 4), 1).fill_(1.0)
        a.t()[::2].unsqueeze(1).expand(2, 1, 3).zero_()
        v = a[:, :1].expand(3, 4)
        v.t_()  # changes the view only
        return a.sin(), v

    verify(fn, torch.randn(3, 4))


def test_mutated_input_that_no_output_uses_gets_no_gradient():
    def fn(a, c):
        a.add_(1.5)
        return c * 2

    verify(fn, torch.randn(3, requires_grad=True) * 1, torch.randn(2, requires_grad=True))


def test_view_of_an_aliased_input_returned_twice():
    def fn(a0, a1):
        v0 = a1.t()
        return v0, v0

    b = torch.randn(3, 2, requires_grad=True)
    verify(fn, b[0], b)


@pytest.mark.parametrize("mutate", [False, True])
def test_view_of_the_larger_of_two_aliased_inputs_routes_its_gradient_through_it(mutate):
    def fn(a0, a1):
        if mutate:
            a0.mul_(2)
        return a1[1:].t(), a0 * 2, a1.diagonal()

    b = torch.randn(3, 3, requires_grad=True)
    verify(fn, b[0], b)
    verify(fn, b[1:, 1], b[1:])


def test_one_tensor_returned_twice_is_one_object():
    def fn(a0, a1):
        v = a1[1:]
        return v, a0, v, a0.t(), a0.t()

    b = torch.randn(3, 2, requires_grad=True)
    verify(fn, b[0], b)
    verify(fn, torch.randn(2, requires_grad=True), torch.randn(3, 2))


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


# A view taken after an in-place op on an input that is itself a view: its layout is where it
# sits in the caller's storage, not in functionalization's fresh buffer (F10's class, Note
# [Layouts in the caller's storage]).


def _slice_then_select(x):
    a = x[1:]
    a.add_(1)
    return a[1]


def _transpose(x):
    x.mul_(2)
    return x.t()


def _select(x):
    x.mul_(2)
    return x[:, 1]


def _diagonal(x):
    x.sub_(1)
    return x.diagonal(), x


def _as_strided(x):
    x.add_(1)
    return x.as_strided((2, 2), (1, 2), x.storage_offset() + 1)


def _unsqueeze(x):
    x.mul_(3)
    return x.unsqueeze(0)


def _unflatten(x):
    x.add_(1)
    return x.view(2, 2, 4)


def _transpose_in_place_then_select(x):
    x.mul_(2)
    x.t_()
    return x[1]


def _in_place_transpose_first(x):
    x.t_()
    x.mul_(2)
    return x.diagonal(), x[1:]


def _through_detach(x):
    x.detach().add_(1)
    return x[1:].t()


def _two_views(x):
    a = x[1:]
    a.add_(1)
    return a[1], x.t()


VIEWS_AFTER_MUTATION = [
    _slice_then_select,
    _transpose,
    _select,
    _diagonal,
    _as_strided,
    _unsqueeze,
    _unflatten,
    _transpose_in_place_then_select,
    _in_place_transpose_first,
    _through_detach,
    _two_views,
]


def _input_view(requires_grad, transposed):
    """A 4x4 view at a nonzero offset: every other column (or, transposed, row) of a 5x8."""
    base = torch.randn(5, 8, requires_grad=requires_grad) * 1
    view = base[1:, ::2]
    return view.t() if transposed else view


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("fn", VIEWS_AFTER_MUTATION, ids=lambda f: f.__name__.strip("_"))
def test_view_after_mutating_a_view_input_sits_where_eager_puts_it(fn, transposed, requires_grad):
    verify(fn, _input_view(requires_grad, transposed))


@pytest.mark.parametrize("fn", [_transpose, _diagonal, _transpose_in_place_then_select])
def test_view_after_mutating_a_view_input_under_dynamic_shapes(fn):
    verify(fn, _input_view(True, False), compile_fn=dynamic)


def test_view_after_mutating_an_aliased_view_input():
    def fn(a0, a1):
        a0.add_(1)
        return a1[1:].t(), a0.diagonal()

    b = torch.randn(6, 6, requires_grad=True) * 1
    verify(fn, b[1:, ::2], b[2:, 1:])


@unfixed(
    "NEW F16: under no_grad, a custom Function's output of an aliased input that the function"
    " then makes require grad requires grad (eager: it does not)"
)
def test_no_grad_custom_function_output_of_an_input_made_to_require_grad():
    def fn(a0, a1):
        a0 * 2
        with torch.no_grad():
            a1.view(-1)
        a0.t_()
        a0 * 2
        with torch.no_grad():
            v3 = ReturnsInput.apply(a0)
        with torch.no_grad():
            a0.requires_grad_(True)
        return (v3,)

    def under_no_grad(f):
        def call(*args):
            with torch.no_grad():
                return f(*args)

        return call

    b0 = torch.randn(1)
    verify(
        under_no_grad(fn), b0, b0[1:], compile_fn=lambda f: under_no_grad(aotgrad.aot_function(fn))
    )


@pytest.mark.parametrize("aliased", [False, True], ids=["view_input", "aliased_inputs"])
def test_view_of_an_input_restrided_in_place_regenerates_from_its_base(aliased):
    """Note [Views of a restrided input]: the gradient reaches what eager's does."""

    def fn(a0, *rest):
        v0 = a0.view(-1)
        a0.as_strided_((1, 1), (0, 0), 0)
        return v0, a0.t()

    b = torch.randn(2, requires_grad=True)
    if aliased:
        verify(fn, b, b[1:])
    else:
        verify(fn, (b * 1)[:])


@pytest.mark.parametrize("returns", [ReturnsInput, ReturnsView], ids=["input", "view"])
def test_custom_function_returning_a_mutated_input_is_refused(returns):
    """Eager's output shares the caller's memory; the graph's would be the new value's copy."""

    def fn(a):
        a.add_(1.5)
        return returns.apply(a)

    with pytest.raises(UnsupportedMutationError, match=r"custom autograd\.Function returns"):
        aotgrad.aot_function(fn)(torch.randn(3, requires_grad=True) * 1)
    verify(fn, torch.randn(3))  # nothing requires grad: an ordinary view of the input


def test_custom_function_returning_an_input_that_shares_memory_with_a_mutated_one():
    def fn(a0, a1):
        a0.add_(1.5)
        v = ReturnsInput.apply(a0)
        return v, v

    b = torch.randn(3, requires_grad=True)
    verify_or_refuse(fn, b, b.view(-1))


def test_detached_alias_of_an_input_changed_in_place_with_grad_is_refused():
    """Its gradient flows through its own history in eager, not into the input as a view's."""

    def fn(a):
        v = a.detach()
        v.copy_(v * 2 + a.sum())
        return v

    with pytest.raises(UnsupportedMutationError, match="does not see it as a view"):
        aotgrad.aot_function(fn)(torch.randn(3, requires_grad=True))
    verify(fn, torch.randn(3))  # without grad: an ordinary alias of the input


@unfixed(
    "NEW F17: an intermediate changed in place by a random op (dropout(inplace=True)) comes back"
    " with other strides on a size-1 dim than eager (the functional op's fresh result)"
)
def test_intermediate_changed_in_place_by_dropout_keeps_eagers_size1_strides():
    def fn(a):
        a.transpose_(0, 1)
        v = a * 3
        F.dropout(v, 0.3, inplace=True)
        return v, v

    torch.manual_seed(0)
    verify(fn, torch.randn(1, 3, 2))


def test_data_mutation_then_restride_onto_fewer_elements_is_refused():
    """Note [Data mutation of a restrided input]: the copy-back would miss elements."""

    def fn(a):
        a.add_(1.5)
        v = a.view(-1)
        a.as_strided_((1, 1), (0, 0), 0)
        return v

    with pytest.raises(UnsupportedMutationError, match="no longer covers"):
        aotgrad.aot_function(fn)(torch.randn(2))


@pytest.mark.parametrize("compile_fn", [None, dynamic], ids=["static", "dynamic"])
def test_data_mutation_then_restride_keeping_the_elements(compile_fn):
    def fn(a):
        a.add_(1.5)
        v = a.view(-1)
        a.t_()
        a.unsqueeze_(0)
        return v, a

    verify(fn, torch.randn(2, 3), compile_fn=compile_fn)

    def grows(a):
        a.add_(1.5)
        a.resize_(8)
        return a[:6] * 2

    verify_or_refuse(grows, torch.randn(6), compile_fn=compile_fn)


def test_marks_dirty_on_an_input_that_shares_memory_with_another():
    """Functionalization's inner tensors are not closed-over real tensors (no false refusal)."""

    def fn(a0, a1):
        v0 = MarksDirty.apply(a1)
        v1 = a1.unsqueeze(1)
        a1.index_put_((torch.tensor([0]),), torch.tensor(2.5))
        return v1, v0, a0 * 2

    b = torch.randn(4, 4, requires_grad=True)
    verify(fn, b.view(-1), b)


def test_resize_onto_other_elements_after_a_data_mutation_is_refused():
    def fn(a):
        v = MarksDirty.apply(a)
        with torch.no_grad():
            v.resize_(2)
        return v

    with pytest.raises(UnsupportedMutationError, match="no longer covers"):
        aotgrad.aot_function(fn)(torch.randn(2, 2).permute(1, 0)[1:])


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


def test_alias_output_after_an_input_drops_a_dimension_in_place_under_dynamic_shapes():
    # the output's symbolic layout was resolved from the inputs after squeeze_() had run:
    # IndexError inside torch; the sizes are now read before the replays
    def fn(a0, a1):
        a1.squeeze_()
        return a0.view(-1), a1

    base = torch.randn(2)
    verify(fn, base, base[1:], compile_fn=dynamic)
    verify(fn, torch.randn(3, 2), torch.randn(1, 4), compile_fn=dynamic)


# --- found by the fuzzer's idioms (issue 38 item 3: modules, globals, trace, create_graph) -----


@unfixed("NEW F18: requires_grad_() on a restrided input view: the output view of it is a leaf")
def test_requires_grad_on_a_restrided_input_view_then_a_view_of_it_is_not_a_leaf():
    # the input is a view of a tensor the caller keeps (verify's copy loses that: checked by hand)
    def fn(a1):
        a1.t_()
        with torch.no_grad():
            a1.requires_grad_(True)
        return a1.view(-1)

    outs = [f(torch.randn(3)[1:]) for f in (fn, aotgrad.aot_function(fn))]
    assert [(o.is_leaf, o.requires_grad) for o in outs] == [(False, True)] * 2


@unfixed("NEW F19: create_graph=True: an empty input's first-order gradient does not require grad")
def test_empty_input_viewed_keeps_second_order_gradients():
    verify(lambda a: (a.view(-1),), torch.randn(0, requires_grad=True), create_graph=True)


@unfixed("NEW F20: a Traced called under no_grad returns a view of its input with a grad_fn")
def test_traced_called_under_no_grad_returns_eagers_view():
    def fn(p):
        return p[1:]

    p = torch.randn(3, requires_grad=True)
    traced = aotgrad.trace(fn, p)
    with torch.no_grad():
        outs = [fn(p), traced(p)]
    assert [(o.is_leaf, o.grad_fn) for o in outs] == [(True, None)] * 2


@unfixed("NEW F21: create_graph=True differentiates a once_differentiable backward")
def test_once_differentiable_backward_gives_no_second_order_gradient():
    # eager's first-order gradient through it does not require grad: its second order is None
    verify(
        lambda a: OnceDifferentiable.apply(a, a),
        torch.randn(2, requires_grad=True),
        create_graph=True,
    )


@unfixed("NEW F20: a Traced called under no_grad replays an in-place op on a view of a leaf")
def test_traced_called_under_no_grad_changes_a_view_of_a_leaf_as_eager_does():
    def fn(a):
        a.mul_(2)
        return a * 3

    def inputs():
        return (torch.ones(3, requires_grad=True).view(-1),)

    traced = aotgrad.trace(fn, *inputs())
    with torch.no_grad():
        assert torch.equal(traced(*inputs()), fn(*inputs()))


def test_second_order_gradient_of_a_base_passed_twice_and_viewed():
    b = torch.randn(2, requires_grad=True)
    verify(lambda a0, a1, a2: (a2.sin(),), b[0], b, b, create_graph=True)


@unfixed("NEW F23: an intermediate of a transposed input changed by masked_fill_: contiguous")
def test_masked_fill_in_place_keeps_eagers_layout():
    def fn(a):
        v = a * 2
        v.masked_fill_(v > 0, 0.25)
        return v

    x = torch.randn(2, 3, 2).permute(2, 1, 0)
    assert aotgrad.aot_function(fn)(x).stride() == fn(x).stride()


@pytest.mark.parametrize("w_grad", [False, True])
def test_requires_grad_on_an_intermediate_is_refused(w_grad):
    # F24: eager returns a leaf (its .grad filled by backward); a compiled output never is.
    def fn(x, w):
        v = x * 2
        v.requires_grad_(True)
        return v

    args = (torch.randn(3), torch.randn(2, requires_grad=w_grad))
    assert fn(*args).is_leaf
    with pytest.raises(aotgrad.UnsupportedOutputError, match=r"made require grad itself"):
        aotgrad.aot_function(fn)(*args)


# --- issue 39: what the fuzzer's subclass, set_ and touch-outputs steps found ----------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_data_assignment_to_an_input_is_eagers(requires_grad):
    def fn(a, b):
        a.data = b
        return a * 2

    verify_or_refuse(fn, torch.randn(3, requires_grad=requires_grad), torch.randn(3))


def test_view_of_a_subclass_input_returned_is_a_view():
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(2, 3), torch.randn(2, 3)).requires_grad_()
    out = aotgrad.aot_function(lambda x: x.view(-1))(x)
    assert out._is_view() and out._base is x


def test_set_on_a_view_of_a_buffer_keeps_eagers_requires_grad():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("p0", torch.randn(2))

        def forward(self, a1):
            a2 = self.p0.view(-1)
            a2.set_(a1)
            return a1 * 2

    eager, compiled = Model(), aotgrad.aot_module(Model())
    a1 = torch.randn(4, 3, requires_grad=True)
    eager(a1)
    buffer = compiled.orig_module.p0
    before = buffer.detach().clone()
    try:
        compiled(a1)
    except AotgradError:  # refused loudly (Note [set_() on a view]): the buffer untouched
        assert torch.equal(buffer, before) and not buffer.requires_grad
        return
    assert buffer.requires_grad == eager.p0.requires_grad


def test_output_of_unbind_changed_in_place_after_the_call_raises_as_in_eager():
    x = torch.randn(3, 2, requires_grad=True) * 1
    out = aotgrad.aot_function(lambda a: a.unbind(0))(x)
    with pytest.raises(RuntimeError, match="returns multiple views"):
        out[0].mul_(2)


def test_metadata_mutation_of_a_subclass_input_reaches_the_caller():
    from torch.testing._internal.two_tensor import TwoTensor

    def fn(x):
        x.t_()
        return x * 2

    x = TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    with contextlib.suppress(AotgradError):
        aotgrad.aot_function(fn)(x)
        assert x.shape == (3, 2) and x.a.shape == (3, 2)


def test_resize_to_its_own_size_of_a_strided_aliased_input_is_a_no_op():
    def fn(base, row):
        row.resize_(4)
        return row * 1

    b = torch.randn(4, 3).t()
    verify_or_refuse(fn, b, b[0])


def test_first_order_gradient_of_a_subclass_input_requires_grad_under_create_graph():
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_()
    out = aotgrad.aot_function(lambda a: (a * a).sum())(x)
    (grad,) = torch.autograd.grad(out, [x], create_graph=True)
    assert grad.requires_grad  # eager's does: 2 * a


def test_one_subclass_value_returned_twice_is_one_object():
    from torch.testing._internal.two_tensor import TwoTensor

    def fn(a):
        v = a * 2
        return v, v

    out = aotgrad.aot_function(fn)(TwoTensor(torch.randn(3), torch.randn(3)))
    assert out[0] is out[1]


def test_enable_grad_over_a_no_grad_view_of_a_view_input_requires_grad():
    def fn(a):
        v = a[0]
        with torch.enable_grad():
            return v.exp()

    def under_no_grad(f):
        def call(*args):
            with torch.no_grad():
                return f(*args)

        return call

    x = torch.randn(2, 2, requires_grad=True).unsqueeze(0)
    verify(under_no_grad(fn), x, compile_fn=lambda f: under_no_grad(aotgrad.aot_function(fn)))


@unfixed("NEW F33: a Traced returns an empty view of an aliased input without requires_grad")
def test_traced_empty_view_of_an_aliased_input_keeps_requires_grad():
    def fn(a0, a2):
        a0.detach().mul_(2)
        return a2.view(-1)

    def make():
        b0 = torch.randn(1, 1).permute(1, 0).requires_grad_()
        return b0, b0[1:]

    traced = aotgrad.trace(fn, *make())
    assert traced(*make()).requires_grad == fn(*make()).requires_grad  # eager: True


@unfixed(
    "NEW F34: a TwoTensor output's strides of size-1 dims are not eager's (a split of a permuted input)"
)
def test_subclass_output_of_a_split_keeps_eagers_strides_of_size_one_dims():
    from torch.testing._internal.two_tensor import TwoTensor

    def fn(a0):
        return (a0 * 2).split(1, 1)[1]

    def make():
        torch.manual_seed(0)
        return TwoTensor(*(torch.randn(3, 3, 1).permute(2, 1, 0) for _ in range(2)))

    eager, compiled = fn(make()), aotgrad.aot_function(fn)(make())
    assert compiled.stride() == eager.stride() and compiled.a.stride() == eager.a.stride()


@unfixed("NEW F35: create_graph=True over a DTensor's t(): the second-order gradient's strides")
def test_dtensor_second_order_gradient_of_a_transpose_keeps_eagers_strides():
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fuzz_programs import one_rank_mesh

    def second_order(f):
        torch.manual_seed(0)
        x = distribute_tensor(torch.randn(2, 3), one_rank_mesh(), [Replicate()])
        x.requires_grad_()
        cotangent = distribute_tensor(torch.randn(3, 2), one_rank_mesh(), [Replicate()])
        cotangent.requires_grad_()
        (g,) = torch.autograd.grad(f(x), x, cotangent, create_graph=True)
        weight = distribute_tensor(torch.randn(2, 3), one_rank_mesh(), [Replicate()])
        (gg,) = torch.autograd.grad((g * weight).sum(), cotangent)
        return gg

    eager, compiled = (
        second_order(lambda a: a.t()),
        second_order(aotgrad.aot_function(lambda a: a.t())),
    )
    torch.testing.assert_close(compiled.full_tensor(), eager.full_tensor())
    assert compiled.placements == eager.placements
    assert compiled.to_local().stride() == eager.to_local().stride()  # eager: (1, 3)


@unfixed(
    "NEW F35: a DTensor input returned as a custom Function's view and as a view (t()): its"
    " gradient is wrong, silently (the same function on a plain tensor is right)"
)
def test_dtensor_input_returned_through_a_custom_functions_view_gets_eagers_gradient():
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fuzz_programs import ReturnsView, one_rank_mesh  # its backward: g * 3

    def fn(a0):
        return a0.t(), ReturnsView.apply(a0)

    def gradient(f):
        torch.manual_seed(0)
        x = distribute_tensor(torch.randn(4), one_rank_mesh(), [Replicate()])
        x.requires_grad_()
        cotangents = [
            distribute_tensor(torch.randn(4), one_rank_mesh(), [Replicate()]) for _ in "ab"
        ]
        torch.autograd.backward(f(x), cotangents)
        return x.grad

    eager, compiled = gradient(fn), gradient(aotgrad.aot_function(fn))
    assert type(compiled) is type(eager) and compiled.placements == eager.placements
    torch.testing.assert_close(compiled.full_tensor(), eager.full_tensor())


def _assign_data(a):
    a.data = torch.ones(3)


def _assign_itself(a):
    a.data = a


def _set_under_no_grad(a):
    with torch.no_grad():
        a.set_(torch.ones(3))


@pytest.mark.parametrize("change", [_assign_data, _assign_itself, _set_under_no_grad])
def test_storage_change_of_an_input_keeps_its_gradient_for_autograd_grad(change):
    # F36: the replayed set_() gave the leaf a new grad accumulator the graph did not reach
    def fn(a):
        change(a)
        return a * 2  # a gradient that does not read a's value (a * a: F39)

    def grad(f, create_graph):
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        cotangent = torch.randn(3, requires_grad=True)
        return torch.autograd.grad(f(x), x, cotangent, create_graph=create_graph)[0], x

    for create_graph in (False, True):
        (eager, x), (compiled, y) = (
            grad(fn, create_graph),
            grad(aotgrad.aot_function(fn), create_graph),
        )
        torch.testing.assert_close(compiled, eager)
        assert compiled.requires_grad == eager.requires_grad
        assert y._version == x._version
    verify(fn, torch.randn(3, requires_grad=True), create_graph=True)


def _assign_fresh(a, b):
    a.data = torch.ones(3)


def _assign_other(a, b):
    a.data = b


@pytest.mark.parametrize("change", [_assign_fresh, _assign_other])
def test_second_order_gradient_through_an_inputs_new_data_is_refused(change):
    # F39: the graph reads a's new data as the value it came from: G was differentiable in
    # that value, not in a (second-order gradient None, or b's where eager gives a's)
    def fn(a, b):
        change(a, b)
        return a * a  # eager: grad 2 * a, differentiable in a

    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = aotgrad.aot_function(fn)(x, y)
    with pytest.raises(DoubleBackwardError, match="another storage"):
        torch.autograd.grad(out, [x, y], torch.ones(3), create_graph=True, allow_unused=True)
    verify(fn, torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))


def test_second_order_gradient_of_a_base_passed_twice_and_sliced():
    # F37 (and F22 above): the duplicate's place was cut (Note [A tensor passed twice is not cut])
    torch.manual_seed(0)
    b = torch.randn(2, requires_grad=True)
    verify(lambda a0, a1, a2: a0 * a2, b, b, b[1:], create_graph=True)


def _restrided_base_made_to_require_grad(returns):
    def fn(a0, a1):
        a0.t_()
        a0.requires_grad_(True)
        return returns(a0)

    def make():
        b = torch.randn(2)
        return b, b[1:]

    eager = make()
    fn(*eager)
    for compile_fn in (aotgrad.aot_function, lambda f: aotgrad.trace(f, *make())):
        compiled = make()
        compile_fn(fn)(*compiled)
        assert [(t.is_leaf, t.requires_grad) for t in compiled] == [
            (t.is_leaf, t.requires_grad) for t in eager
        ]  # eager: [(True, True), (False, True)]


def test_view_input_of_a_restrided_base_made_to_require_grad_is_not_a_leaf():
    # F38 where the backward does not read a0: the replay keeps eager's version bump
    _restrided_base_made_to_require_grad(lambda a0: a0)


@unfixed(
    "NEW F38: a.t_(); a.requires_grad_(True) on an input another input views (b, b[1:]), a read"
    " by the backward (a.sin()): that view is a leaf after the call (eager's is not)"
)
def test_view_input_of_a_restrided_base_the_backward_reads_is_not_a_leaf():
    _restrided_base_made_to_require_grad(lambda a0: a0.sin())
