"""Grad mode regions inside a compiled function, and requires_grad set inside it: as eager."""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.testing import verify


def view_made_to_require_grad(a):
    v = a.view(-1)
    v.requires_grad_(True)
    return v


def view_made_to_require_grad_used_after(a):
    v = a.view(-1)
    v.requires_grad_(True)
    return v, v * 2


def enable_grad_region(a):
    with torch.enable_grad():
        b = a * 2
    return b, a * 3


def enable_grad_region_returns_view(a):
    with torch.enable_grad():
        b = a.sin()
        c = b.t()
    return b, c, b[0].detach()


def set_grad_enabled_true_region(a):
    with torch.set_grad_enabled(True):
        return a.exp()


def no_grad_region(a):
    with torch.no_grad():
        b = a * 2
    return b + a, b


def set_grad_enabled_false_region(a):
    with torch.set_grad_enabled(False):
        b = a.cos()
    return b, a.sin()


def inference_mode_region(a):
    with torch.inference_mode():
        b = a * 2
    return b.clone() + a


def no_grad_region_with_mutation(a):
    b = a * 1
    with torch.no_grad():
        b.mul_(2)
    return b


# (function, input requires grad, called under no_grad)
CASES = {
    "view of an input made to require grad": (view_made_to_require_grad, False, False),
    "enable_grad under a no_grad call": (enable_grad_region, True, True),
    "enable_grad view outputs under a no_grad call": (enable_grad_region_returns_view, True, True),
    "set_grad_enabled(True) under a no_grad call": (set_grad_enabled_true_region, True, True),
    "enable_grad in a grad call": (enable_grad_region, True, False),
    "no_grad in a grad call": (no_grad_region, True, False),
    "set_grad_enabled(False) in a grad call": (set_grad_enabled_false_region, True, False),
    "inference_mode in a grad call": (inference_mode_region, True, False),
    "no_grad mutation in a grad call": (no_grad_region_with_mutation, True, False),
    "no_grad call without regions": (lambda a: a * 2, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grad_mode_matches_eager(name):
    fn, requires_grad, under_no_grad = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=requires_grad)
    if under_no_grad:
        with torch.no_grad():
            verify(fn, x)
    else:
        verify(fn, x)


def test_enable_grad_under_no_grad_backpropagates():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = aotgrad.aot_function(lambda a: _doubled_with_grad(a))(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def _doubled_with_grad(a):
    with torch.enable_grad():
        return a * 2


def intermediate_made_to_require_grad(a):
    b = a * 1
    b.requires_grad_(True)
    return b * 2


@pytest.mark.parametrize(
    "fn", [intermediate_made_to_require_grad, view_made_to_require_grad_used_after]
)
def test_output_requiring_grad_through_an_inner_leaf_refuses(fn):
    # Eager sends its gradient into a leaf made inside the function: nothing to return it to.
    with pytest.raises(aotgrad.errors.UnsupportedOutputError, match="requires_grad_"):
        aotgrad.aot_function(fn)(torch.randn(3, 4))
