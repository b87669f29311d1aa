"""Every input of a custom ``autograd.Function`` gets eager's gradient on every frontend: a
parameter, a buffer, a closed-over tensor, a view of one, the same tensor twice (Note [Custom
Functions over closed-over tensors]).

The parameter handed straight to ``apply`` (``MyFn.apply(x, self.w)``) regressed unseen because
the oracle compared no parameter gradient of a function reaching a module; ``verify`` now does
(Note [What verify compares]), and every case here runs through it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable

import aotgrad
from aotgrad.testing import verify


class Mul(torch.autograd.Function):  # forward(ctx, ...) style
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = (g * x).sum(0) if ctx.needs_input_grad[1] else None
        return gx, gw


class MulSetup(torch.autograd.Function):  # setup_context style
    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x * w).tanh()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        d = g * (1 - (x * w).tanh() ** 2)
        return d * w, (d * x).sum(0)


class TwoOutputs(torch.autograd.Function):  # set_materialize_grads(False), an unused output
    @staticmethod
    def forward(ctx, x, w):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        return x * w, x + w

    @staticmethod
    def backward(ctx, g_mul, g_add):
        x, w = ctx.saved_tensors
        gx = torch.zeros_like(x) if g_add is None else g_add.clone()
        gw = torch.zeros_like(w) if g_add is None else g_add.sum(0)
        if g_mul is not None:
            gx, gw = gx + g_mul * w, gw + (g_mul * x).sum(0)
        return gx, gw


class WithIndex(torch.autograd.Function):  # mark_non_differentiable
    @staticmethod
    def forward(ctx, x, w):
        y = x * w
        index = y.argmax(-1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(x, w)
        return y, index

    @staticmethod
    def backward(ctx, g, _):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Dirty(torch.autograd.Function):  # mark_dirty on x, a parameter beside it
    @staticmethod
    def forward(ctx, x, w):
        x.add_(w)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, g.sum(0)


class Product(torch.autograd.Function):  # two inputs of one shape (the same tensor twice)
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class ViewOfInput(torch.autograd.Function):  # returns a view of its first input
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x.view(-1), (x * w).sum(-1)

    @staticmethod
    def backward(ctx, g_view, g_sum):
        (x,) = ctx.saved_tensors
        return g_view.view(x.shape) + g_sum[:, None] * 0.5, (g_sum[:, None] * x).sum(0)


scale = torch.randn(4, requires_grad=True)  # a global tensor, not a parameter


class Model(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("buf", torch.randn(4))
        self.scale = torch.randn(4, requires_grad=True)  # a plain tensor attribute
        self.body = body

    def forward(self, x):
        return self.body(self, x)


BODIES = {
    "parameter": lambda m, x: Mul.apply(x, m.w).sum(-1),
    "parameter, setup_context": lambda m, x: MulSetup.apply(x, m.w),
    "buffer": lambda m, x: Mul.apply(x, m.buf) * m.w,
    "tensor attribute": lambda m, x: Mul.apply(x, m.scale) + m.w,
    "view of a parameter": lambda m, x: Mul.apply(x, m.w[:, None].squeeze(-1)),
    "same parameter twice": lambda m, x: Product.apply(m.w, m.w) + x,
    "once_differentiable": lambda m, x: OnceDifferentiable.apply(x, m.w),
    "set_materialize_grads(False)": lambda m, x: TwoOutputs.apply(x, m.w)[1],
    "mark_non_differentiable": lambda m, x: WithIndex.apply(x, m.w)[0],
    "mark_dirty": lambda m, x: Dirty.apply(x * 1, m.w),
    "view returned": lambda m, x: torch.cat(ViewOfInput.apply(x * 1, m.w)),
}


def _trace(example):
    return lambda fn: aotgrad.trace(fn, example)


def _dynamo(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotgrad")


@pytest.mark.parametrize("frontend", ["aot_module", "aot_function over a global", "trace"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["x", "x requires grad"])
@pytest.mark.parametrize("body", list(BODIES))
def test_every_input_gets_eagers_gradient(body, x_grad, frontend):
    torch.manual_seed(0)
    model = Model(BODIES[body])
    x = torch.randn(3, 4, requires_grad=x_grad)
    fn = model if frontend != "aot_function over a global" else (lambda x: model(x))
    compile_fn = _trace(x) if frontend == "trace" else None
    report = verify(fn, x, compile_fn=compile_fn)
    assert report.compared_grads >= 1 + x_grad, str(report)


def loss_over_a_global_tensor(x):
    return Mul.apply(x, scale).sum()


@pytest.mark.parametrize("x_grad", [False, True], ids=["x", "x requires grad"])
def test_a_global_tensor(x_grad):
    report = verify(loss_over_a_global_tensor, torch.randn(3, 4, requires_grad=x_grad))
    assert report.compared_grads == 1 + x_grad, str(report)


@pytest.mark.parametrize("body", ["parameter", "parameter, setup_context", "tensor attribute"])
def test_the_dynamo_backend(body):
    model = Model(BODIES[body])
    report = verify(lambda x: model(x), torch.randn(3, 4, requires_grad=True), compile_fn=_dynamo)
    assert report.compared_grads >= 2, str(report)


def test_create_graph_through_a_parameter():
    model = Model(lambda m, x: MulSetup.apply(x, m.w).sin())
    report = verify(model, torch.randn(3, 4, requires_grad=True), create_graph=True)
    assert report.compared_grads >= 4, str(report)


def test_scan_body_over_a_closed_over_parameter():
    w = nn.Parameter(torch.randn(4))

    def body(carry, x):
        carry = Product.apply(carry, w).tanh() + x
        return carry, carry.sum()

    init, xs = torch.randn(4, requires_grad=True), torch.randn(5, 4)
    carry, ys = aotgrad.scan(body, init, xs)
    (carry.sum() + ys.sum()).backward()
    got = (init.grad, w.grad)
    init.grad = w.grad = None
    eager_ys = []
    eager = init
    for x in xs:
        eager, y = body(eager, x)
        eager_ys.append(y)
    (eager.sum() + torch.stack(eager_ys).sum()).backward()
    torch.testing.assert_close(got[0], init.grad)
    torch.testing.assert_close(got[1], w.grad)


def test_a_real_tensor_the_capture_cannot_lift_is_refused_not_dropped():
    holder = {"w": torch.randn(4, requires_grad=True)}

    def reach():  # a function of another namespace: its globals are not walked
        return holder["w"]

    namespace: dict = {"reach": reach, "Mul": Mul}
    exec("def loss(x):\n    return Mul.apply(x, reach()).sum()", namespace)
    x = torch.randn(3, 4)
    with pytest.raises(aotgrad.AotgradError, match=r"Mul\.apply reads a tensor that requires grad"):
        aotgrad.aot_function(namespace["loss"])(x)
