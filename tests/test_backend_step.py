"""``export(flat=True)`` and ``aotgrad.backends.step``, with torch itself as the backend
(``program.module()``): the plumbing every backend shares, without a backend's own numerics."""

from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

import aotgrad
from aotgrad.backends import step
from aotgrad.errors import CallError, ConfigError
from aotgrad.signature.descriptors import Buffer, Closure, Input, MutatedInput, Param
from backend_check import check_backend
from models import GPT, ConvBN


def torch_backend(program):
    """The program run by torch: what a backend computes, bit for bit on CPU."""
    return program.module()


def _kinds(program):
    signature = program.graph_signature
    return {s.kind for s in signature.input_specs}, {s.kind for s in signature.output_specs}


def test_flat_programs_take_state_and_return_mutations_and_gradients():
    torch.manual_seed(0)
    model, args = ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    programs, result = check_backend(
        model, lambda y: y, args, {}, torch_backend, rtol=1e-5, atol=1e-6, decompositions=None
    )
    # Every input the user's, every output the user's: nothing left for a backend to drop.
    for program in (programs.forward, programs.backward):
        inputs, outputs = _kinds(program)
        assert inputs == {InputKind.USER_INPUT} and outputs == {OutputKind.USER_OUTPUT}
        assert not program.state_dict
    lifted = [d for d in programs.forward_inputs if isinstance(d, Param | Buffer)]
    assert len(lifted) == len(programs.lifted) == 9  # conv, bn, fc weights and biases; 3 buffers
    assert [type(d) for d in programs.forward_inputs[9:]] == [Input, Input]
    mutated = [d.of.name for d in programs.forward_outputs if isinstance(d, MutatedInput)]
    assert mutated == [
        "model.bn1.running_mean",
        "model.bn1.running_var",
        "model.bn1.num_batches_tracked",
    ]
    assert set(map(str, result.mutations)) == {f"buffer {n}" for n in mutated}
    assert len(result.grads) == 6


def test_flat_tied_weights_one_gradient():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    _, result = check_backend(
        GPT(), lambda y: y, (tokens, tokens), {}, torch_backend, rtol=1e-5, atol=1e-6
    )
    names = [d.name for d in result.grads]
    assert len(names) == len(set(names))
    assert "model.head.weight" not in names  # tied to the token embedding: one tensor, one name


def test_flat_closed_over_module_is_inputs_and_mutations():
    """A function closing over a module reaches its tensors as closures: in the flat programs
    they are inputs, and the BatchNorm's new statistics outputs (the lifted form refuses
    mutations of closed-over tensors)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    x = torch.randn(6, 8)
    traced = aotgrad.trace(lambda x: net(x).square().mean(), x)
    with pytest.raises(CallError, match="MutatedInput"):
        traced.export()
    programs = traced.export(flat=True)
    assert all(isinstance(d, Closure) for d in programs.forward_inputs[:-1])
    result = step(programs, torch_backend)(x)
    expected = net(x).square().mean()
    expected.backward()
    torch.testing.assert_close(result.outputs[0], expected.detach())
    grads = {d.name: g for d, g in result.grads.items()}
    for name, param in net.named_parameters():
        torch.testing.assert_close(grads[f"net.{name}"], param.grad, msg=name)
    # The eager call above moved the statistics once; the program computed the same move
    # from the values it was given.
    torch.testing.assert_close(result.mutations[Closure("net.1.running_mean")], net[1].running_mean)


def test_flat_gradient_of_a_user_input_and_constants_made_at_capture():
    scale = torch.tensor([1.0, 2.0])

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return (self.lin(x) * torch.tensor([1.0, 2.0])).sum()

    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 3, requires_grad=True)
    programs = aotgrad.trace(model, x).export(flat=True)
    kinds = [s.kind for s in programs.forward.graph_signature.input_specs]
    assert kinds[-1] == InputKind.CONSTANT_TENSOR  # part of the function, not an argument
    result = step(programs, torch_backend)(x)
    expected = model(x) if False else (model.lin(x) * scale).sum()
    expected.backward()
    torch.testing.assert_close(result.grads[Input("x")], x.grad)
    torch.testing.assert_close(result.grads[Param("lin.weight")], model.lin.weight.grad)


def test_step_cotangents_given_and_checked():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    programs = aotgrad.trace(lambda x: lin(x), x).export(flat=True)
    run = step(programs, torch_backend)
    cotangent = torch.randn(4, 2)
    result = run(x, cotangents=[cotangent])
    out = lin(x)
    out.backward(cotangent)
    torch.testing.assert_close(result.grads[Closure("lin.weight")], lin.weight.grad)
    with pytest.raises(CallError, match="expected 1 cotangent"):
        run(x, cotangents=[])
    with pytest.raises(CallError, match="expected 1 input tensor"):
        run(x, x)


def test_step_refuses_lifted_programs_and_unknown_backends():
    lin = torch.nn.Linear(3, 2)
    traced = aotgrad.trace(lin, torch.randn(4, 3))
    with pytest.raises(CallError, match="flat=True"):
        step(traced.export(), torch_backend)
    with pytest.raises(ConfigError, match=r"\['iree', 'onnxruntime'\]"):
        step(traced.export(flat=True), "tvm")
