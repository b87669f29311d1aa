"""aotgrad against eager on real models and pytree functions: values, grads, buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_module as torch_aot_module

import aotgrad
from aotgrad.testing import verify
from conftest import clone_inputs
from models import GPT, MLP, ConvBN, State


def compare_module(model, *args):
    eager, compiled = model, copy.deepcopy(model)
    out_eager = eager(*args)
    out_compiled = aotgrad.aot_module(compiled)(*args)
    torch.testing.assert_close(out_compiled, out_eager)
    out_eager.backward()
    out_compiled.backward()
    for (name, p), (_, q) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        torch.testing.assert_close(q.grad, p.grad, msg=f"grad of {name}")
    for (name, b), (_, c) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        torch.testing.assert_close(c, b, msg=f"buffer {name} after the call")


def test_mlp():
    torch.manual_seed(0)
    report = verify(MLP(), torch.randn(4, 16))
    assert report.compared_grads == 6  # three weights, three biases


def test_mlp_loss():
    torch.manual_seed(0)
    model = MLP()

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).pow(2).mean()

    compare_module(Loss(), torch.randn(4, 16))


@pytest.mark.parametrize("training", [True, False])
def test_conv_batchnorm(training):
    torch.manual_seed(0)
    model = ConvBN().train(training)
    compare_module(model, torch.randn(2, 1, 8, 8), torch.randn(2, 10))


def test_batchnorm_running_stats_are_updated_in_place():
    torch.manual_seed(0)
    model = ConvBN()
    compiled = aotgrad.aot_module(model)
    before = model.bn1.running_mean.clone()
    compiled(torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    assert not torch.equal(model.bn1.running_mean, before)
    assert model.bn1.num_batches_tracked.item() == 1


def test_gpt_with_tied_embedding_matches_eager():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    compare_module(GPT(), idx, targets)


def test_tied_parameters_are_one_input_with_one_summed_gradient():
    torch.manual_seed(0)
    model = GPT()
    traced = aotgrad.trace(model, torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    names = [str(d) for d in traced.signature.forward_inputs]
    assert "param tok.weight" in names and "param head.weight" not in names
    assert names.count("param tok.weight") == 1


def test_pytorch_aot_module_rejects_what_aotgrad_accepts():
    """The reason for the tied-weight guarantee: PyTorch's aot_module fails on this model."""
    torch.manual_seed(0)
    model = GPT()
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="tied"):
        torch_aot_module(copy.deepcopy(model), fw_compiler=aotgrad.nop)(idx, targets).backward()
    aotgrad.aot_module(model)(idx, targets).backward()
    assert model.tok.weight.grad is not None


def lstm_cell(state: State, inputs: dict, scale: float):
    gates = inputs["x"] @ inputs["w_ih"] + state.h @ inputs["w_hh"]
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * state.c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c) * scale
    return {"state": State(h, c), "outputs": [h.sum(), c.mean()], "extra": None}


def test_pytree_inputs_and_outputs():
    torch.manual_seed(0)
    state = State(torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True))
    inputs = {
        "x": torch.randn(3, 4),
        "w_ih": torch.randn(4, 20, requires_grad=True),
        "w_hh": torch.randn(5, 20, requires_grad=True),
    }
    report = verify(lstm_cell, state, inputs, 0.5)
    assert report.compared_outputs == 4 and report.compared_grads == 4
    traced = aotgrad.trace(lstm_cell, state, inputs, scale=0.5)
    assert [str(d) for d in traced.signature.forward_inputs] == [
        "state.h",
        "state.c",
        "inputs['x']",
        "inputs['w_ih']",
        "inputs['w_hh']",
    ]
    assert [str(d) for d in traced.signature.outputs] == [
        "output['state'].h",
        "output['state'].c",
        "output['outputs'][0]",
        "output['outputs'][1]",
    ]


def test_kwargs_and_varargs_are_named_by_parameter():
    def f(x, *rest, bias=None, **extra):
        return x.sum() + sum(r.sum() for r in rest) + bias.sum() + extra["z"].sum()

    ts = [torch.randn(2, requires_grad=True) for _ in range(5)]
    traced = aotgrad.trace(f, ts[0], ts[1], ts[2], bias=ts[3], z=ts[4])
    assert [str(d) for d in traced.signature.forward_inputs] == [
        "x",
        "rest[0]",
        "rest[1]",
        "bias",
        "z",
    ]
    verify(f, ts[0], ts[1], ts[2], bias=ts[3], z=ts[4])


def test_matches_pytorch_aot_function_on_values_and_grads():
    from functorch.compile import aot_function as torch_aot_function

    def f(x, w, b):
        return F.layer_norm(F.gelu(x @ w + b), (w.shape[1],)).tanh().sum(dim=0)

    args = (
        torch.randn(8, 6),
        torch.randn(6, 5, requires_grad=True),
        torch.randn(5, requires_grad=True),
    )
    ours, theirs = clone_inputs(args), clone_inputs(args)
    out_ours = aotgrad.aot_function(f)(*ours)
    out_theirs = torch_aot_function(f, fw_compiler=aotgrad.nop)(*theirs)
    torch.testing.assert_close(out_ours, out_theirs)
    out_ours.sum().backward()
    out_theirs.sum().backward()
    torch.testing.assert_close(ours[1].grad, theirs[1].grad)
    torch.testing.assert_close(ours[2].grad, theirs[2].grad)


CONSTANT = torch.randn(3)


def test_tensors_the_function_closes_over_are_graph_constants():
    def f(x):
        return (x * CONSTANT).sin(), CONSTANT

    verify(f, torch.randn(3, requires_grad=True))
    out = aotgrad.aot_function(f)(torch.randn(3, requires_grad=True))
    assert out[1] is CONSTANT, "eager returns the global itself"


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_layers_whose_kernels_depend_on_grad_mode(cell):
    """mkldnn's RNN drops its backward workspace under no_grad: the forward runs with grad on."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cell(4, 8, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0].sum()

    torch.manual_seed(0)
    verify(Net(), torch.randn(2, 5, 4, requires_grad=True), atol=1e-5, rtol=1e-4)
