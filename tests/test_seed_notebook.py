"""The seed notebook's experiments, as tests of what its authors wanted."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.utils.checkpoint

import aotgrad
from aotgrad.signature import Grad, Input
from conftest import clone_inputs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from carry import fn as carry_fn  # the body reads biases, b, weights, a in that order


def layers(a, w):
    a = torch.sin(a)
    a = a @ w
    a = torch.cos(a)
    a = a @ w
    return torch.sigmoid(a)


def ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_trace_without_checkpoint_gives_aten_forward_and_backward():
    traced = aotgrad.trace(layers, torch.randn(4, 4, requires_grad=True), torch.randn(4, 4))
    assert ops(traced.forward) == [
        "aten.sin.default",
        "aten.mm.default",
        "aten.cos.default",
        "aten.mm.default",
        "aten.sigmoid.default",
    ]
    assert "aten.sigmoid_backward.default" in ops(traced.backward)
    assert [str(d) for d in traced.signature.backward_outputs] == ["grad of a", "None"]


def test_the_function_runs_once_on_fake_tensors_and_reads_no_data():
    seen = []

    def spy(a, w):
        seen.append((type(a).__name__, a.device.type))
        return layers(a, w)

    a = torch.randn(4, 4, device="meta", requires_grad=True)
    traced = aotgrad.trace(spy, a, torch.randn(4, 4, device="meta"))
    assert len(seen) == 1, "capture must run the function once (one tracing pass)"
    assert seen[0][0] != "Tensor", "the function must see traced tensors, not the user's"
    assert traced.backward is not None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_saves_only_the_region_inputs(use_reentrant):
    def checkpointed(a, w):
        return torch.utils.checkpoint.checkpoint(layers, a, w, use_reentrant=use_reentrant)

    traced = aotgrad.trace(checkpointed, torch.randn(4, 4, requires_grad=True), torch.randn(4, 4))
    assert {s.name for s in traced.saved} <= {"a", "w"}
    # The backward recomputes the region: sin, mm, cos, mm and sigmoid appear again.
    assert ops(traced.backward).count("aten.sin.default") == 2


def fn_4(a, w):
    a = a @ w
    w = a
    return a, w


def test_aliased_outputs_are_not_lost():
    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    traced = aotgrad.trace(fn_4, a, w)
    assert len(traced.signature.outputs) == 2
    compiled = aotgrad.aot_function(fn_4)
    out = compiled(*clone_inputs((a, w)))
    eager = fn_4(*clone_inputs((a, w)))
    assert out[0] is out[1], "eager returns the same tensor twice; so must aotgrad"
    torch.testing.assert_close(out[0], eager[0])


def test_gradients_flow_through_each_aliased_output():
    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ea, ew = clone_inputs((a, w))
    ca, cw = clone_inputs((a, w))
    eo = fn_4(ea, ew)
    co = aotgrad.aot_function(fn_4)(ca, cw)
    torch.autograd.backward(eo, [torch.ones(4, 4), 2 * torch.ones(4, 4)])
    torch.autograd.backward(co, [torch.ones(4, 4), 2 * torch.ones(4, 4)])
    torch.testing.assert_close(ca.grad, ea.grad)
    torch.testing.assert_close(cw.grad, ew.grad)


def carry_inputs(device="cpu"):
    carry = {"a": torch.randn(2, 3, device=device), "b": torch.randn(2, 3, device=device)}
    x = {"weights": torch.randn(3, 3, device=device), "biases": torch.randn(2, 3, device=device)}
    for t in (*carry.values(), *x.values()):
        t.requires_grad_(True)
    return carry, x


EXPECTED_INPUTS = ["carry['a']", "carry['b']", "x['weights']", "x['biases']"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_argument_order_follows_the_pytrees_not_the_body(device):
    traced = aotgrad.trace(carry_fn, *carry_inputs(device))
    placeholders = [n for n in traced.forward.graph.nodes if n.op == "placeholder"]
    assert [str(n.meta["desc"]) for n in placeholders] == EXPECTED_INPUTS
    assert list(traced.signature.forward_inputs) == [Input(p) for p in EXPECTED_INPUTS]
    assert list(traced.signature.backward_outputs) == [Grad(Input(p)) for p in EXPECTED_INPUTS]
    assert [str(o) for o in traced.signature.outputs] == [
        "output[0]['a']",
        "output[0]['b']",
        "output[1]",
    ]


def test_backward_grads_come_back_in_pytree_order():
    carry, x = carry_inputs()
    traced = aotgrad.trace(carry_fn, carry, x)
    primals = [carry["a"], carry["b"], x["weights"], x["biases"]]
    results = traced.forward(*primals)
    n_out = len(traced.signature.outputs)
    saved = results[n_out:]
    cotangents = [torch.ones_like(r) for r in results[:n_out]]
    grads = traced.backward(*saved, *cotangents)
    expected = torch.autograd.grad(
        [*carry_fn(carry, x)[0].values(), carry_fn(carry, x)[1]],
        primals,
        [torch.ones(2, 3)] * 3,
    )
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_fake_inputs_work_where_export_then_aot_module_failed():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        a = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4)
    assert mode is not None
    traced = aotgrad.trace(layers, a, w)
    assert ops(traced.forward)[0] == "aten.sin.default"
