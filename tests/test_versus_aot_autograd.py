"""Mutation and aliasing cases through aotgrad and PyTorch's AOTAutograd, both against eager.

Every case PyTorch gets right, aotgrad must get right too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function as torch_aot_function

import aotgrad
from aotgrad.testing import verify


def t(*shape, grad=False, leaf=True):
    x = torch.randn(*shape, requires_grad=grad)
    return x if leaf or not grad else x * 1


def same(x):
    return (x, x)


def mutate_view_created_before(x):
    y = x.view(-1)
    x.mul_(2)
    return y


def inplace_intermediate(x):
    a = x * 2
    a.add_(1)
    return a


def batch_norm_train(x, mean, var, w):
    return F.batch_norm(x, mean, var, w, None, training=True)


def no_grad_region(x):
    with torch.no_grad():
        y = x * 2
    return y + x


def _add_one(x):
    x.add_(1)


CASES = {
    "add_ on input": (lambda x: x.add_(1) * 2, lambda: (t(3),)),
    "mul_ by grad input": (lambda x, y: x.mul_(y).sum(), lambda: (t(3), t(3, grad=True))),
    "mul_ on non-leaf": (
        lambda x, y: x.mul_(y).sum(),
        lambda: (t(3, grad=True, leaf=False), t(3, grad=True)),
    ),
    "zero_ on a slice of input": (lambda x: x[1:].zero_() is None or x.sum(), lambda: (t(4),)),
    "index_put_ on input": (
        lambda x, v: x.index_put_((torch.tensor([0, 2]),), v) * 1,
        lambda: (t(4), t(2, grad=True)),
    ),
    "copy_ into input": (lambda x, y: x.copy_(y) + 1, lambda: (t(3), t(3, grad=True))),
    "t_": (lambda x: x.t_() * 1, lambda: (t(2, 3),)),
    "unsqueeze_ and return": (lambda x: x.unsqueeze_(0), lambda: (t(2, 3),)),
    "transpose_ then sum": (lambda x: x.transpose_(0, 1).sum(), lambda: (t(2, 3),)),
    "resize_": (lambda x: x.resize_(2, 2) + 0, lambda: (t(3, 3),)),
    "view of input out": (lambda x: x.view(-1), lambda: (t(2, 3, grad=True),)),
    "input itself out": (lambda x: x, lambda: (t(3, grad=True),)),
    "detach of input out": (lambda x: x.detach(), lambda: (t(3, grad=True),)),
    "t of input with grad": (lambda x: (x.t(), x.sum()), lambda: (t(2, 3, grad=True),)),
    "two views of input": (lambda x: (x[0], x[1]), lambda: (t(2, 3, grad=True),)),
    "intermediate and its view": (
        lambda x: (lambda a: (a, a.view(-1)))(x.sin()),
        lambda: (t(2, 3, grad=True),),
    ),
    "two views of an intermediate": (
        lambda x: (lambda a: (a.t(), a[0]))(x.sin()),
        lambda: (t(2, 3, grad=True),),
    ),
    "same intermediate twice": (lambda x: same(x.cos()), lambda: (t(3, grad=True),)),
    "view of input created before mutation": (mutate_view_created_before, lambda: (t(4),)),
    "mutated input returned as view": (lambda x: x.add_(1).view(2, 2), lambda: (t(4),)),
    "in-place on an intermediate": (inplace_intermediate, lambda: (t(3, grad=True),)),
    "duplicate inputs": (lambda x, y: (x * y).sum(), lambda: (lambda a: (a, a))(t(3, grad=True))),
    "duplicate inputs, one mutated": (lambda x, y: x.add_(1) + y, lambda: (lambda a: (a, a))(t(3))),
    "overlapping inputs, one mutated": (
        lambda x, v: (v.add_(1), x * 2)[1],
        lambda: (lambda a: (a, a.view(2, 2)))(t(4)),
    ),
    "overlapping slices, one mutated": (
        lambda a, b: a.mul_(2).sum() + b.sum(),
        lambda: (lambda z: (z[:4], z[2:]))(t(6)),
    ),
    "no_grad region": (no_grad_region, lambda: (t(3, grad=True),)),
    "leaf mutated under no_grad": (lambda x: _nograd_mul(x), lambda: (t(3, grad=True),)),
    "batch_norm updates running stats": (
        batch_norm_train,
        lambda: (t(4, 3, grad=True), torch.zeros(3), torch.ones(3), t(3, grad=True)),
    ),
    "dropout": (lambda x: F.dropout(x, 0.3), lambda: (t(32, 32, grad=True),)),
    "argmax and max": (lambda x: (x.argmax(), x.max()), lambda: (t(5, grad=True),)),
    "None and int outputs": (lambda x: (None, 2, x.exp()), lambda: (t(3, grad=True),)),
    "mutate non-leaf view input": (
        lambda x: x.mul_(3).sum(),
        lambda: (t(2, 3, grad=True, leaf=False)[0],),
    ),
    "mutate through detach of a leaf": (
        lambda x: x.detach().add_(1) * 2,
        lambda: (t(3, grad=True),),
    ),
    "mutate through .data of a leaf": (
        lambda x: (x.data.add_(1), x * 2)[1],
        lambda: (t(3, grad=True),),
    ),
    "mutation, no return value": (_add_one, lambda: (t(3),)),
    "view input mutated": (lambda x: x.add_(1), lambda: (t(3, 4)[1],)),
    "view input t_": (lambda x: x.t_(), lambda: (t(3, 4)[:, 1:],)),
    "no_grad zero_ on view of leaf": (
        lambda x: _nograd_zero_first(x) * 2,
        lambda: (t(3, grad=True),),
    ),
    "two inputs mutated": (lambda x, y: (x.add_(y), y.mul_(2))[0] + y, lambda: (t(3), t(3))),
    "fill_ from a 0-d tensor": (
        lambda x, v: x.fill_(v),
        lambda: (t(3), torch.tensor(2.0, requires_grad=True)),
    ),
}


def _nograd_zero_first(x):
    with torch.no_grad():
        x[0].zero_()
    return x


def _nograd_mul(x):
    with torch.no_grad():
        x.mul_(2)
    return x.sum()


def run(compile_fn, name):
    fn, make = CASES[name]
    torch.manual_seed(0)
    args = make()
    try:
        return verify(fn, *args, check=False, compile_fn=compile_fn).ok
    except Exception:
        return False


OURS = lambda fn: aotgrad.aot_function(fn)  # noqa: E731
THEIRS = lambda fn: torch_aot_function(fn, aotgrad.nop)  # noqa: E731


@pytest.mark.parametrize("name", list(CASES))
def test_aotgrad_matches_eager(name):
    fn, make = CASES[name]
    torch.manual_seed(0)
    verify(fn, *make())


def test_aotgrad_gets_right_every_case_pytorch_gets_right():
    ours = {name for name in CASES if run(OURS, name)}
    theirs = {name for name in CASES if run(THEIRS, name)}
    assert theirs <= ours, f"PyTorch right, aotgrad wrong: {sorted(theirs - ours)}"
    assert len(ours) >= len(theirs)
