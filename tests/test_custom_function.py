"""Custom ``torch.autograd.Function``s inside a compiled function: eager's values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.function import once_differentiable

from aotgrad.testing import verify


class ReturnsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ReturnsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view(-1)

    @staticmethod
    def backward(ctx, g):
        return g.view(2, 3) * 3


class MarksDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NonDifferentiableOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        index = x.argmax()
        ctx.mark_non_differentiable(index)
        return x * 2, index

    @staticmethod
    def backward(ctx, g, g_index):
        return g * 2


class ReturnsInputAndIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        index = x.argmax()
        ctx.mark_non_differentiable(index)
        return x, index

    @staticmethod
    def backward(ctx, g, g_index):
        return g * 5


class SavesInputAndOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y + x


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x


CASES = {
    "returns its input": lambda x: ReturnsInput.apply(x),
    "returns its input, used after": lambda x: ReturnsInput.apply(x).sin(),
    "returns its input twice": lambda x: (ReturnsInput.apply(x),) * 2,
    "returns its input and a view of it": lambda x: _and_view(ReturnsInput.apply(x)),
    "returns a view of its input": lambda x: ReturnsView.apply(x),
    "returns a view of its input, used after": lambda x: ReturnsView.apply(x).cos(),
    "returns a view of an intermediate": lambda x: ReturnsView.apply(x * 1),
    "returns a view of an intermediate also returned": lambda x: _view_and_base(x * 1),
    "returns an intermediate, returned with a view": lambda x: _with_transposed(x * 1),
    "returns an intermediate marked dirty": lambda x: MarksDirty.apply(x * 1),
    "non-differentiable output": lambda x: NonDifferentiableOutput.apply(x),
    "returns its input and a non-differentiable output": lambda x: ReturnsInputAndIndex.apply(x),
    "saves its input and output": lambda x: SavesInputAndOutput.apply(x),
    "once_differentiable returns its input": lambda x: OnceDifferentiable.apply(x),
    "once_differentiable, used after": lambda x: OnceDifferentiable.apply(x).tanh(),
}


def _view_and_base(a):
    return a, ReturnsView.apply(a)


def _with_transposed(a):
    return ReturnsInput.apply(a), a.t()


def _and_view(y):
    return y, y.t()


@pytest.mark.parametrize("name", list(CASES))
def test_custom_function_matches_eager(name):
    torch.manual_seed(0)
    verify(CASES[name], torch.randn(2, 3, requires_grad=True))


def test_returns_a_non_leaf_input_marked_dirty():
    def f(x):
        return MarksDirty.apply(x).sum()

    verify(f, torch.randn(2, 3, requires_grad=True) * 1)


def test_returns_its_input_without_grad():
    verify(lambda x: ReturnsInput.apply(x), torch.randn(2, 3))
