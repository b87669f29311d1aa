"""The oracle sees every gradient: ``verify`` compares the gradients (and the values after the
call) of the tensors a function reaches through modules, globals, closures, defaults and bound
``self`` (Note [What verify compares]) — and it can fail on each of them."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aotgrad.testing import verify

torch.manual_seed(0)
lin = nn.Linear(3, 2)
bn = nn.BatchNorm1d(3)


def loss_over_global(x):
    return lin(x).square().mean()


def loss_with_batchnorm(x):
    return lin(bn(x)).sum()


def test_a_global_modules_gradients_are_compared():
    report = verify(loss_over_global, torch.randn(4, 3))
    assert report.compared_grads == 2 and report.compared_reached == 2, str(report)


def test_a_missing_gradient_of_a_global_is_a_mismatch():
    def no_weight_grad(fn):
        return lambda x: F.linear(x, lin.weight.detach(), lin.bias).square().mean()

    report = verify(loss_over_global, torch.randn(4, 3), compile_fn=no_weight_grad, check=False)
    assert report.mismatches == ["grad of global lin.weight: None != eager a tensor"], str(report)


def test_a_wrong_gradient_of_a_global_is_a_mismatch():
    # The value is eager's, the bias's gradient is not.
    def wrong(fn):
        return lambda x: fn(x) + (lin.bias - lin.bias.detach()).sum()

    report = verify(loss_over_global, torch.randn(4, 3), compile_fn=wrong, check=False)
    assert [m.split(":")[0] for m in report.mismatches] == ["grad of global lin.bias"]


def test_buffers_of_a_global_after_the_call_are_compared():
    def eval_mode(fn):
        def run(x):
            bn.eval()
            try:
                return fn(x)
            finally:
                bn.train()

        return run

    x = torch.randn(4, 3)
    assert verify(loss_with_batchnorm, x).ok
    report = verify(loss_with_batchnorm, x, compile_fn=eval_mode, check=False)
    wrong = {m.split(":")[0] for m in report.mismatches}
    assert {
        "global bn.running_mean after the call",
        "global bn.running_var after the call",
    } <= wrong


def test_the_global_is_left_as_one_eager_call_leaves_it():
    x = torch.randn(4, 3)
    bn.reset_running_stats()
    lin.zero_grad(set_to_none=False)
    lin.weight.grad.fill_(1.0)
    expected_state = [t.clone() for t in bn.buffers()]
    eager_bn = nn.BatchNorm1d(3)
    eager_bn.load_state_dict(bn.state_dict())
    w = lin.weight.detach().clone().requires_grad_(True)
    F.linear(eager_bn(x), w, lin.bias.detach()).sum().backward()
    verify(loss_with_batchnorm, x)
    torch.testing.assert_close(lin.weight.grad, 1.0 + w.grad)
    for after, before, eager in zip(bn.buffers(), expected_state, eager_bn.buffers(), strict=True):
        torch.testing.assert_close(after, eager)
        assert not torch.equal(after, before) or after.dtype == torch.long


class Trainer:  # not a module: reached through bound self
    def __init__(self):
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def loss(self, x):
        return self.model(x).sum()


def _closure_loss():
    model = nn.Linear(3, 2)
    return lambda x: model(x).relu().sum()


def _default_loss(x, w=torch.randn(3, 2, requires_grad=True)):  # noqa: B008
    return (x @ w).sum()


@pytest.mark.parametrize(
    ("name", "make", "grads"),
    [
        ("global", lambda: loss_over_global, 2),
        ("closure", _closure_loss, 2),
        ("default", lambda: _default_loss, 1),
        ("bound self", lambda: Trainer().loss, 4),
        ("partial", lambda: functools.partial(lambda m, x: m(x).sum(), nn.Linear(3, 2)), 2),
        ("module", lambda: nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), 4),
    ],
)
def test_every_way_of_reaching_a_tensor_is_compared(name, make, grads):
    report = verify(make(), torch.randn(4, 3))
    assert report.compared_grads == grads, str(report)


@pytest.mark.parametrize("create_graph", [False, True])
def test_second_order_gradients_of_a_global_are_compared(create_graph):
    report = verify(lambda x: lin(x).tanh().sum(), torch.randn(4, 3), create_graph=create_graph)
    # first order: lin.weight, lin.bias; second order: both again and the cotangent
    assert report.compared_grads == (5 if create_graph else 2), str(report)


def test_verify_copies_subclass_arguments_and_compares_their_gradients():
    """verify crashed on a TwoTensor argument (its storage holds no data); its gradient is
    compared inner tensor by inner tensor, with a cotangent of the output's subclass."""
    from torch.testing._internal.two_tensor import TwoTensor

    class DoubledGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 4

    def fn(a):
        return (a * 2).sin()

    x = TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_()
    report = verify(fn, x)
    assert "1 outputs, 1 gradients" in str(report)

    def wrong(f):
        import aotgrad

        return aotgrad.aot_function(lambda a: DoubledGrad.apply(a).sin())

    with pytest.raises(AssertionError, match="grad"):
        verify(fn, TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_(), compile_fn=wrong)
