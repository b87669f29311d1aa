"""``aotgrad.testing.verify`` names inputs and gradients as the signature's descriptors do."""

from __future__ import annotations

import torch

import aotgrad
from aotgrad.testing import verify


def step(carry, x, *, scale):
    carry["a"].mul_(2)
    return (carry["a"] @ x["w"] + carry["b"]).sin().sum() * scale


def inputs():
    carry = {"a": torch.randn(2, 3), "b": torch.randn(2, 4, requires_grad=True)}
    return carry, {"w": torch.randn(3, 4, requires_grad=True)}


def wrong(fn):
    """A "compiler" that forgets the in-place update and doubles every gradient."""

    def compiled(carry, x, *, scale):
        return fn({"a": carry["a"].clone(), "b": carry["b"]}, x, scale=scale * 2)

    return compiled


def test_mismatches_use_the_signatures_names():
    signature = aotgrad.trace(step, *inputs(), scale=1.0).signature
    names = [str(d) for d in signature.forward_inputs]
    grads = [str(g) for g in signature.backward_outputs if g is not None]
    assert names == ["carry['a']", "carry['b']", "x['w']"]
    report = verify(step, *inputs(), scale=1.0, compile_fn=wrong, check=False)
    text = "\n".join(report.mismatches)
    assert "input carry['a'] after the call: values differ" in text
    for grad in grads:  # "grad of carry['b']", "grad of x['w']"
        assert f"{grad}: values differ" in text
    assert "args[" not in text


def test_a_modules_inputs_are_named_by_its_forward():
    model = torch.nn.Linear(3, 2)

    def broken(module):
        return lambda input: module(input) * 2

    report = verify(model, torch.randn(4, 3, requires_grad=True), compile_fn=broken, check=False)
    text = "\n".join(report.mismatches)
    assert "grad of input: values differ" in text  # Linear.forward(self, input)
    assert "grad of param weight: values differ" in text
