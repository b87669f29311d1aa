"""The part every backend shares (``aotgrad.backends.base``): program kinds, flat checks and
specs, the refusal of random ops, node descriptions and tensors across NumPy; and that both
backends answer with it (the joint program was a "backward" to ONNX Runtime)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.backends import base
from aotgrad.errors import BackendError, CallError
from aotgrad.ops import backward_ops

pytestmark = pytest.mark.backends

EAGER = base.Backend("eager", "torch", base.NUMPY_DTYPES)


def _programs(model: nn.Module, *args: torch.Tensor, **options):
    return aotgrad.trace(lambda *a: model(*a).sum(), *args).export(flat=True, **options)


def test_program_kinds():
    """Note [Program kinds]: forward, backward and joint by their inputs' descriptors; a
    program aotgrad did not export is "exported"; saved values alone make a backward."""
    lin = nn.Linear(3, 2)
    programs = _programs(lin, torch.ones(4, 3), joint=True)
    assert base.program_kind(programs.forward) == "forward"
    assert base.program_kind(programs.backward) == "backward"
    assert base.program_kind(programs.joint) == "joint"
    assert base.program_kind(torch.export.export(lin, (torch.ones(4, 3),))) == "exported"
    backward = programs.backward
    for node in backward.graph.find_nodes(op="placeholder"):
        node.meta["aotgrad"]["descriptor"] = {"kind": "Saved", "name": node.name}
    assert base.program_kind(backward) == "backward"


@pytest.mark.parametrize("backend", ["onnxruntime", "iree"])
def test_both_backends_name_the_joint_program(backend):
    """Both backends name a program by ``program_kind``: a joint program that keeps dropout
    (random="ops") is refused as "the joint program" (ONNX Runtime called it the backward),
    before compiling."""
    module = importlib.import_module(f"aotgrad.backends.{backend}")
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    programs = _programs(model, torch.randn(4, 8), joint=True, random="ops")
    assert programs.joint is not None
    with pytest.raises(BackendError, match=rf"(?s)^{backend}: the joint program draws random"):
        module.compile_program(programs.joint)
    with pytest.raises(BackendError, match=rf"^{backend}: the forward program draws random"):
        module.compile_program(programs.forward)


def test_specs_of_a_flat_program():
    lin = nn.Linear(3, 2)
    programs = _programs(lin, torch.ones(4, 3))
    inputs, outputs = EAGER.user_specs(programs.backward, "backward")
    assert [(s.shape, s.dtype) for s in inputs] == [((4, 3), torch.float32), ((), torch.float32)]
    assert [(s.shape, s.dtype) for s in outputs] == [((2, 3), torch.float32), ((2,), torch.float32)]
    assert all(s.name for s in (*inputs, *outputs))
    assert str(base.TensorSpec((4, 3), torch.float32, "x")) == "x: float32[4, 3]"
    assert str(base.TensorSpec((), torch.int64)) == "int64[]"


def test_not_flat_refused():
    """A program with parameters and mutations in its signature names them."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    programs = aotgrad.trace(model, torch.randn(4, 3)).export()
    with pytest.raises(
        BackendError,
        match=r"eager: the forward program .*PARAMETER 0\.weight.*BUFFER_MUTATION.*flat=True",
    ):
        EAGER.user_specs(programs.forward, "forward")


def test_dtype_the_backend_does_not_pass_refused():
    programs = aotgrad.trace(lambda x: x.float().sum(), torch.ones(2).bfloat16()).export(flat=True)
    with pytest.raises(BackendError, match=r"input x\w* is a torch.bfloat16 tensor.*float32"):
        EAGER.user_specs(programs.forward, "forward")
    with_bf16 = base.Backend("b", "B", {**base.NUMPY_DTYPES, torch.bfloat16: object})
    inputs, _ = with_bf16.user_specs(programs.forward, "forward")
    assert inputs[0].dtype == torch.bfloat16


def _dropout_program():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    return _programs(model, torch.randn(4, 8), random="ops").forward


def test_random_ops_refused_with_the_users_line():
    """Note [Backends and random ops]: the op, the user's line and module, what to do."""
    with pytest.raises(BackendError) as error:
        EAGER.refuse(_dropout_program(), "forward")
    message = str(error.value)
    assert message.startswith("eager: the forward program draws random numbers, which torch")
    assert "test_backend_base.py" in message and "(module model.1)" in message
    assert "export(flat=True, random='inputs')" in message


def test_refusals_gathered_in_one_error():
    """A backend's own check and the random ops: one error, one line each; a check that
    finds nothing adds nothing; no problem, no error."""
    program = _dropout_program()
    EAGER.refuse(_programs(nn.Linear(2, 2), torch.ones(1, 2)).forward, "forward", lambda p: None)
    with pytest.raises(BackendError) as error:
        EAGER.refuse(program, "forward", lambda p: None, lambda p: "calls ops it lacks")
    lines = str(error.value).splitlines()
    assert lines[0] == "eager: the forward program cannot run in torch as it runs in torch:"
    assert lines[1].startswith("- it draws random numbers, which torch cannot draw as torch")
    assert str(error.value).endswith("\n- it calls ops it lacks")


def test_node_descriptions():
    """Lines for a list (``describe``), a phrase for a sentence (``ops_at``), each with the
    user's line and module; a rewritten node named by the op the user wrote."""
    program = _dropout_program()
    nodes = [n for n in base.calls(program) if n.target == torch.ops.aten.addmm.default]
    line = base.describe(nodes)
    assert line.startswith("  aten.addmm.default at ") and "test_backend_base.py:" in line
    assert line.endswith("(module model.0)")
    assert base.describe(nodes * 2) == line  # one line per op and place
    phrase = EAGER.ops_at(nodes)
    assert phrase.startswith(f"aten.addmm.default (node {nodes[0].name}, model.0, at ")
    nodes[0].meta[base.REWRITE_OF] = "aten.linear.default"
    assert EAGER.ops_at(nodes).startswith(
        f"aten.linear.default (node {nodes[0].name}, rewritten for torch as aten.addmm.default"
    )


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.arange(6, dtype=torch.int64),
        torch.tensor([True, False]),
        torch.randn(3, 2).bfloat16(),
        torch.tensor(1.5, dtype=torch.float16),
    ],
    ids=["transposed", "int64", "bool", "bfloat16", "float16_0d"],
)
def test_numpy_round_trip(tensor):
    """A tensor crosses NumPy and back with its values, shape and dtype (bfloat16 as
    ml_dtypes' type, its bits unchanged)."""
    array = base.to_numpy(tensor)
    assert array.flags["C_CONTIGUOUS"] and array.shape == tuple(tensor.shape)
    back = base.from_numpy(array, tensor.dtype)
    assert back.dtype == tensor.dtype
    torch.testing.assert_close(back, tensor, rtol=0, atol=0)


def test_decompose_with_a_backends_own_ops():
    """``backward_ops.decompose`` applies a backend's own decompositions beside the shared
    ones in the same pass, only where the program has the op."""
    program = _programs(nn.Linear(3, 2), torch.ones(4, 3)).forward
    as_mm = {torch.ops.aten.addmm.default: lambda b, x, w: torch.mm(x, w) + b}
    decomposed = backward_ops.decompose(program, {**backward_ops.AS_FORWARD_OPS, **as_mm})
    targets = {n.target for n in base.calls(decomposed)}
    assert torch.ops.aten.addmm.default not in targets and torch.ops.aten.mm.default in targets
    absent = {torch.ops.aten.sin.default: torch.cos}
    assert backward_ops.decompose(program, absent) is program


def test_compiled_program_checks_counts():
    """A call with too few inputs is the caller's error, naming what the program takes; a
    backend returning another number of results is the backend's."""
    specs = [base.TensorSpec((4, 3), torch.float32, "x"), base.TensorSpec((), torch.float32)]
    program = base.CompiledProgram(EAGER, "backward", specs, specs[:1])
    program.check_inputs([torch.ones(4, 3), torch.ones(())])
    with pytest.raises(
        CallError,
        match=r"^the backward program compiled by torch takes 2 input tensor\(s\), got 1; it"
        r" takes x: float32\[4, 3\], float32\[\]$",
    ):
        program.check_inputs([torch.ones(4, 3)])
    program.check_results([torch.ones(4, 3)])
    with pytest.raises(BackendError, match=r"^torch's backward program returned 2 value\(s\)"):
        program.check_results([torch.ones(4, 3)] * 2)
