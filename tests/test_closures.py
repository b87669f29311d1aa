"""Tensors a function reaches without taking them as arguments (Note [Closed-over tensors])."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn as nn

import aotgrad

W_GLOBAL = torch.randn(3, requires_grad=True)
G = torch.zeros(2)


def grads_of(module):
    return {n: p.grad for n, p in module.named_parameters()}


def assert_same_grads(ours, eager):
    assert ours.keys() == eager.keys()
    for name in eager:
        assert ours[name] is not None, f"{name}: no gradient"
        torch.testing.assert_close(ours[name], eager[name], msg=name)


def test_a_closed_over_module_gets_its_gradients_like_eager():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    twin = copy.deepcopy(lin)
    x = torch.randn(4, 3)  # does not require grad: only the closure does
    out = aotgrad.aot_function(lambda x: lin(x).sum())(x)
    expected = twin(x).sum()
    assert out.requires_grad and expected.requires_grad
    torch.testing.assert_close(out, expected)
    out.backward()
    expected.backward()
    assert_same_grads(grads_of(lin), grads_of(twin))


def test_a_tensor_default_argument_gets_its_gradient():
    w = torch.randn(3, requires_grad=True)

    def f(a, w=w):
        return (a * w).sum()

    out = aotgrad.aot_function(f)(torch.ones(3))
    assert out.requires_grad
    out.backward()
    torch.testing.assert_close(w.grad, torch.ones(3))


def test_a_global_tensor_gets_its_gradient_and_is_named_global():
    def f(a):
        return (a * W_GLOBAL).sum()

    traced = aotgrad.trace(f, torch.ones(3))
    assert [str(d) for d in traced.signature.forward_inputs] == ["global W_GLOBAL", "a"]
    W_GLOBAL.grad = None
    aotgrad.aot_function(f)(torch.full((3,), 2.0)).backward()
    torch.testing.assert_close(W_GLOBAL.grad, torch.full((3,), 2.0))


def test_closed_over_tensors_are_named_by_where_they_were_found():
    lin = nn.Linear(3, 2)
    scale = torch.ones(2, requires_grad=True)

    def f(x, bias=torch.zeros(2)):  # noqa: B008 -- a tensor default is the case
        return lin(x) * scale + bias

    traced = aotgrad.trace(f, torch.ones(1, 3))
    assert [str(d) for d in traced.signature.forward_inputs] == [
        "closure lin.weight",
        "closure lin.bias",
        "closure scale",
        "closure bias (default)",
        "x",
    ]
    assert "lin_weight,  # closure lin.weight" in traced.forward.code


def test_a_global_tensor_mutated_in_place_changes_once_per_call_like_eager():
    def f(x):
        G.add_(1)
        return x + G

    G.zero_()
    compiled = aotgrad.aot_function(f)
    first, second = compiled(torch.ones(2)), compiled(torch.ones(2))
    torch.testing.assert_close(G, torch.full((2,), 2.0))  # eager: 2 after two calls
    torch.testing.assert_close(first, torch.full((2,), 2.0))
    torch.testing.assert_close(second, torch.full((2,), 3.0))


def test_capture_never_writes_a_closed_over_tensor():
    buffer = torch.zeros(2)

    def f(x):
        buffer.mul_(2).add_(1)
        return x * buffer

    traced = aotgrad.trace(f, torch.ones(2))
    assert buffer.eq(0).all(), "the capture wrote the real tensor"
    assert "new value of closure buffer" in str(traced.signature)


def test_a_rebound_global_is_read_again_on_each_call():
    namespace = {"W": torch.ones(2)}
    exec("def f(x):\n    return x * W", namespace)
    compiled = aotgrad.aot_function(namespace["f"])
    torch.testing.assert_close(compiled(torch.ones(2)), torch.ones(2))
    namespace["W"] = torch.full((2,), 3.0)
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))


def test_a_bound_method_lifts_its_objects_tensors():
    class Scaler:
        def __init__(self):
            self.w = torch.full((2,), 2.0, requires_grad=True)

        def apply(self, x):
            return (x * self.w).sum()

    scaler = Scaler()
    out = aotgrad.aot_function(scaler.apply)(torch.ones(2))
    out.backward()
    torch.testing.assert_close(scaler.w.grad, torch.ones(2))


def test_a_closed_over_non_leaf_routes_its_gradient_to_its_leaf():
    w = torch.randn(3, requires_grad=True)
    doubled = w * 2  # computed outside the function: a non-leaf that requires grad
    aotgrad.aot_function(lambda x: (x * doubled).sum())(torch.ones(3)).backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))


def test_a_tensor_in_a_closed_over_dict_is_lifted():
    weights = {"a": torch.ones(2, requires_grad=True), "n": 3}
    out = aotgrad.aot_function(lambda x: (x * weights["a"] * weights["n"]).sum())(torch.ones(2))
    out.backward()
    torch.testing.assert_close(weights["a"].grad, torch.full((2,), 3.0))


class Hidden:
    weight = torch.ones(2, requires_grad=True)  # through a class: not walked


def test_a_tensor_that_requires_grad_and_cannot_be_lifted_is_refused():
    with pytest.raises(aotgrad.UnsupportedClosureError, match="requires grad") as e:
        aotgrad.aot_function(lambda x: (x * Hidden.weight).sum())(torch.ones(2))
    assert "Hidden.weight" in str(e.value)


def test_an_aot_module_lifts_a_global_its_forward_reads():
    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) * W_GLOBAL[:2]

    model = Shift()
    W_GLOBAL.grad = None
    aotgrad.aot_module(model)(torch.ones(1, 2)).sum().backward()
    assert W_GLOBAL.grad is not None and model.lin.weight.grad is not None


def test_a_transformers_model_in_a_lambda_gets_every_gradient_like_eager():
    # torchvision's C++ ops are missing with the CPU torch; transformers imports it
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 5))
    compiled = aotgrad.aot_function(lambda ids: model(ids).logits.sum())
    out = compiled(ids)
    expected = twin(ids).logits.sum()
    torch.testing.assert_close(out, expected)
    out.backward()
    expected.backward()
    assert_same_grads(grads_of(model), grads_of(twin))
    # a second call reuses the entry and accumulates like eager
    compiled(ids).backward()
    twin(ids).logits.sum().backward()
    assert_same_grads(grads_of(model), grads_of(twin))
    assert aotgrad.cache_info(compiled).misses == 1


# Note [Module arguments]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
        self.scale = 2.0

    def forward(self, x):
        return self.out(self.bn(self.fc(x)).relu()) * self.scale


def _step(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def test_a_module_argument_gets_grads_and_buffer_updates_like_eager():
    torch.manual_seed(0)
    net, x, y = _Net(), torch.randn(5, 3), torch.randn(5, 2)
    twin = copy.deepcopy(net)
    compiled = aotgrad.aot_function(_step)
    for _ in range(2):  # the second call hits, accumulates and updates again like eager
        compiled(net, x, y).backward()
        _step(twin, x, y).backward()
    assert_same_grads(grads_of(net), grads_of(twin))
    for (name, b), (_, c) in zip(net.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(b, c), name
    assert aotgrad.cache_info(compiled).misses == 1


def test_a_module_arguments_state_is_named_by_its_path():
    traced = aotgrad.trace(_step, _Net(), torch.randn(5, 3), y=torch.randn(5, 2))
    names = [str(d) for d in traced.signature.forward_inputs]
    assert names[:2] == ["model.fc.weight", "model.fc.bias"]
    assert "model.bn.running_mean" in names and names[-2:] == ["x", "y"]
    assert "grad of model.out.weight" in [str(d) for d in traced.signature.backward_outputs]


def test_a_module_arguments_attributes_and_identity_are_guarded():
    net, x, y = _Net(), torch.randn(5, 3), torch.randn(5, 2)
    compiled = aotgrad.aot_function(_step)
    compiled(net, x, y)
    net.eval()
    torch.testing.assert_close(compiled(net, x, y), _step(net, x, y))
    net.scale = 3.0
    torch.testing.assert_close(compiled(net, x, y), _step(net, x, y))
    other = copy.deepcopy(net)
    torch.testing.assert_close(compiled(other, x, y), _step(other, x, y))
    reasons = aotgrad.cache_info(compiled).reasons
    assert "input model.training: value True != False" in reasons[1]
    assert reasons[2] == "input model.scale: value 2.0 != 3.0"
    assert reasons[3].startswith("input model: value <") and "_Net object" in reasons[3]


def test_a_module_argument_passes_verify():
    from aotgrad.testing import verify

    report = verify(_step, _Net(), torch.randn(5, 3), torch.randn(5, 2))
    assert report.ok and report.compared_grads == 6


def _library_model(name):
    # torchvision's C++ ops are missing with the CPU torch (shim in library_models)
    pytest.importorskip("transformers" if name == "gpt2" else "timm")
    from library_models import build

    return build(name)


@pytest.mark.parametrize("name", ["gpt2", "efficientnet"])
def test_a_library_model_passed_as_an_argument_matches_eager(name):
    from aotgrad.testing import verify

    case = _library_model(name)

    def step(model, args, kwargs):
        return case.loss(model(*args, **kwargs))

    report = verify(step, case.model, case.args, case.kwargs, rtol=1e-4, atol=1e-5)
    assert report.ok, str(report)
    assert report.compared_grads == sum(p.requires_grad for p in case.model.parameters())
