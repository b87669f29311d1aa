"""Fuzzer finds of issue 39 (F27, F28, F32), each as its class, compared with eager.

- F28: ``resize_()`` to a tensor's own size keeps its layout (Note [resize_() to the same size]
  in ``capture/analyses/mutation.py``); functionalization read a strided tensor as contiguous.
- F27: ``set_()`` on a view of an input or buffer moves the view alone (Note [set_() on a view]
  in ``capture/analyses/set_storage.py``): outputs over the new storage were rebuilt from the old base;
  on a view that requires grad it is refused.
- F32: an output computed, in grad mode, from a ``no_grad`` view of a non-leaf input requires
  grad with no gradient reaching the input (Note [Inputs no gradient reaches] in
  ``runtime/__init__.py``); the runtime returned it not requiring grad.

``verify`` compares outputs (values, requires_grad, leafness, aliasing), every gradient and
the inputs (values, shape, requires_grad) after the call; each case runs through
``aot_function`` (``aot_module`` for modules), ``trace`` then a call on fresh inputs, and
``torch.compile(backend="aotgrad")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.errors import UnsupportedMutationError
from aotgrad.testing import _copy_call, verify

Fn = Callable[..., Any]


def _copies(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Fresh inputs made as verify makes its own (same values, strides, storage sharing,
    requires_grad and leafness), so a Traced captured at them serves verify's call."""
    return _copy_call(args, {}).args


def _traced(args: tuple[Any, ...]) -> Callable[[Fn], Fn]:
    """``trace`` at copies of ``args``; verify then calls it on its own copies."""
    copies = _copies(args)  # here, in grad mode: a non-leaf copy is made requiring grad
    return lambda fn: aotgrad.trace(fn, *copies)


def _compiled(fn: Fn) -> Fn:
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotgrad", fullgraph=True)


FRONTENDS: dict[str, Callable[[tuple[Any, ...]], Callable[[Fn], Fn]]] = {
    "aot_function": lambda args: aotgrad.aot_function,
    "trace": _traced,
    "compile": lambda args: _compiled,
}


def _check(fn: Fn, args: tuple[Any, ...], frontend: str, wrap: Callable[[Fn], Fn] = lambda f: f):
    make = FRONTENDS[frontend](args)
    # made in the mode it is called in: a Traced keeps to its capture's grad mode
    verify(wrap(fn), *args, compile_fn=lambda f: wrap(wrap(lambda: make(fn))()))


# F28 ----------------------------------------------------------------------------------------
# (no torch.compile case: Dynamo breaks the graph at resize_(), refused with fullgraph=True)


def resize_row_aliased(base, row):  # the fuzzer's case: row = base[0], both inputs
    row.resize_(4)
    return row * 1


def resize_base_then_write(base, row):
    base.resize_(base.shape)
    base.mul_(2)
    return row * 1, base + 1


def resize_row_then_write(base, row):
    row.resize_(4)
    row.add_(1)
    return base * 1


def resize_strided_intermediate(x):
    y = x.t().detach()
    y.resize_(y.shape)
    return y * 2


def _strided_pair() -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.randn(4, 3).t()  # (3, 4), strides (1, 3): b[0] has stride 3
    return b, b[0]


@pytest.mark.parametrize("frontend", ["aot_function", "trace"])
@pytest.mark.parametrize("fn", [resize_row_aliased, resize_base_then_write, resize_row_then_write])
def test_resize_to_own_size_keeps_strides_of_aliased_inputs(fn: Fn, frontend: str) -> None:
    _check(fn, _strided_pair(), frontend)


@pytest.mark.parametrize("frontend", ["aot_function", "trace"])
def test_resize_to_own_size_keeps_strides_of_an_intermediate(frontend: str) -> None:
    _check(resize_strided_intermediate, (torch.randn(3, 4),), frontend)


def test_resize_to_own_size_of_a_strided_input_leaves_its_strides() -> None:
    b, row = _strided_pair()
    b2, row2 = _copies((b, row))
    out = resize_row_aliased(b, row)
    compiled = aotgrad.aot_function(resize_row_aliased)(b2, row2)
    torch.testing.assert_close(compiled, out)
    assert (row2.shape, row2.stride(), row2.storage_offset()) == ((4,), (3,), 0)


def test_resize_to_own_size_in_a_module_buffer() -> None:
    class Strided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("buf", torch.randn(4, 3).t())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.buf.resize_(3, 4)
            return self.buf * x

    verify(Strided(), torch.randn(3, 4, requires_grad=True))


# F27 -----------------------------------------------------------------------------------------


def _set_view(view: Callable[[torch.Tensor], torch.Tensor], source: Callable[..., torch.Tensor]):
    def fn(x, y):
        v = view(x)
        with torch.no_grad():
            v.set_(source(x, y))
        return v, x * 1

    return fn


VIEWS = {"view": lambda x: x.view(-1), "row": lambda x: x[0], "t": lambda x: x.t()}
SOURCES = {"fresh": lambda x, y: y * 2, "input": lambda x, y: y, "own_base": lambda x, y: x[1]}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("view", VIEWS)
def test_set_on_a_view_of_an_input_to_a_fresh_tensor(view: str, frontend: str) -> None:
    """The view is returned over the new storage (it was rebuilt from x: x's values)."""
    fn = _set_view(VIEWS[view], SOURCES["fresh"])
    _check(fn, (torch.randn(3, 4), torch.randn(4, 3, requires_grad=True)), frontend)


def test_set_on_a_view_of_an_intermediate() -> None:
    def fn(x, y):
        h = (x * 2).detach()
        v = h.view(-1)
        v.set_(y.detach() * 3)
        return v, h

    for frontend in FRONTENDS:
        if frontend != "compile":
            _check(fn, (torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)), frontend)


class SetBufferView(nn.Module):
    """The fuzzer's module (F27), with the set_() under no_grad and the view returned."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("p0", torch.randn(2))

    def forward(self, a1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a2 = self.p0.view(-1)
        with torch.no_grad():
            a2.set_(a1 * 3)
        a2.add_(1)
        return a1 * 2, a2


@pytest.mark.parametrize("frontend", ["aot_module", "compile"])
def test_set_on_a_view_of_a_buffer(frontend: str) -> None:
    """Outputs, a1's gradient, and the buffer after the call (values, size, requires_grad)."""
    make = aotgrad.aot_module if frontend == "aot_module" else _compiled
    verify(SetBufferView(), torch.randn(4, 3, requires_grad=True), compile_fn=make)


def test_set_on_a_view_of_a_buffer_leaves_the_buffer() -> None:
    torch.manual_seed(0)
    eager = SetBufferView()
    compiled_module = SetBufferView()
    compiled_module.load_state_dict(eager.state_dict())
    compiled = aotgrad.aot_module(compiled_module)
    a1 = torch.randn(4, 3, requires_grad=True)
    for out_e, out_c in zip(eager(a1), compiled(a1), strict=True):
        torch.testing.assert_close(out_c, out_e)
        assert out_c.requires_grad == out_e.requires_grad
    for e, c in ((eager.p0, compiled_module.p0),):
        assert (c.shape, c.requires_grad) == (e.shape, e.requires_grad)
        torch.testing.assert_close(c, e)


class SetBufferViewWithGrad(nn.Module):
    """The fuzzer's module (F27) as found: set_() with grad mode on, a source requiring grad."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("p0", torch.randn(2))

    def forward(self, a1: torch.Tensor) -> torch.Tensor:
        a2 = self.p0.view(-1)
        a2.set_(a1)
        return a1 * 2


def test_set_with_grad_on_a_view_of_a_buffer_is_refused_and_leaves_the_buffer() -> None:
    """Eager makes the buffer require grad (CopySlices) and its backward fails: refused, at
    the user's line, naming the view's base; the buffer is left as it was."""
    module = SetBufferViewWithGrad()
    before = module.p0.clone()
    a1 = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(UnsupportedMutationError, match=r"history of the view's base") as info:
        aotgrad.aot_module(module)(a1)
    assert "a2.set_(a1)" in str(info.value)
    assert (module.p0.shape, module.p0.requires_grad) == ((2,), False)
    torch.testing.assert_close(module.p0, before)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("view", ["row", "t"])
def test_set_on_a_view_that_requires_grad_is_refused(view: str, source: str) -> None:
    """Eager sends the gradient of the view's new values into x through the old view's
    backward; on main x's gradient came out different, silently."""
    fn = _set_view(VIEWS[view], SOURCES[source])
    x = torch.randn(3, 4, requires_grad=True) * 1
    with pytest.raises(UnsupportedMutationError, match=r"set_\(\) on a view of a tensor"):
        aotgrad.aot_function(fn)(x, torch.randn(4, 3))


# F32 -----------------------------------------------------------------------------------------


def _under_no_grad(fn: Fn) -> Fn:
    def call(*args: Any) -> Any:
        with torch.no_grad():
            return fn(*args)

    return call


def enable_grad_over_no_grad_view(a):  # the fuzzer's case, called under no_grad
    v = a[0]
    with torch.enable_grad():
        return v.exp()


def no_grad_view_then_grad_mode(a):  # called with grad mode on
    with torch.no_grad():
        v = a[0]
    return v.exp(), v.sin()


def _view_input() -> torch.Tensor:
    return torch.randn(2, 2, requires_grad=True).unsqueeze(0)  # requires grad, has a grad_fn


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_enable_grad_over_a_no_grad_view_of_a_view_input(frontend: str) -> None:
    _check(enable_grad_over_no_grad_view, (_view_input(),), frontend, wrap=_under_no_grad)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_grad_mode_over_a_no_grad_view_of_a_non_leaf_input(frontend: str) -> None:
    x = torch.randn(3, 2, requires_grad=True) * 1
    _check(no_grad_view_then_grad_mode, (x,), frontend)


def test_no_gradient_reaches_the_input_through_a_no_grad_view() -> None:
    leaf = torch.randn(2, 2, requires_grad=True)
    out = _under_no_grad(aotgrad.aot_function(enable_grad_over_no_grad_view))(leaf.unsqueeze(0))
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert leaf.grad is None  # as eager: the edge leads nowhere


class NoGradViewModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.randn(2))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            v = a[0]
        with torch.enable_grad():
            return v.exp() * self.scale


def test_no_grad_view_in_a_module_called_under_no_grad() -> None:
    module = NoGradViewModule()
    verify(
        _under_no_grad(module),
        _view_input(),
        compile_fn=lambda f: _under_no_grad(aotgrad.aot_module(module)),
    )


def test_cut_inputs_still_serve_the_backward_of_other_outputs() -> None:
    """An input no gradient reaches next to one that is reached: gradients as eager."""

    def fn(a, w):
        with torch.no_grad():
            v = a[0]
        return v.exp() * w

    a = torch.randn(3, 2, requires_grad=True) * 1
    w = torch.randn(2, requires_grad=True)
    verify(fn, a, w)
    verify(fn, a, w, compile_fn=lambda f: aotgrad.trace(f, *_copies((a, w))))
