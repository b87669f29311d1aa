"""Traceable wrapper tensor subclasses as inputs, parameters, outputs and gradients, on one
process with ``TwoTensor`` (Note [Tensor subclasses]); DTensor is in test_distributed_tp.py."""

from __future__ import annotations

import copy

import pytest
import torch

import aotgrad
from aotgrad.errors import DirectTraceError, UnsupportedSubclassError
from subclasses import Tagged, TwoTensor, two


def _fn(x, w):
    return (x * w).sin() + x, (w * 2).b


def _pair(seed: int, requires_grad: bool = True) -> tuple[TwoTensor, TwoTensor]:
    g = torch.Generator().manual_seed(seed)
    x = two(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), requires_grad)
    w = two(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), requires_grad)
    return x, w


def _assert_two_equal(actual, expected):
    assert type(actual) is type(expected) is TwoTensor
    torch.testing.assert_close(actual.a, expected.a)
    torch.testing.assert_close(actual.b, expected.b)


def _losses_and_grads_match(run, model, eager, x):
    """``run(x)`` and ``eager(x)``: equal squared-sum losses, equal weight gradients."""
    loss = run(x).pow(2).sum()
    loss_e = eager(copy.deepcopy(x)).pow(2).sum()
    _assert_two_equal(loss, loss_e)
    loss.backward(torch.ones_like(loss))
    loss_e.backward(torch.ones_like(loss_e))
    _assert_two_equal(model.weight.grad, eager.weight.grad)


def test_graphs_take_each_subclass_input_apart_and_name_its_inner_tensors():
    t = aotgrad.trace(_fn, *_pair(0))
    sig = t.signature
    assert [str(d) for d in sig.forward_inputs] == ["x.a", "x.b", "w.a", "w.b"]
    assert [str(d) for d in sig.outputs] == ["output[0].a", "output[0].b", "output[1]"]
    assert [str(g) for g in sig.backward_outputs] == [
        "grad of x.a",
        "grad of x.b",
        "grad of w.a",
        "grad of w.b",
    ]
    assert t.tracer == "full"
    assert t.fallback_reason == (
        "the direct trace was not tried: tensor subclass inputs (Note [Tensor subclasses])"
    )
    for gm in (t.joint, t.forward, t.backward):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            assert not isinstance(val, TwoTensor), (gm, node)
    # TwoTensor's __torch_dispatch__ ran during the trace: one mul per inner tensor.
    muls = [n for n in t.forward.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) == 3  # x * w on a and b; (w * 2).b on b (the a half is dead code)
    assert "x_a" in t.forward.code and "# x.a" in t.forward.code


def test_values_and_gradients_equal_eager_and_come_back_as_the_subclass():
    x, w = _pair(1)
    xe, we = copy.deepcopy((x, w))
    out, plain = aotgrad.aot_function(_fn)(x, w)
    out_e, plain_e = _fn(xe, we)
    _assert_two_equal(out, out_e)
    torch.testing.assert_close(plain, plain_e)
    assert plain.requires_grad is plain_e.requires_grad is False  # .b leaves autograd
    (out * out).sum().backward()
    (out_e * out_e).sum().backward()
    _assert_two_equal(x.grad, xe.grad)
    _assert_two_equal(w.grad, we.grad)


def test_traced_callable_runs_new_inputs_of_the_same_kind():
    traced = aotgrad.trace(_fn, *_pair(2))
    x, w = _pair(3)
    out, _ = traced(x, w)
    expected, _ = _fn(*_pair(3))
    _assert_two_equal(out, expected)


def test_an_input_no_output_reaches_gets_no_gradient_as_in_eager():
    def fn(x, w):
        return x * w.a  # reading .a leaves autograd: w gets no gradient

    x, w = _pair(4)
    xe, we = copy.deepcopy((x, w))
    aotgrad.aot_function(fn)(x, w).sum().backward()
    fn(xe, we).sum().backward()
    _assert_two_equal(x.grad, xe.grad)
    assert w.grad is None and we.grad is None


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        weight = TwoTensor(torch.randn(4, generator=g), torch.randn(4, generator=g))
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).tanh()


def test_subclass_parameters_train_like_eager():
    model = _Scaled()
    eager = copy.deepcopy(model)
    compiled = aotgrad.aot_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        x = two(torch.full((2, 4), step + 1.0), torch.full((2, 4), -1.0 - step))
        _losses_and_grads_match(compiled, model, eager, x)
        opt.step(), opt_e.step(), opt.zero_grad(), opt_e.zero_grad()
        _assert_two_equal(model.weight, eager.weight)
    names = [str(d) for d in compiled.compiled.partitioned.signature.forward_inputs]
    assert names == ["param weight.a", "param weight.b", "x.a", "x.b"]
    assert compiled.compiled.info.misses == 1


def test_nested_subclasses_are_taken_apart_recursively():
    def fn(x):
        return x * 3

    inner = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    x = TwoTensor(inner, TwoTensor(torch.zeros(2), torch.full((2,), 4.0)))
    traced = aotgrad.trace(fn, x)
    assert [str(d) for d in traced.signature.forward_inputs] == ["x.a.a", "x.a.b", "x.b.a", "x.b.b"]
    out = traced(x)
    assert type(out) is TwoTensor and type(out.a) is TwoTensor
    torch.testing.assert_close(out.b.b, torch.full((2,), 12.0))


def test_a_subclass_made_inside_is_returned_as_the_subclass():
    def fn(x):
        return TwoTensor(x.sin(), x.cos())

    x = torch.randn(3)
    out = aotgrad.aot_function(fn)(x)
    _assert_two_equal(out, fn(x))


def test_plain_and_subclass_inputs_are_different_specializations():
    f = aotgrad.aot_function(lambda x: x * 2)
    x, _ = _pair(6, requires_grad=False)
    f(x), f(x), f(x.a)
    assert f.info.misses == 2 and f.info.hits == 1


def test_a_subclass_without_tensor_flatten_is_refused_naming_it():
    with pytest.raises(UnsupportedSubclassError) as info:
        aotgrad.aot_function(lambda x, y: x + y)(torch.ones(2), Tagged(torch.ones(2)))
    message = str(info.value)
    assert "input y is a subclasses.Tagged" in message
    assert "__tensor_flatten__" in message and "DTensor" in message


def test_a_subclass_gradient_of_a_plain_input_comes_back_as_the_subclass():
    """Refused before (Note [Subclass gradients of plain inputs]); more in
    test_subclass_inputs.py."""
    x, _ = _pair(7)
    w, we = (torch.linspace(-1, 1, 12).view(3, 4).requires_grad_() for _ in "ab")
    (aotgrad.aot_function(lambda x, w: x * w)(x, w) ** 2).sum().backward()
    (x * we).pow(2).sum().backward()
    _assert_two_equal(w.grad, we.grad)


@pytest.mark.fast_path
def test_the_direct_tracer_refuses_subclass_inputs():
    with pytest.raises(DirectTraceError, match="tensor subclass inputs"):
        aotgrad.trace(lambda x: x * 2, _pair(8)[0], tracer="direct")


def test_dynamic_shapes_refuse_subclass_inputs():
    with pytest.raises(UnsupportedSubclassError, match="dynamic dimensions"):
        aotgrad.trace(lambda x: x * 2, _pair(9)[0], dynamic=True)


def test_an_in_place_change_of_a_subclass_input_reaches_the_caller_and_gradients_flow():
    def fn(x, y):
        x.mul_(2)
        return x * y

    x0, y = _pair(10)
    x0e, ye = copy.deepcopy((x0, y))
    x, xe = x0 * 1, x0e * 1  # non-leaf: eager refuses in-place ops on leaves requiring grad
    out, out_e = aotgrad.aot_function(fn)(x, y), fn(xe, ye)
    _assert_two_equal(out, out_e)
    _assert_two_equal(x, xe)
    (out * out).sum().backward(torch.ones(()))
    (out_e * out_e).sum().backward(torch.ones(()))
    _assert_two_equal(y.grad, ye.grad)
    _assert_two_equal(x0.grad, x0e.grad)


def test_a_parameter_without_tensor_flatten_is_refused_naming_it():
    model = torch.nn.Linear(2, 2)
    model.weight = torch.nn.Parameter(Tagged(torch.ones(2, 2)))
    with pytest.raises(
        UnsupportedSubclassError, match=r"input param weight is a subclasses\.Tagged"
    ):
        aotgrad.aot_module(model)(torch.ones(1, 2))


def test_torch_compile_with_the_aotgrad_backend_takes_subclass_inputs():
    torch._dynamo.reset()
    x, w = _pair(11)
    xe, we = copy.deepcopy((x, w))
    out = torch.compile(_fn, backend="aotgrad")(x, w)[0]
    out_e = _fn(xe, we)[0]
    _assert_two_equal(out, out_e)
    out.sum().backward()  # a TwoTensor cotangent: ones_like(the TwoTensor loss)
    out_e.sum().backward()
    _assert_two_equal(x.grad, xe.grad)
    _assert_two_equal(w.grad, we.grad)


def test_a_plain_cotangent_for_a_subclass_output_is_refused():
    out, _ = aotgrad.aot_function(_fn)(*_pair(12))
    with pytest.raises(UnsupportedSubclassError, match=r"cotangent of a subclasses\.TwoTensor"):
        out.backward(torch.ones(3, 4))


@pytest.mark.parametrize("frontend", ["closure", "module argument"])
def test_a_subclass_parameter_reached_through_a_closure_or_argument_gets_its_gradient(frontend):
    """Note [Real subclass tensors in a trace]: the real parameter was a constant of the
    graph, and its gradient was lost (silently)."""
    model = _Scaled()
    eager = copy.deepcopy(model)
    if frontend == "closure":
        compiled = aotgrad.aot_function(lambda x: model(x))
        run = compiled
    else:
        compiled = aotgrad.aot_function(lambda m, x: m(x))
        run = lambda x: compiled(model, x)  # noqa: E731
    x = two(torch.full((2, 4), 1.0), torch.full((2, 4), -1.0))
    _losses_and_grads_match(run, model, eager, x)
