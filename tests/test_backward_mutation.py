"""A custom Function's backward that changes an input in place (Note [State updated by the
backward] in ``capture/analyses/backward_state.py``).

Eager changes the caller's tensor when that backward runs, and the gradients read the changed
value. Every test runs the same calls eagerly and through aotgrad and compares the outputs,
every gradient and the inputs after the backward; where eager raises, aotgrad raises too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import aotgrad
from aotgrad.errors import DoubleBackwardError, UnsupportedMutationError

VERSION_ERROR = "modified by an inplace operation"


class Double(torch.autograd.Function):
    """Doubles its saved input in the backward, and differentiates with the doubled value."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return g * x


class DoubleConstant(torch.autograd.Function):
    """Doubles a saved input that does not require grad; ``w``'s gradient reads it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return None, g * x


class Count(torch.autograd.Function):
    """Counts its backwards in a buffer kept on ``ctx`` (not saved: no version check)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        ctx.calls = calls
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.calls.add_(1)  # feeds no gradient
        return g * 3, None


def _make(kind: str, seed: int, leaves: list[torch.Tensor] | None = None) -> torch.Tensor:
    """A leaf requiring grad, a non-leaf requiring grad (its leaf appended to ``leaves``), or
    a constant."""
    torch.manual_seed(seed)
    t = torch.rand(3, dtype=torch.float64) + 1
    if kind == "constant":
        return t
    t.requires_grad_()
    if leaves is not None:
        leaves.append(t)
    return t if kind == "leaf" else t * 1


def _both(
    fn: Callable[..., torch.Tensor], kinds: Sequence[str], drive: Callable[..., Any]
) -> list[Any]:
    """Per runner (eager, aotgrad): the inputs after ``drive(out, args)``, their ``.grad``
    and what ``drive`` returned."""
    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        leaves: list[torch.Tensor] = []
        args = [_make(kind, k, leaves) for k, kind in enumerate(kinds)]
        extra = drive(call(*args), args)
        grads = [t.grad for t in leaves]
        results.append(([a.detach().clone() for a in args], grads, extra))
    return results


def _assert_same(eager: Any, compiled: Any) -> None:
    (e_inputs, e_grads, e_extra), (c_inputs, c_grads, c_extra) = eager, compiled
    assert len(e_inputs) == len(c_inputs)
    for k, (e, c) in enumerate(zip(e_inputs, c_inputs, strict=True)):
        torch.testing.assert_close(c, e, msg=f"input {k} after the backward")
    assert [g is None for g in c_grads] == [g is None for g in e_grads]
    assert any(g is not None for g in e_grads), "expected gradients to compare"
    for e, c in zip(e_grads, c_grads, strict=True):
        if e is not None:
            torch.testing.assert_close(c, e)
    torch.testing.assert_close(c_extra, e_extra)


def _backward(out: torch.Tensor, args: Sequence[torch.Tensor]) -> torch.Tensor:
    out.sum().backward()
    return out.detach()


@pytest.mark.parametrize("x", ["leaf", "nonleaf"])
@pytest.mark.parametrize("y", ["leaf", "constant"])
def test_a_saved_input_the_backward_doubles_is_doubled_for_the_caller(x: str, y: str) -> None:
    eager, compiled = _both(lambda x, y: Double.apply(x) * y, [x, y], _backward)
    _assert_same(eager, compiled)
    torch.testing.assert_close(compiled[0][0], _make(x, 0).detach() * 2)


def test_an_input_also_read_by_a_later_op_keeps_eagers_values() -> None:
    # mul(out, x) saves x too; its backward runs first and reads x before Double's change.
    eager, compiled = _both(lambda x, y: Double.apply(x) * x * y, ["leaf", "leaf"], _backward)
    _assert_same(eager, compiled)


def _retain_twice(out: torch.Tensor, args: Sequence[torch.Tensor]) -> None:
    loss = out.sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _change_before_backward(out: torch.Tensor, args: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        args[0].add_(1)
    out.sum().backward()


@pytest.mark.parametrize("drive", [_retain_twice, _change_before_backward])
@pytest.mark.parametrize(
    ("fn", "kinds"),
    [
        pytest.param(lambda x, y: Double.apply(x) * y, ["leaf", "leaf"], id="requires_grad"),
        pytest.param(DoubleConstant.apply, ["constant", "leaf"], id="constant"),
    ],
)
def test_a_saved_input_changed_before_its_unpack_raises_eagers_version_error(
    fn: Callable[..., torch.Tensor], kinds: list[str], drive: Callable[..., None]
) -> None:
    for call in (fn, aotgrad.aot_function(fn)):
        args = [_make(kind, k) for k, kind in enumerate(kinds)]
        with pytest.raises(RuntimeError, match=VERSION_ERROR):
            drive(call(*args), args)
        if drive is _retain_twice:  # the first backward changed x once
            torch.testing.assert_close(args[0].detach(), _make(kinds[0], 0).detach() * 2)


def _add_then_double(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x.add_(1)  # the forward's change: Double saves x after it
    return Double.apply(x) * y


def test_a_change_in_the_forward_then_in_the_backward_as_eager() -> None:
    eager, compiled = _both(_add_then_double, ["leaf", "leaf"], _backward)
    _assert_same(eager, compiled)
    for call in (_add_then_double, aotgrad.aot_function(_add_then_double)):
        x, y = _make("leaf", 0), _make("leaf", 1)
        with pytest.raises(RuntimeError, match=VERSION_ERROR):
            _retain_twice(call(x, y), [x, y])


class DoubleKept(torch.autograd.Function):
    """Doubles an input it keeps on ``ctx`` without saving it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.x = x
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        ctx.x.mul_(2)
        return g * 3


def test_an_input_another_op_saved_raises_eagers_version_error_on_a_second_backward() -> None:
    fn = lambda x: DoubleKept.apply(x) * x  # noqa: E731  (mul saves x)
    for call in (fn, aotgrad.aot_function(fn)):
        x = _make("leaf", 0)
        with pytest.raises(RuntimeError, match=VERSION_ERROR):
            _retain_twice(call(x), [x])


def test_an_input_nothing_saved_changes_at_every_backward() -> None:
    eager, compiled = _both(lambda x: DoubleKept.apply(x) * 2, ["leaf"], _retain_twice)
    _assert_same(eager, compiled)
    torch.testing.assert_close(compiled[0][0], _make("leaf", 0).detach() * 4)


@pytest.mark.parametrize("retain", [False, True])
def test_a_function_in_a_checkpointed_region_as_eager(retain: bool) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(lambda a: Double.apply(a) * y, x, use_reentrant=False)

    if not retain:
        eager, compiled = _both(fn, ["leaf", "leaf"], _backward)
        _assert_same(eager, compiled)
        return
    for call in (fn, aotgrad.aot_function(fn)):  # the checkpoint saved x: eager's check
        x, y = _make("leaf", 0), _make("leaf", 1)
        with pytest.raises(RuntimeError, match=VERSION_ERROR):
            _retain_twice(call(x, y), [x, y])


@pytest.mark.parametrize("x", ["leaf", "constant"])
def test_a_buffer_kept_on_ctx_counts_every_backward(x: str) -> None:
    fn = lambda x, calls: Count.apply(x * 1 if x.requires_grad else x, calls)  # noqa: E731
    for call in (fn, aotgrad.aot_function(fn)):
        calls = torch.zeros((), dtype=torch.float64)
        w = _make("leaf", 0)
        loss = call(w, calls).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        assert float(calls) == 2.0  # once per backward, as eager
        torch.testing.assert_close(w.grad, torch.full((3,), 6.0, dtype=torch.float64))


def test_a_backward_the_engine_skips_changes_nothing() -> None:
    def drive(out: torch.Tensor, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out.sum(), args[1])  # Double's node never runs

    eager, compiled = _both(lambda x, y: Double.apply(x) * y, ["leaf", "leaf"], drive)
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[0][0], _make("leaf", 0).detach())  # unchanged
    torch.testing.assert_close(compiled[2], eager[2])


def test_matches_pytorchs_aot_function() -> None:
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function as reference

    fn = lambda x, y: (Double.apply(x) * y).sin()  # noqa: E731
    results = []
    for call in (reference(fn, nop), aotgrad.aot_function(fn)):
        x, y = _make("leaf", 0), _make("leaf", 1)
        out = call(x, y)
        out.sum().backward()
        results.append((out.detach(), x.detach().clone(), x.grad, y.grad))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


# Parameters of a module, through every frontend.


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        w.mul_(0.5)  # a decay the backward applies to the weight
        return g * w, g * x


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(1, 2, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(x, self.w).sin()


def _steps(model: Scaled, call: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Two calls, each with its backward; everything eager would let a caller see."""
    seen = []
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        out = call(x)
        out.sum().backward()
        seen += [out.detach(), x.grad, model.w.detach().clone(), model.w.grad.clone()]
    return seen


def _recording() -> tuple[list[torch.fx.GraphModule], Any]:
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    return graphs, compiler


@pytest.mark.parametrize("frontend", ["aot_module", "trace", "dynamo"])
def test_a_parameter_the_backward_scales_as_eager(frontend: str) -> None:
    eager = Scaled()
    compiled = copy.deepcopy(eager)
    graphs, compiler = _recording()
    if frontend == "aot_module":
        call: Any = aotgrad.aot_module(compiled)
    elif frontend == "trace":  # trace, then call again on new inputs
        call = aotgrad.trace(compiled, torch.randn(2, 3, dtype=torch.float64, requires_grad=True))
    else:
        torch._dynamo.reset()
        call = torch.compile(compiled, backend=aotgrad.backend(compiler, compiler))
    want, got = _steps(eager, eager), _steps(compiled, call)
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, msg=f"value {k}")
    if frontend == "dynamo":  # aotgrad compiled it: the backward writes the weight
        assert len(graphs) == 2 and "new value of self.w" in graphs[1].code


# Refusals that name what is really there.


class Restride(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x.t_()  # RESTRIDE_LINE
        return g * 3


def test_a_change_of_strides_is_refused_naming_the_function_and_line() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    Restride.apply(x).sum().backward()
    assert x.stride() == (1, 3)  # eager: x transposed in place
    with pytest.raises(UnsupportedMutationError) as caught:
        aotgrad.aot_function(lambda x: Restride.apply(x))(torch.randn(3, 3, requires_grad=True))
    message = str(caught.value)
    assert "the backward of custom autograd.Function Restride changes x in place" in message
    assert "size or strides" in message and "checkpoint" not in message
    assert "x.t_()  # RESTRIDE_LINE" in message


def test_a_hook_changing_an_input_is_refused_naming_the_hook() -> None:
    def fn(x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        h = x * 2

        def count(g: torch.Tensor) -> None:
            calls.add_(1)  # HOOK_LINE

        h.register_hook(count)
        return h * h

    with pytest.raises(UnsupportedMutationError) as caught:
        aotgrad.aot_function(fn)(_make("leaf", 0), torch.zeros(()))
    message = str(caught.value)
    assert message.startswith("a hook running in the backward changes calls in place")
    assert "calls.add_(1)  # HOOK_LINE" in message


CALLS = torch.zeros(())


class CountGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        CALLS.add_(1)
        return g * 3


def test_a_backward_changing_a_tensor_no_input_stands_for_is_refused_untouched() -> None:
    CALLS.zero_()
    with pytest.raises(UnsupportedMutationError, match=r"add_ in the backward .* not an argument"):
        aotgrad.aot_function(lambda x: CountGlobal.apply(x))(_make("leaf", 0))
    assert float(CALLS) == 0.0  # the capture never wrote the real tensor


def test_create_graph_through_a_leaf_the_backward_changes_raises_as_eager() -> None:
    fn = lambda x, y: Double.apply(x) * y  # noqa: E731
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x, y = _make("leaf", 0), _make("leaf", 1)
        torch.autograd.grad(fn(x, y).sum(), (x, y), create_graph=True)
    x, y = _make("leaf", 0), _make("leaf", 1)
    loss = aotgrad.aot_function(fn)(x, y).sum()
    with pytest.raises(DoubleBackwardError, match="leaf Variable that requires grad") as caught:
        torch.autograd.grad(loss, (x, y), create_graph=True)
    assert "custom autograd.Function Double" in str(caught.value)
    assert "BatchNorm" not in str(caught.value)


@pytest.mark.parametrize(
    ("fn", "kinds"),
    [
        pytest.param(lambda x, w: DoubleConstant.apply(x, w * w), ["constant", "leaf"], id="saved"),
        pytest.param(lambda x, b: Count.apply(x * x, b), ["leaf", "constant"], id="ctx_buffer"),
    ],
)
def test_create_graph_through_a_backward_changing_a_constant_as_eager(
    fn: Callable[..., torch.Tensor], kinds: list[str]
) -> None:
    def drive(out: torch.Tensor, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        wrt = [a for a in args if a.requires_grad]
        grads = torch.autograd.grad(out.sum(), wrt, create_graph=True)
        sum((g * g).sum() for g in grads).backward()  # second order, into .grad
        return [g.detach() for g in grads]

    eager, compiled = _both(fn, kinds, drive)
    _assert_same(eager, compiled)


def test_export_refuses_naming_the_function() -> None:
    traced = aotgrad.trace(lambda x, y: Double.apply(x) * y, _make("leaf", 0), _make("leaf", 1))
    with pytest.raises(aotgrad.errors.CallError) as caught:
        traced.export()
    message = str(caught.value)
    assert "the backward of custom autograd.Function Double" in message
    assert "BatchNorm" not in message
