"""``torch.compile(..., backend="aotgrad")``: self-describing graphs through Dynamo."""

from __future__ import annotations

import copy
import pathlib
import sys

import torch

import aotgrad
from aotgrad.capture import Phase, node_info
from models import GPT

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from carry import example_inputs, fn  # the seed notebook's fn(carry, x)


def recording():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    return graphs, compiler


def test_descriptors_name_the_users_expressions_not_dynamos_order():
    graphs, compiler = recording()
    (args, _) = example_inputs()
    torch._dynamo.reset()
    out = torch.compile(fn, backend=aotgrad.backend(compiler, compiler))(*args)
    forward = graphs[0]
    names = sorted(str(n.meta["desc"]) for n in forward.graph.nodes if n.op == "placeholder")
    assert names == sorted(["carry['a']", "carry['b']", "x['weights']", "x['biases']"])
    torch.testing.assert_close(out[1], fn(*args)[1])


def test_provenance_holds_through_dynamo():
    graphs, compiler = recording()
    (args, _) = example_inputs()
    torch._dynamo.reset()
    torch.compile(fn, backend=aotgrad.backend(compiler, compiler))(*args)
    forward, backward = graphs
    for gm, phase in ((forward, Phase.FORWARD), (backward, Phase.BACKWARD)):
        for n in gm.graph.nodes:
            if n.op == "call_function" and node_info(n).kind.value == "op":
                info = node_info(n)
                assert info.phase is phase
                assert info.source is not None and info.source.filename.endswith("carry.py")


def test_registered_backend_trains_the_transformer_like_eager():
    torch.manual_seed(0)
    model = GPT(blocks=4, dim=64, heads=4, context=32)
    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    step = torch.compile(compiled_model, backend="aotgrad")
    opt_eager = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    for i in range(3):
        idx, targets = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
        eager = model(idx, targets)
        ours = step(idx, targets)
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5, msg=f"step {i}")
        for opt, loss in ((opt_eager, eager), (opt_ours, ours)):
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_module_parameters_are_named_like_the_user_wrote_them():
    graphs, compiler = recording()
    torch._dynamo.reset()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.fc1(x).relu()

    torch.compile(Net(), backend=aotgrad.backend(compiler, compiler))(torch.randn(2, 3))
    names = {str(n.meta["desc"]) for n in graphs[0].graph.nodes if n.op == "placeholder"}
    assert names == {"self.fc1.weight", "self.fc1.bias", "x"}
    modules = {node_info(n).module for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "fc1" in modules


def test_backend_honors_dynamos_dynamic_dimensions():
    graphs, compiler = recording()
    torch._dynamo.reset()

    def f(x, w):
        return (x @ w).relu().sum()

    compiled = torch.compile(f, backend=aotgrad.backend(compiler, compiler), dynamic=True)
    for batch in (4, 9, 33):
        x, w = torch.randn(batch, 8), torch.randn(8, 3, requires_grad=True)
        out = compiled(x, w)
        out.backward()
        torch.testing.assert_close(out, f(x, w))
        reference = w.detach().requires_grad_()
        f(x, reference).backward()
        torch.testing.assert_close(w.grad, reference.grad)
        # The backend hands its dims to aotgrad (Note [Marking dimensions dynamic]): no marks.
        assert not hasattr(x, "_aotgrad_dynamic_dims")
    assert len(graphs) == 2, "one forward and one backward graph serve every batch size"
    # Symbolic sizes: read with sym_size (torch <= 2.14) or carried by the inputs' shapes (2.15).
    shapes = [n.meta["val"].shape for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert any(isinstance(d, torch.SymInt) for shape in shapes for d in shape)
