"""Traced.export / AOTFunction.export: torch.export programs of the graphs (docs/export.md)."""

from __future__ import annotations

import copy
import operator
import os
import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

import aotgrad
from aotgrad.errors import CallError, ConfigError, UnsupportedOpError
from aotgrad.ops.core_aten import is_core
from aotgrad.signature.descriptors import Draw, Grad, Input, Output, Saved
from models import GPT, MLP, Block, ConvBN


class WithLoss(torch.nn.Module):
    """``loss(model(*args, **kwargs))`` as one module, so the graphs compute the loss."""

    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *args, **kwargs):
        return self.loss(self.model(*args, **kwargs))


def _round_trip(program, path):
    torch.export.save(program, path)
    return torch.export.load(path)


def _backward_inputs(programs, backward, outputs):
    """The backward's inputs: the saved values, found among the forward's ``outputs`` by
    descriptor, then the cotangents (ones for the first output, the loss; zeros for others)."""
    assert isinstance(programs.forward_outputs[0], Output)
    by_desc = dict(zip(programs.forward_outputs, outputs, strict=True))
    inputs = []
    placeholders = backward.graph.find_nodes(op="placeholder")
    for desc, node in zip(programs.backward_inputs, placeholders, strict=True):
        if isinstance(desc, Saved):
            inputs.append(by_desc[desc])
        else:
            one = desc.of == programs.forward_outputs[0]
            shape = node.meta["val"].shape
            inputs.append(torch.ones(shape) if one else torch.zeros(shape))
    return inputs


def check_export(
    model,
    args,
    kwargs,
    tmp_path,
    rtol=1e-4,
    atol=1e-5,
    decompositions=None,
    random=None,
    **options,
):
    """Export ``model``'s graphs (with ``decompositions`` and ``random``, if given), save and
    load them, run both on the inputs and compare the loss, the buffers after the step and
    every gradient with eager's (both seeded alike: dropout draws eager's masks, in the
    programs or, with random="inputs", by the saved and loaded draw program)."""
    eager, traced_model = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1234)
    expected = eager(*args, **kwargs)
    expected.backward()
    traced = aotgrad.trace(traced_model, *args, **kwargs, **options)
    programs = traced.export(joint=True, decompositions=decompositions, random=random)
    forward = _round_trip(programs.forward, tmp_path / "forward.pt2")
    backward = _round_trip(programs.backward, tmp_path / "backward.pt2")
    draw = _drawing(programs, tmp_path)
    signature = traced.signature

    # Which input is which: parameters and buffers by name, then the user's tensors.
    specs = forward.graph_signature.input_specs
    names = [str(d) for d in signature.forward_inputs]
    # The draws come next (USER_INPUTs: Note [Random draws as inputs]); tensors the graph made
    # at capture (torch.tensor(...) in the model) are lifted last.
    n_draws = sum(isinstance(d, Draw) for d in programs.forward_inputs)
    drawn = specs[len(names) : len(names) + n_draws]
    assert all(s.kind == InputKind.USER_INPUT for s in drawn)
    assert all(s.kind == InputKind.CONSTANT_TENSOR for s in specs[len(names) + n_draws :])
    for spec, desc in zip(specs[: len(names)], names, strict=True):
        if spec.kind == InputKind.PARAMETER:
            assert desc == f"param {spec.target}"
            assert forward.state_dict[spec.target] is not None
        elif spec.kind == InputKind.BUFFER:
            assert desc == f"buffer {spec.target}"
    params = dict(traced_model.named_parameters())
    assert {s.target for s in specs if s.kind == InputKind.PARAMETER} == set(params)

    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [leaves[i] for i in traced.partitioned.joint.inputs.tensor_positions]
    module = forward.module()
    torch.manual_seed(1234)
    outputs = module(*tensors, *draw())
    torch.testing.assert_close(outputs[0], expected.detach(), rtol=rtol, atol=atol)
    # Mutated buffers (BatchNorm's running statistics) are written into the module.
    got_buffers = dict(module.named_buffers())
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(got_buffers[name], buffer, rtol=rtol, atol=atol, msg=name)

    # The backward: saved values (named among the forward's outputs) and cotangents (ones
    # for the loss) -> gradients.
    grads = backward.module()(*_backward_inputs(programs, backward, outputs))
    out_specs = backward.graph_signature.output_specs
    assert len(grads) == len(out_specs) == len(programs.backward_outputs)
    got = {}
    for spec, grad, desc in zip(out_specs, grads, programs.backward_outputs, strict=True):
        assert spec.kind == OutputKind.GRADIENT_TO_PARAMETER
        assert str(desc) == f"grad of param {spec.target}"
        got[spec.target] = grad
    expected_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert got.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=atol, msg=name)

    # The joint: (*user inputs, cotangent of the loss) -> (loss, *gradients).
    joint = _round_trip(programs.joint, tmp_path / "joint.pt2")
    torch.manual_seed(1234)
    joint_outputs = joint.module()(*tensors, torch.ones(()), *draw())
    results = dict(zip(programs.joint_outputs, joint_outputs, strict=True))
    torch.testing.assert_close(
        results[programs.forward_outputs[0]], expected.detach(), rtol=rtol, atol=atol
    )
    joint_grads = {d.of.name: g for d, g in results.items() if isinstance(d, Grad)}
    assert joint_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(joint_grads[name], grad, rtol=rtol, atol=atol, msg=name)

    # Provenance survives the file: seq_nr, module and source of each forward op.
    ops = [n for n in forward.graph.nodes if n.op == "call_function"]
    info = [n.meta["custom"]["aotgrad"] for n in ops]
    assert all(i["seq_nr"] is not None for i in info if i["kind"] == "op")
    assert any(i["module"] and i["source"] for i in info)
    # Placeholders are named by the signature in the file; in memory they carry descriptors.
    first = next(iter(programs.forward.graph.find_nodes(op="placeholder")))
    assert first.meta["aotgrad"]["descriptor"]["kind"] == "Param"
    return programs


def _drawing(programs, tmp_path):
    """What makes the programs' draws: their draw program saved and loaded, run by torch."""
    if programs.draws is None:
        assert not any(isinstance(d, Draw) for d in programs.forward_inputs)
        return tuple
    module = _round_trip(programs.draws, tmp_path / "draws.pt2").module()
    return lambda: module()


def test_export_mlp(tmp_path):
    torch.manual_seed(0)
    model = WithLoss(MLP(), lambda y: y.pow(2).mean())
    check_export(model, (torch.randn(4, 16),), {}, tmp_path)


def test_export_convbn_mutated_buffers(tmp_path):
    torch.manual_seed(0)
    programs = check_export(ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10)), {}, tmp_path)
    mutated = programs.forward.graph_signature.buffers_to_mutate.values()
    assert set(mutated) == {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"}


def test_export_gpt_tied_weights(tmp_path):
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    programs = check_export(GPT(), (idx, targets), {}, tmp_path)
    assert "head.weight" not in programs.forward.state_dict  # one tensor, one name
    assert "tok.weight" in programs.forward.state_dict


def test_export_user_input_gradient_and_function(tmp_path):
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 3)
    f = aotgrad.aot_function(lambda x, w: (x @ w).sin().sum())
    with pytest.raises(CallError, match="call the compiled function first"):
        f.export()
    f(x, w)
    programs = f.export()
    backward = _round_trip(programs.backward, tmp_path / "b.pt2")
    (spec,) = backward.graph_signature.output_specs
    assert spec.kind == OutputKind.USER_OUTPUT
    assert programs.backward_outputs == (Grad(of=Input(path="w")),)
    outputs = _round_trip(programs.forward, tmp_path / "f.pt2").module()(x, w)
    (grad,) = backward.module()(*_backward_inputs(programs, backward, outputs))
    expected = torch.func.grad(lambda w: (x @ w).sin().sum())(w)
    torch.testing.assert_close(grad, expected)
    # In the joint, w is a placeholder of the same graph: GRADIENT_TO_USER_INPUT, by name.
    joint = _round_trip(f.export(joint=True).joint, tmp_path / "j.pt2")
    (_, spec) = joint.graph_signature.output_specs
    assert spec.kind == OutputKind.GRADIENT_TO_USER_INPUT and spec.target == "w"
    _, joint_grad = joint.module()(x, w, torch.ones(()))
    torch.testing.assert_close(joint_grad, expected)


def test_export_inputs_sharing_memory(tmp_path):
    """Two overlapping views, one mutated: the programs take their synthetic base (Note
    [Aliased inputs]), write its new value back and return its gradient."""

    def f(a, b):
        a.mul_(2)
        return (a * b).sin().sum()

    def make():
        torch.manual_seed(0)
        p = torch.randn(12, requires_grad=True)
        root = p * 1
        return p, root, root[0:6].view(2, 3), root[3:9].view(2, 3)

    p, root, a, b = make()
    programs = aotgrad.trace(f, a, b).export()
    expected = f(a, b)
    expected.backward()
    forward = _round_trip(programs.forward, tmp_path / "f.pt2")
    backward = _round_trip(programs.backward, tmp_path / "b.pt2")
    (spec,) = [s for s in forward.graph_signature.input_specs]
    assert spec.kind == InputKind.USER_INPUT and spec.arg.name == "base_of_a_b"
    (mutation,) = forward.graph_signature.user_inputs_to_mutate.values()
    assert mutation == "base_of_a_b"

    _, root2, _, _ = make()
    n = next(iter(forward.graph.find_nodes(op="placeholder"))).meta["val"].numel()
    base = root2.detach().as_strided((n,), (1,), 0)  # the storage up to the farthest view
    outputs = forward.module()(base)
    torch.testing.assert_close(outputs[0], expected.detach())
    torch.testing.assert_close(root2.detach(), root.detach())  # a's mul_ written back
    (grad,) = backward.module()(*_backward_inputs(programs, backward, outputs))
    (out_spec,) = backward.graph_signature.output_specs
    assert out_spec.kind == OutputKind.USER_OUTPUT
    assert str(programs.backward_outputs[0]) == "grad of base of a, b"
    torch.testing.assert_close(grad, p.grad[:n])


def test_export_closed_over_tensor(tmp_path):
    """A closed-over tensor is a constant of the program; its gradient a named output."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3)
    programs = aotgrad.trace(lambda x: (x * w).sin().sum(), x).export()
    forward = _round_trip(programs.forward, tmp_path / "f.pt2")
    backward = _round_trip(programs.backward, tmp_path / "b.pt2")
    (spec,) = [s for s in forward.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
    assert spec.kind == InputKind.CONSTANT_TENSOR and spec.target == "aotgrad_w"
    torch.testing.assert_close(forward.constants["aotgrad_w"], w.detach())
    outputs = forward.module()(x)
    torch.testing.assert_close(outputs[0], (x * w).sin().sum().detach())
    (grad,) = backward.module()(*_backward_inputs(programs, backward, outputs))
    assert str(programs.backward_outputs[0]) == "grad of closure w"
    torch.testing.assert_close(grad, torch.func.grad(lambda w: (x * w).sin().sum())(w))


def test_export_refuses_mutated_closure():
    w = torch.zeros(3)
    traced = aotgrad.trace(lambda x: w.add_(x).sum(), torch.randn(3, requires_grad=True))
    with pytest.raises(CallError, match="new value of closure w"):
        traced.export()


def test_export_refuses_tensor_subclass_inputs():
    from subclasses import two

    x = two(torch.randn(3), torch.randn(3), requires_grad=True)
    traced = aotgrad.trace(lambda x: (x * 2).sum(), x)
    with pytest.raises(CallError, match=r"graph input x\.a \(Inner\)"):
        traced.export()


def test_export_refuses_symbolic_sizes():
    traced = aotgrad.trace(torch.nn.Linear(3, 2), torch.randn(4, 3), dynamic=True)
    with pytest.raises(CallError, match="static sizes"):
        traced.export()


def test_export_refuses_state_changed_since_the_call():
    model = torch.nn.Linear(3, 2)
    compiled = aotgrad.aot_module(model)
    compiled(torch.randn(4, 3))
    model.weight = torch.nn.Parameter(torch.randn(5, 3))  # same name, another size
    with pytest.raises(CallError, match=r"param weight of size \(2, 3\)"):
        compiled.export()


def test_export_names_the_environment_read(monkeypatch):
    """The programs hold what the function did with the variables it read: they are named."""
    monkeypatch.setenv("AOTGRAD_TEST_EXPORT_ACT", "relu")

    def f(x):
        if os.environ.get("AOTGRAD_TEST_EXPORT_ACT") == "relu":
            return torch.relu(x)
        return torch.sigmoid(x)

    programs = aotgrad.trace(f, torch.randn(3, requires_grad=True)).export()
    assert programs.environment == (("AOTGRAD_TEST_EXPORT_ACT", "relu"),)

    def g(x):
        return x * len(dict(os.environ))

    with pytest.raises(CallError, match="whole environment"):
        aotgrad.trace(g, torch.randn(3, requires_grad=True)).export()


def test_export_aot_module(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    compiled = aotgrad.aot_module(model)
    x = torch.randn(4, 3)
    compiled(x).sum().backward()
    forward = _round_trip(compiled.export().forward, tmp_path / "f.pt2")
    torch.testing.assert_close(forward.module()(x)[0], model(x))


class ScaledByConstant(torch.nn.Module):
    """``torch.tensor(...)`` in forward: a tensor the graph holds as an attribute."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return (self.lin(x) * torch.tensor([1.0, 2.0])).sum()


def test_export_tensor_made_in_forward(tmp_path):
    torch.manual_seed(0)
    programs = check_export(ScaledByConstant(), (torch.randn(4, 3),), {}, tmp_path)
    (constant,) = programs.forward.constants.values()
    torch.testing.assert_close(constant, torch.tensor([1.0, 2.0]))


def test_export_dropout_draws_eager_masks(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4), torch.nn.Dropout(0.3)
    )
    check_export(WithLoss(mlp, lambda y: y.pow(2).sum()), (torch.randn(4, 8),), {}, tmp_path)


@pytest.mark.parametrize(
    ("name", "dropout"), [("gpt2", 0.0), ("gpt2", 0.1), ("llama", 0.0), ("resnet18", 0.0)]
)
def test_export_library_models(name, dropout, tmp_path):
    library_models = pytest.importorskip("library_models")
    case = getattr(library_models, name)(dropout)
    check_export(WithLoss(case.model, case.loss), case.args, case.kwargs, tmp_path)


@pytest.mark.parametrize("name", ["convbn", "gpt"])
def test_export_core_aten_programs(name, tmp_path):
    """Items 1 and 2 together: a trace with decompositions="core_aten" exports programs whose
    every op is Core ATen (the backends' opset), and they still run equal to eager."""
    torch.manual_seed(0)
    if name == "convbn":
        model, args = ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    else:
        model, args = GPT(), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    programs = check_export(model, args, {}, tmp_path, decompositions="core_aten")
    for program in (programs.forward, programs.backward):
        ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
        other = {op for op in ops if op is not operator.getitem and torch.Tag.core not in op.tags}
        assert not other, f"not Core ATen: {sorted(map(str, other))}"


def test_one_decoder_layer_exported_and_run_in_a_loop(tmp_path):
    """Issue 31's notebook case end to end: scan_layers captures one layer of a stack once
    (Core ATen), its body's forward and backward export as one layer's programs, and a loop
    that runs only the loaded programs (forward over the layers, backward in reverse) gives
    eager's output and every layer's gradients."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Block(16, 2) for _ in range(3))
    x = torch.randn(2, 8, 16)
    aotgrad.scan_layers(layers, x.requires_grad_(), decompositions="core_aten").sum().backward()
    body = aotgrad.scan_layers_function(layers, decompositions="core_aten")
    assert body.captures == 1
    programs = body.traced.export()
    forward = _round_trip(programs.forward, tmp_path / "layer_forward.pt2").module()
    backward = _round_trip(programs.backward, tmp_path / "layer_backward.pt2").module()
    inputs = [str(d) for d in body.traced.signature.forward_inputs]  # carry, x['ln1.weight'], ...
    assert inputs[0] == "carry"
    names = [re.fullmatch(r"x\['(.+)'\]", d)[1] for d in inputs[1:]]  # type: ignore[index]
    kinds = [type(d).__name__ for d in programs.forward_outputs]
    assert kinds[0] == "Output" and set(kinds[1:]) == {"Saved"}

    with torch.no_grad():  # the backend's loop: the programs alone
        carry, saved = x.detach(), []
        for layer in layers:
            params = dict(layer.named_parameters())
            carry, *values = forward(carry, *[params[n] for n in names])
            saved.append(values)
        out = carry
        grad, grads = torch.ones_like(out), []  # d(out.sum())/d(out)
        for values in reversed(saved):
            grad, *param_grads = backward(*values, grad)
            grads.append(param_grads)
        grads.reverse()

    eager_out = x.detach().clone().requires_grad_()
    expected = eager_out
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    for layer in layers:
        expected = layer(expected)
    expected.sum().backward()
    torch.testing.assert_close(out, expected.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, eager_out.grad, rtol=1e-4, atol=1e-5)
    for layer, param_grads in zip(layers, grads, strict=True):
        params = dict(layer.named_parameters())
        for name, g in zip(names, param_grads, strict=True):
            torch.testing.assert_close(g, params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def _not_core(program):
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    return sorted(str(op) for op in ops if not is_core(op))


def _check_core_programs(programs):
    """Every op of every program is Core ATen, and every op node keeps its provenance."""
    for program in (programs.forward, programs.backward, programs.joint):
        if program is None:
            continue
        assert not _not_core(program), f"not Core ATen: {_not_core(program)}"
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                info = node.meta["custom"]["aotgrad"]  # accumulations have no seq_nr
                assert info["kind"] != "op" or info["seq_nr"] is not None, node.name
                assert info["phase"] and info["module"], node.name


def _double(t):
    return t.double() if t.is_floating_point() else t


@pytest.mark.parametrize("name", ["convbn", "gpt"])
def test_export_decomposes_a_default_trace(name, tmp_path):
    """export(decompositions="core_aten") of a trace captured with the default table: every
    op of the forward, backward and joint programs is Core ATen, each keeps the provenance of
    the op it decomposes, and the programs still run equal to eager."""
    torch.manual_seed(0)
    if name == "convbn":
        model, args = ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    else:
        model, args = GPT(), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    default = aotgrad.trace(copy.deepcopy(model), *args).export(joint=True)
    assert _not_core(default.forward) or _not_core(default.backward)  # there is work to do
    programs = check_export(model, args, {}, tmp_path, decompositions="core_aten")
    _check_core_programs(programs)


def test_export_decomposition_keeps_provenance_and_signature():
    """silu -> sigmoid, mul in the forward, silu_backward -> sigmoid, ... in the backward:
    each new node has the seq_nr, module and source line of the op it came from, and the
    placeholders keep their names and descriptors."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.act = torch.nn.SiLU()

        def forward(self, x):
            return self.act(self.fc(x)).sum()

    x = torch.randn(3, 4)
    traced = aotgrad.trace(Net(), x)
    default, core = traced.export(), traced.export(decompositions="core_aten")
    for before, after in ((default.forward, core.forward), (default.backward, core.backward)):
        silu = [n for n in before.graph.nodes if "silu" in str(n.target)]
        (original,) = silu
        want = {k: original.meta["aotgrad"][k] for k in ("seq_nr", "module", "source", "phase")}
        # The nodes silu's decomposition made (sigmoid and mul on torch 2.13; other torch
        # releases decompose it into other core ops): those of its seq_nr.
        decomposed = [
            n
            for n in after.graph.nodes
            if n.op == "call_function"
            and n.meta["custom"]["aotgrad"].get("seq_nr") == want["seq_nr"]
        ]
        assert len(decomposed) > 1 and not [n for n in after.graph.nodes if "silu" in str(n.target)]
        assert want["module"] == "act" and want["source"]["code"].startswith("return self.act")
        for node in decomposed:
            got = {k: node.meta["custom"]["aotgrad"][k] for k in want}
            assert got == want
        names = [n.name for n in before.graph.find_nodes(op="placeholder")]
        assert [n.name for n in after.graph.find_nodes(op="placeholder")] == names
        assert after.graph_signature.input_specs == before.graph_signature.input_specs
    assert core.forward_outputs == default.forward_outputs
    assert core.backward_outputs == default.backward_outputs
    expected = traced(x)
    torch.testing.assert_close(core.forward.module()(x)[0], expected)


def test_export_decomposition_flat(tmp_path):
    """flat=True with decompositions: pure functions of tensors, in Core ATen, equal to eager."""
    torch.manual_seed(0)
    model = WithLoss(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU()), lambda y: y.sum())
    x = torch.randn(3, 4)
    programs = aotgrad.trace(model, x).export(flat=True, decompositions="core_aten")
    _check_core_programs(programs)
    forward = _round_trip(programs.forward, tmp_path / "f.pt2").module()
    backward = _round_trip(programs.backward, tmp_path / "b.pt2").module()
    loss, *saved = forward(*programs.lifted, x)
    grads = backward(*saved, torch.ones(()))
    expected = model(x)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for grad, param in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad)


def test_export_of_a_core_aten_trace_is_not_traced_again(monkeypatch):
    """A trace captured with the same set needs nothing: the graphs are exported as they are."""
    import aotgrad.export

    def refuse(*args, **kwargs):
        raise AssertionError("decomposed a graph that was Core ATen already")

    monkeypatch.setattr(aotgrad.export, "decompose_graph", refuse)
    x = torch.randn(3, 4, requires_grad=True)
    traced = aotgrad.trace(torch.nn.functional.silu, x, decompositions="core_aten")
    programs = traced.export(joint=True, decompositions="core_aten")
    assert programs.forward.graph_module.code == traced.export().forward.graph_module.code


def test_export_decompositions_bad_name_or_table():
    traced = aotgrad.trace(torch.sin, torch.randn(3, requires_grad=True))
    with pytest.raises(ConfigError, match="'core' is not a decomposition set"):
        traced.export(decompositions="core")
    with pytest.raises(ConfigError, match=r"not torch\.ops\.aten\.silu\)"):
        traced.export(decompositions={torch.ops.aten.sin: torch.cos})
    with pytest.raises(ConfigError, match="takes None, 'core_aten'"):
        traced.export(decompositions=["core_aten"])
    with pytest.raises(ConfigError, match="to function"):
        traced.export(decompositions={torch.ops.aten.sin.default: "cos"})


def test_export_decomposition_dict_table(tmp_path):
    """A dict table decomposes what it names, and nothing else; random ops keep eager's draws:
    native_dropout's decomposition (rand_like < p) draws other numbers, so it is not used."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = get_decompositions([aten.silu, aten.silu_backward, aten.native_dropout])
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Dropout(0.5))
    model = WithLoss(mlp, lambda y: y.pow(2).sum())
    programs = check_export(model, (torch.randn(4, 8),), {}, tmp_path, decompositions=table)
    for program in (programs.forward, programs.backward, programs.joint):
        targets = {n.target for n in program.graph.nodes}
        assert not targets & {aten.silu.default, aten.silu_backward.default}


def test_export_core_aten_with_random_ops_kept_is_refused():
    """CPU dropout draws with bernoulli (not Core ATen); its decomposition would draw other
    numbers, so with the random ops kept in the programs (random="ops") the export is refused,
    naming the op, why, and the option that takes its draws out (tests/test_random_draws.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    traced = aotgrad.trace(model, torch.randn(2, 4))
    match = r"(?s)exported graph.*bernoulli.*a random op.*random='inputs'"
    with pytest.raises(UnsupportedOpError, match=match):
        traced.export(decompositions="core_aten", random="ops")
    assert not _not_core(traced.export(decompositions="core_aten").forward)


def test_export_decompositions_on_every_frontend(tmp_path):
    """aot_function and aot_module take decompositions= on export too."""
    x = torch.randn(3, 4, requires_grad=True)
    f = aotgrad.aot_function(lambda x: torch.nn.functional.silu(x).sum())
    f(x)
    assert not _not_core(f.export(decompositions="core_aten").backward)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.SiLU())
    compiled = aotgrad.aot_module(model)
    compiled(x).sum().backward()
    programs = compiled.export(decompositions="core_aten")
    _check_core_programs(programs)
    forward = _round_trip(programs.forward, tmp_path / "f.pt2")
    torch.testing.assert_close(forward.module()(x)[0], model(x))


# torch 2.11 and 2.12's meta function of CPU flash attention types its logsumexp float32 for a
# float64 query (the kernel returns float64): the graphs captured there hold float32, the
# decomposition computes the kernel's float64, and export refuses the mismatch (ConfigError).
_OLD_ATTENTION_META = pytest.mark.xfail(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch < 2.13: CPU flash attention's meta logsumexp dtype differs from its kernel's",
    raises=aotgrad.ConfigError,
    strict=True,
)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=_OLD_ATTENTION_META), "resnet18"])
def test_export_library_models_decomposed(name, tmp_path):
    """Library models traced with the default table, exported in Core ATen, in float64 (as
    tests/test_core_aten.py compares: decomposed ops round differently from eager's
    kernels, and resnet18's BatchNorm over 1x1 maps amplifies that in float32)."""
    library_models = pytest.importorskip("library_models")
    case = library_models.build(name)
    model = WithLoss(case.model.double(), case.loss)
    args = pytree.tree_map_only(torch.Tensor, _double, case.args)
    kwargs = pytree.tree_map_only(torch.Tensor, _double, case.kwargs)
    programs = check_export(model, args, kwargs, tmp_path, decompositions="core_aten")
    _check_core_programs(programs)


class SiluScaledByConstant(ScaledByConstant):
    def forward(self, x):
        return (torch.nn.functional.silu(self.lin(x)) * torch.tensor([1.0, 2.0])).sum()


def test_export_decomposition_keeps_tensors_made_in_forward(tmp_path):
    """A graph holding a tensor made at capture, decomposed: the tensor is still lifted to
    a CONSTANT_TENSOR of the programs."""
    torch.manual_seed(0)
    model, args = SiluScaledByConstant(), (torch.randn(4, 3),)
    programs = check_export(model, args, {}, tmp_path, decompositions="core_aten")
    _check_core_programs(programs)
    (constant,) = programs.forward.constants.values()
    torch.testing.assert_close(constant, torch.tensor([1.0, 2.0]))


def test_export_decomposition_table_that_changes_a_shape_is_refused():
    """A dict entry whose function does not compute its op is named, not exported."""
    aten = torch.ops.aten
    traced = aotgrad.trace(lambda x: torch.nn.functional.silu(x).sum(), torch.randn(3, 4))
    wrong = {aten.silu.default: lambda x: x.sum(0)}
    with pytest.raises(ConfigError, match=r"aten\.silu\.default in the table gives a tensor of"):
        traced.export(decompositions=wrong)


def test_export_decomposition_keeps_reseeding_and_draws(tmp_path):
    """torch.manual_seed in the function is an op of the forward (Note [Reseeding inside the
    function]): the decomposed forward still reseeds, then draws eager's mask."""
    table = {
        torch.ops.aten.silu.default: torch._decomp.decomposition_table[torch.ops.aten.silu.default]
    }

    def f(x):
        torch.manual_seed(7)
        return torch.nn.functional.dropout(torch.nn.functional.silu(x), 0.5)

    x = torch.randn(4, 4)
    programs = aotgrad.trace(f, x).export(decompositions=table)
    forward = programs.forward.module()
    torch.manual_seed(0)
    (got,) = forward(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, f(x))
    targets = [str(n.target) for n in programs.forward.graph.nodes]
    assert "aotgrad.manual_seed.default" in targets and "aten.silu.default" not in targets


def test_export_decomposition_refuses_symbolic_sizes():
    traced = aotgrad.trace(torch.nn.SiLU(), torch.randn(4, 3, requires_grad=True), dynamic=True)
    with pytest.raises(CallError, match="static sizes"):
        traced.export(decompositions="core_aten")
