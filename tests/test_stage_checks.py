"""Stage checks (Note [Stage checks]): real graphs pass them; a planted breakage is named.

Each planted test builds a valid artifact, breaks one invariant at one stage boundary
(after capture: the JointGraph; after partition: the Partitioned) and checks that the
InvariantError names the stage, the node and the invariant.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import aotgrad
import aotgrad.pipeline
from aotgrad._torch_compat import FakeTensorMode
from aotgrad.api import AOTFunction, Options
from aotgrad.capture.analyses.collectives import COLLECTIVE_KEY
from aotgrad.capture.checks import check_joint
from aotgrad.errors import ConfigError, InvariantError
from aotgrad.partition import Partitioned
from aotgrad.partition.checks import check_partitioned
from aotgrad.partition.saved import describe_saved
from models import GPT, ConvBN

aten = torch.ops.aten


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stages checked, in order, by the frontends' shared capture_and_partition."""
    stages: list[str] = []

    def joint(j):  # type: ignore[no-untyped-def]
        stages.append("capture")
        check_joint(j)

    def partitioned(p):  # type: ignore[no-untyped-def]
        stages.append("partition")
        check_partitioned(p)

    monkeypatch.setattr(aotgrad.pipeline, "check_joint", joint)
    monkeypatch.setattr(aotgrad.pipeline, "check_partitioned", partitioned)
    return stages


def _mutate_and_alias(x, buf):  # type: ignore[no-untyped-def]
    buf.add_(1)
    y = x * 2
    return y.view(-1), y.t(), x.sin()


def _checkpointed(x, w):  # type: ignore[no-untyped-def]
    return cp.checkpoint(lambda a: (a @ w).tanh(), x, use_reentrant=False).sum()


def _cases() -> dict[str, tuple[object, tuple[object, ...]]]:
    torch.manual_seed(0)
    gpt = GPT()
    tokens = torch.randint(0, 64, (2, 8))
    return {
        "gpt": (gpt, (tokens, tokens)),
        "convbn": (ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))),
        "mutation_aliasing": (
            _mutate_and_alias,
            (torch.randn(3, 4, requires_grad=True), torch.zeros(4)),
        ),
        "checkpoint": (
            _checkpointed,
            (torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)),
        ),
    }


@pytest.mark.parametrize("case", ["gpt", "convbn", "mutation_aliasing", "checkpoint"])
def test_real_graphs_pass_the_checks_with_the_environment_variable(
    case: str, counted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fn, args = _cases()[case]
    monkeypatch.setenv("AOTGRAD_CHECKS", "1")
    aotgrad.trace(fn, *args)
    assert counted == ["capture", "partition"]


@pytest.mark.parametrize("case", ["gpt", "mutation_aliasing"])
def test_real_graphs_pass_the_checks_with_check_true(case: str, counted: list[str]) -> None:
    fn, args = _cases()[case]
    compiled = AOTFunction(fn, Options(check=True, partition="mincut"))  # type: ignore[arg-type]
    clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    expected, got = fn(*clone), compiled(*args)  # type: ignore[operator]
    torch.testing.assert_close(got, expected)
    assert counted == ["capture", "partition"]


def test_a_library_model_passes_the_checks(counted: list[str]) -> None:
    library_models = pytest.importorskip("library_models")
    pytest.importorskip("transformers")
    case = library_models.build("bert")
    compiled = AOTFunction(case.model, Options(check=True))
    case.loss(compiled(*case.args, **case.kwargs)).backward()
    assert counted == ["capture", "partition"]


def test_checks_are_off_by_default_and_the_variable_is_read_per_call(
    counted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AOTGRAD_CHECKS", raising=False)
    aotgrad.trace(torch.sin, torch.ones(2, requires_grad=True))
    assert counted == []
    monkeypatch.setenv("AOTGRAD_CHECKS", "on")
    assert Options().check
    monkeypatch.setenv("AOTGRAD_CHECKS", "maybe")
    with pytest.raises(ConfigError, match="AOTGRAD_CHECKS='maybe'"):
        Options()


# --- planted breakages ----------------------------------------------------------------------


def _partitioned() -> Partitioned:
    """``(x @ w).sin().sum()``: saves x, w and mm; valid as captured."""
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    partitioned = aotgrad.trace(lambda x, w: (x @ w).sin().sum(), x, w).partitioned
    check_joint(partitioned.joint)
    check_partitioned(partitioned)
    return partitioned


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _expect(stage: str, node: str, invariant: str) -> pytest.RaisesContext[InvariantError]:
    return pytest.raises(
        InvariantError, match=f"^aotgrad check after {stage}: {node}: {invariant}:"
    )


def _use_before_definition(gm: torch.fx.GraphModule) -> None:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    with gm.graph.inserting_before(calls[0]):
        gm.graph.call_function(aten.neg.default, (calls[-1],))


def _fake_constant(gm: torch.fx.GraphModule) -> str:
    with FakeTensorMode():
        fake = torch.empty(2, 2)
    gm.register_buffer("_planted", fake)
    with gm.graph.inserting_before(gm.graph.output_node()):
        return gm.graph.get_attr("_planted").name


@pytest.mark.parametrize("stage", ["capture", "partition"])
def test_a_graph_that_fails_lint_is_named(stage: str) -> None:
    p = _partitioned()
    gm, name = (p.joint.gm, "joint graph") if stage == "capture" else (p.forward, "forward graph")
    _use_before_definition(gm)
    with _expect(stage, name, "lint"):
        check_joint(p.joint) if stage == "capture" else check_partitioned(p)


def test_a_joint_placeholder_without_descriptor_is_named() -> None:
    p = _partitioned()
    del _node(p.joint.gm, "w").meta["desc"]
    with _expect("capture", "joint graph, placeholder w", "descriptor"):
        check_joint(p.joint)


def test_a_backward_placeholder_without_descriptor_is_named() -> None:
    p = _partitioned()
    del _node(p.backward, "mm").meta["desc"]  # type: ignore[arg-type]
    with _expect("partition", "backward graph, placeholder mm", "descriptor"):
        check_partitioned(p)


def test_joint_placeholders_out_of_the_signatures_order_are_named() -> None:
    p = _partitioned()
    x, w = _node(p.joint.gm, "x"), _node(p.joint.gm, "w")
    x.meta["desc"], w.meta["desc"] = w.meta["desc"], x.meta["desc"]
    with _expect("capture", "joint graph, placeholders", "signature") as error:
        check_joint(p.joint)
    assert "expected input 0 to be Input(path='x'), got Input(path='w')" in str(error.value)


def test_swapped_joint_outputs_are_named() -> None:
    p = _partitioned()
    output = p.joint.gm.graph.output_node()
    descs = output.meta["desc"]
    output.meta["desc"] = [descs[0], descs[2], descs[1]]
    with _expect("capture", "joint graph, output node output", "signature"):
        check_joint(p.joint)


def test_a_forward_missing_a_saved_output_is_named() -> None:
    """Note [Stage checks]'s worked example."""
    p = _partitioned()
    output = p.forward.graph.output_node()
    output.args = (tuple(output.args[0][:-1]),)  # type: ignore[index]
    output.meta["desc"] = output.meta["desc"][:-1]
    with _expect("partition", "forward graph, output node output", "signature") as error:
        check_partitioned(p)
    assert "expected 4 output descriptors, got 3" in str(error.value)


def test_a_saved_value_that_is_not_a_forward_output_is_named() -> None:
    p = _partitioned()
    output = p.forward.graph.output_node()
    *rest, _ = output.args[0]  # type: ignore[misc]
    output.args = ((*rest, _node(p.forward, "sin")),)
    with _expect("partition", "forward graph, output node output", "saved") as error:
        check_partitioned(p)
    assert "['x', 'w', 'mm']" in str(error.value) and "['x', 'w', 'sin']" in str(error.value)


def test_saved_values_out_of_the_backwards_order_are_named() -> None:
    p = _partitioned()
    x, w = _node(p.backward, "x"), _node(p.backward, "w")  # type: ignore[arg-type]
    x.name, w.name = "tmp", "x"
    x.name = "w"
    with _expect("partition", "backward graph, placeholders", "saved"):
        check_partitioned(p)


def test_saved_values_not_in_the_signatures_order_are_named() -> None:
    p = _partitioned()
    reordered = dataclasses.replace(p, saved=(p.saved[1], p.saved[0], p.saved[2]))
    with _expect("partition", "signature", "saved"):
        check_partitioned(reordered)


@pytest.mark.parametrize("stage", ["capture", "partition"])
def test_a_fake_tensor_constant_is_named(stage: str) -> None:
    p = _partitioned()
    if stage == "capture":
        name = _fake_constant(p.joint.gm)
        with _expect("capture", f"joint graph, node {name}", "constant"):
            check_joint(p.joint)
    else:
        name = _fake_constant(p.backward)  # type: ignore[arg-type]
        with _expect("partition", f"backward graph, node {name}", "constant") as error:
            check_partitioned(p)
        assert "FakeTensor (2, 2)" in str(error.value)


def test_a_collective_run_by_two_joint_nodes_is_named() -> None:
    p = _partitioned()
    call = object()
    _node(p.joint.gm, "mm").meta[COLLECTIVE_KEY] = call
    _node(p.joint.gm, "sin").meta[COLLECTIVE_KEY] = call
    with _expect("capture", "joint graph, node sin", "collectives"):
        check_joint(p.joint)


def test_a_collective_run_twice_after_partition_is_named() -> None:
    p = _partitioned()
    for gm in (p.joint.gm, p.forward):
        _node(gm, "sin").meta[COLLECTIVE_KEY] = object()
    backward = p.backward
    assert backward is not None
    first = next(n for n in backward.graph.nodes if n.op == "placeholder")
    with backward.graph.inserting_before(backward.graph.output_node()):
        again = backward.graph.create_node("call_function", aten.sin.default, (first,), name="sin")
    again.meta[COLLECTIVE_KEY] = object()
    assert again.name == "sin"
    with _expect("partition", "backward graph, node sin", "collectives") as error:
        check_partitioned(p)
    assert "sin after sin" in str(error.value)


def test_collectives_out_of_the_joints_order_are_named() -> None:
    p = _partitioned()
    for gm in (p.joint.gm, p.forward):
        _node(gm, "mm").meta[COLLECTIVE_KEY] = object()
    backward = p.backward
    assert backward is not None
    cos = next(n for n in backward.graph.nodes if n.name.startswith("cos"))
    _node(p.joint.gm, cos.name).meta[COLLECTIVE_KEY] = object()
    cos.meta[COLLECTIVE_KEY] = object()
    check_partitioned(p)  # mm, then cos: the joint's order
    _node(p.forward, "sin").meta[COLLECTIVE_KEY] = object()  # not one of the joint's
    with _expect("partition", "forward graph, node sin", "collectives"):
        check_partitioned(p)


def test_a_saved_values_wrong_bytes_are_named() -> None:
    p = _partitioned()
    wrong = dataclasses.replace(p.saved[2], nbytes=1)
    with _expect("partition", "saved value mm", "bytes"):
        check_partitioned(dataclasses.replace(p, saved=(*p.saved[:2], wrong)))


def test_a_partition_whose_bytes_do_not_add_up_is_named() -> None:
    p = _partitioned()
    merged = dataclasses.replace(p.saved[1], storage=p.saved[0].storage)
    with _expect("partition", "saved values", "bytes") as error:
        check_partitioned(dataclasses.replace(p, saved=(p.saved[0], merged, p.saved[2])))
    assert "expected saved_bytes 108" in str(error.value) and "got 72" in str(error.value)


def test_the_message_says_what_to_do() -> None:
    error = InvariantError("partition", "saved value mm", "bytes", "nbytes 36", "1")
    assert str(error).startswith(
        "aotgrad check after partition: saved value mm: bytes: expected nbytes 36, got 1."
    )
    assert "aotgrad bug" in str(error) and "please report it" in str(error)
    assert (error.stage, error.node, error.invariant) == ("partition", "saved value mm", "bytes")


def test_a_conv_model_with_batchnorm_in_training_passes() -> None:
    model = ConvBN()
    compiled = AOTFunction(model, Options(check=True))
    x, target = torch.randn(2, 1, 8, 8), torch.randn(2, 10)
    compiled(x, target).backward()
    assert isinstance(model.bn1, nn.BatchNorm2d) and int(model.bn1.num_batches_tracked) == 1


def test_the_create_graph_backward_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = aotgrad.pipeline

    stages: list[str] = []
    monkeypatch.setattr(pipeline, "check_joint", lambda j: stages.append("capture"))
    monkeypatch.setattr(pipeline, "check_partitioned", lambda p: stages.append("partition"))
    monkeypatch.setenv("AOTGRAD_CHECKS", "1")
    x = torch.randn(3, requires_grad=True)
    traced = aotgrad.trace(lambda x: (x.sin() * x).sum(), x)
    (g,) = torch.autograd.grad(traced(x), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (g_eager,) = torch.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(g_eager.sum(), x)[0])
    assert stages == ["capture", "partition"] * 2  # the trace, then G


def test_a_broken_partition_is_named_through_the_frontend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: a partition whose saved values the backward reads in another order."""
    import aotgrad.partition

    def swapped(*args):  # type: ignore[no-untyped-def]
        saved = describe_saved(*args)
        return (saved[1], saved[0], *saved[2:])

    monkeypatch.setattr(aotgrad.partition, "describe_saved", swapped)
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    compiled = AOTFunction(lambda x, w: (x @ w).sin().sum(), Options())
    compiled(x, w)  # unchecked: nothing notices
    checked = AOTFunction(lambda x, w: (x @ w).sin().sum(), Options(check=True))
    with _expect("partition", "forward graph, output node output", "saved"):
        checked(x, w)
