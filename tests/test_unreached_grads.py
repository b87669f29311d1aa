"""A gradient is None exactly where eager's is: no path from the outputs backward runs on.

See Note [Gradients no output reaches] (``capture/analyses/reachability.py``) and Note [Missing
cotangents] (``runtime/function.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import aotgrad
from aotgrad.testing import verify


class CustomNone(torch.autograd.Function):
    """Backward returns ``None`` for its second input, though it is on the path."""

    @staticmethod
    def forward(ctx, x, y):
        return x * y.detach()

    @staticmethod
    def backward(ctx, g):
        return g, None


def three_outputs(a, c):
    return a * 2, c.sin(), (a + c).floor()


def compilers():
    return {
        "aot": aotgrad.aot_function,
        "dynamic": lambda f: aotgrad.aot_function(f, dynamic=True),
        "compile": _compiled,
    }


def _compiled(f):
    torch._dynamo.reset()
    return torch.compile(f, backend="aotgrad")


def _grads_after_backward_on(fn, which, *args):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in args]
    out = fn(*leaves)
    out[which].sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("mode", ["aot", "dynamic", "compile"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_backward_on_one_output_leaves_the_others_inputs_none(mode, which):
    args = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    compiled = compilers()[mode](three_outputs)
    eager = _grads_after_backward_on(three_outputs, which, *args)
    ours = _grads_after_backward_on(compiled, which, *args)
    for e, c in zip(eager, ours, strict=True):
        assert (e is None) == (c is None)
        if e is not None:
            torch.testing.assert_close(c, e)
    if which == 2:  # floor: a path that carries zeros gives zeros, as in eager
        assert all(g is not None and not g.any() for g in ours)


def test_partial_cotangents_under_dynamic_shapes_take_this_calls_sizes():
    compiled = aotgrad.aot_function(three_outputs, dynamic=True)
    for n in (3, 5):
        a, c = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
        compiled(a, c)[0].sum().backward()
        assert c.grad is None
        torch.testing.assert_close(a.grad, torch.full((n,), 2.0))


def test_no_cotangent_at_all_returns_no_gradient():
    def fn(a, c):
        return a * 2, c * 3

    a, c = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    _, y = aotgrad.aot_function(fn)(a, c)
    # y reaches the Function only through a custom backward returning None: all undefined.
    CustomNone.apply(torch.ones(2, requires_grad=True), y).sum().backward()
    assert a.grad is None and c.grad is None


def test_mutated_input_new_value_is_a_path():
    def fn(a, c):
        a.mul_(c)
        return c * 2

    verify(fn, torch.randn(3, requires_grad=True) * 1, torch.randn(3, requires_grad=True))


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x).relu()
        return self.used(h), self.unused(h)


@pytest.mark.parametrize("mode", ["aot_module", "compile"])
def test_params_of_an_output_the_loss_ignores_get_no_gradient(mode):
    torch.manual_seed(0)
    model = TwoHeads()
    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = aotgrad.aot_module(ours) if mode == "aot_module" else _compiled(ours)
    x = torch.randn(3, 4)
    eager(x)[0].sum().backward()
    compiled(x)[0].sum().backward()
    for (name, e), (_, c) in zip(eager.named_parameters(), ours.named_parameters(), strict=True):
        assert (e.grad is None) == (c.grad is None), name
        if e.grad is not None:
            torch.testing.assert_close(c.grad, e.grad)
    assert ours.unused.weight.grad is None


@pytest.mark.parametrize("mode", ["aot_module", "compile"])
def test_bert_pooler_gets_no_gradient_when_the_loss_ignores_it(mode):
    import library_models  # noqa: F401  (the torchvision shim, offline transformers)

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    model = transformers.BertModel(config).eval()
    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = aotgrad.aot_module(ours) if mode == "aot_module" else _compiled(ours)
    ids = torch.randint(0, 64, (2, 8))
    eager(input_ids=ids).last_hidden_state.sum().backward()
    compiled(input_ids=ids).last_hidden_state.sum().backward()
    unreached = [n for n, p in eager.named_parameters() if p.grad is None]
    assert unreached == ["pooler.dense.weight", "pooler.dense.bias"]
    for (name, e), (_, c) in zip(eager.named_parameters(), ours.named_parameters(), strict=True):
        assert (e.grad is None) == (c.grad is None), name
        if e.grad is not None:
            torch.testing.assert_close(c.grad, e.grad, rtol=1e-4, atol=1e-5)


class TwoCheckpointedHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x):
        run = torch.utils.checkpoint.checkpoint
        return run(self.first, x, use_reentrant=True), run(self.second, x, use_reentrant=True)


@pytest.mark.parametrize("which", [0, 1])
def test_reentrant_checkpoint_reaches_the_parameters_its_region_uses(which):
    # The checkpoint's autograd node has no edge to the parameters: its own backward reaches them.
    torch.manual_seed(0)
    model = TwoCheckpointedHeads()
    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = aotgrad.aot_module(ours)
    x = torch.randn(3, 4, requires_grad=True)
    eager(x)[which].sum().backward()
    compiled(x.detach().requires_grad_())[which].sum().backward()
    for (name, e), (_, c) in zip(eager.named_parameters(), ours.named_parameters(), strict=True):
        assert (e.grad is None) == (c.grad is None), name
        if e.grad is not None:
            torch.testing.assert_close(c.grad, e.grad)
