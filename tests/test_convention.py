"""The calling convention: layout, descriptors, printing, JSON, re-tracing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.fx as fx

import aotgrad
from aotgrad.partition import partition
from aotgrad.runtime.function import Plan
from aotgrad.signature import (
    SIGNATURE_VERSION,
    Cotangent,
    Grad,
    Input,
    MutatedInput,
    Output,
    OutputBase,
    Saved,
    Signature,
)


def f(x, w):
    return (x @ w).sin()


def traced_f():
    return aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4, requires_grad=True))


def test_layout_of_forward_and_backward():
    sig = traced_f().signature
    assert sig.version == SIGNATURE_VERSION
    assert sig.forward_inputs == (Input("x"), Input("w"))
    assert sig.forward_outputs[0] == Output("")
    assert all(isinstance(d, Saved) for d in sig.forward_outputs[1:])
    assert sig.backward_inputs[: len(sig.saved)] == sig.saved
    assert sig.backward_inputs[len(sig.saved) :] == (Cotangent(Output("")),)
    assert sig.backward_outputs == (None, Grad(Input("w")))
    assert sig.saved == (Saved("x"), Saved("mm")), "forward order: the input first"


def test_descriptors_print_as_comments_and_sit_on_node_meta():
    traced = traced_f()
    code = traced.forward.code
    assert "x,  # x" in code and "w,  # w" in code
    assert "# saved: " in code
    assert "# grad of w" in traced.backward.code
    assert "# cotangent of output" in traced.backward.code
    placeholder = next(n for n in traced.forward.graph.nodes if n.op == "placeholder")
    assert placeholder.meta["desc"] == Input("x")


def test_graphs_run_as_plain_python_with_the_convention():
    traced = traced_f()
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    out, *saved = traced.forward(x, w)
    torch.testing.assert_close(out, f(x, w))
    (grad_x, grad_w) = traced.backward(*saved, torch.ones(2, 4))
    assert grad_x is None
    torch.testing.assert_close(grad_w, x.t() @ (x @ w).cos())


def test_every_joint_node_is_marked_forward_or_backward():
    from aotgrad.capture import Phase, phase_of

    traced = traced_f()
    phases = {phase_of(n) for n in traced.joint.graph.nodes if n.op != "output"}
    assert phases == {Phase.FORWARD, Phase.BACKWARD}
    for n in traced.forward.graph.nodes:
        if n.op == "call_function":
            assert phase_of(n) is Phase.FORWARD


def test_signature_is_json_data():
    data = json.loads(json.dumps(traced_f().signature.to_dict()))
    assert data["version"] == SIGNATURE_VERSION
    assert data["backward_outputs"][1] == {"kind": "Grad", "of": {"kind": "Input", "path": "w"}}


def test_saved_values_report_shape_dtype_bytes_and_reason():
    saved = {s.name: s for s in traced_f().saved}
    mm = saved["mm"]
    assert mm.shape == (2, 4) and mm.dtype == torch.float32 and mm.nbytes == 32
    assert mm.producer == "aten.mm.default" and "backward" in mm.reason
    assert saved["x"].is_input


def test_free_views_are_recomputed_in_the_backward_not_saved():
    traced = aotgrad.trace(
        lambda x, w: (x @ w.t()).sum(), torch.randn(2, 3, requires_grad=True), torch.randn(4, 3)
    )
    assert all(s.producer != "aten.t.default" for s in traced.saved)


def test_no_backward_when_nothing_requires_grad():
    traced = aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4))
    assert traced.backward is None and traced.saved == ()
    with torch.no_grad():
        traced = aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4, requires_grad=True))
    assert traced.backward is None


def counting(fn):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper, calls


def test_retraces_on_new_metadata_or_scalar_values_only():
    body, calls = counting(lambda x, scale: x.sin() * scale)
    compiled = aotgrad.aot_function(body)
    x = torch.randn(3, requires_grad=True)
    compiled(x, 2.0)
    compiled(torch.randn(3, requires_grad=True), 2.0)
    assert len(calls) == 1, "same metadata and scalars: cache hit"
    for new in [
        (torch.randn(4, requires_grad=True), 2.0),  # shape
        (torch.randn(3, dtype=torch.float64, requires_grad=True), 2.0),  # dtype
        (torch.randn(3), 2.0),  # requires_grad
        (x, 3.0),  # scalar value
    ]:
        before = len(calls)
        out = compiled(*new)
        assert len(calls) == before + 1
        torch.testing.assert_close(out, new[0].sin() * new[1])


def test_specialized_scalars_are_baked_into_the_graph():
    traced = aotgrad.trace(lambda x, n: x * n, torch.randn(2), 7)
    assert [str(d) for d in traced.signature.forward_inputs] == ["x"]
    assert "7" in traced.forward.code


def test_compilers_get_graph_and_fake_example_inputs_and_may_return_boxed_or_not():
    seen = []

    def unboxed(gm, example_inputs):
        assert isinstance(gm, fx.GraphModule)
        seen.append([tuple(t.shape) for t in example_inputs])
        return gm.forward

    def boxed(gm, example_inputs):
        seen.append(len(example_inputs))
        return aotgrad.make_boxed_func(gm.forward)

    compiled = aotgrad.aot_function(f, fw_compiler=unboxed, bw_compiler=boxed)
    x, w = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)
    compiled(x, w).sum().backward()
    assert seen[0] == [(2, 3), (3, 4)]
    assert isinstance(seen[1], int)
    torch.testing.assert_close(w.grad, x.t() @ (x @ w).cos())


def test_works_with_autograd_grad_and_backward():
    compiled = aotgrad.aot_function(f)
    x, w = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x, w).sum(), [w])
    torch.testing.assert_close(g, x.t() @ (x @ w).cos())


def test_modules_retrace_on_train_eval_and_parameter_changes():
    from models import ConvBN

    torch.manual_seed(0)
    model = ConvBN()
    compiled = aotgrad.aot_module(model)
    x, target = torch.randn(2, 1, 8, 8), torch.randn(2, 10)
    compiled(x, target)
    model.eval()
    torch.testing.assert_close(compiled(x, target), model(x, target))
    model.fc1.weight.requires_grad_(False)
    compiled(x, target).backward()
    assert model.fc1.weight.grad is None and model.conv1.weight.grad is not None
    assert len(compiled.compiled.cache) == 3


def every_group(x, buf):
    """The function of Note [Positions]: outputs, a base, a mutated input, saved values."""
    buf.add_(1)
    t = x.exp()
    return x.sin(), t[0], t[1]


def traced_every_group():
    return aotgrad.trace(every_group, torch.randn(2, 3, requires_grad=True), torch.zeros(3))


def test_positions_of_every_group_as_in_the_note():
    sig = traced_every_group().signature
    assert sig.outputs_in_forward == slice(0, 3)
    assert sig.bases_in_forward == slice(3, 4)
    assert sig.mutated_in_forward == slice(4, 5)
    assert sig.saved_in_forward == slice(5, 7)
    assert sig.results_in_forward == slice(0, 5)
    assert sig.saved_in_backward == slice(0, 2)
    assert sig.cotangents_in_backward == slice(2, 4)
    outputs = sig.forward_outputs
    assert all(isinstance(d, Output) for d in outputs[sig.outputs_in_forward])
    assert outputs[sig.bases_in_forward] == (OutputBase((Output("[1]"), Output("[2]"))),)
    assert outputs[sig.mutated_in_forward] == (MutatedInput(Input("buf")),)
    assert outputs[sig.saved_in_forward] == sig.backward_inputs[sig.saved_in_backward]
    assert sig.backward_inputs[sig.cotangents_in_backward] == sig.cotangents


def test_the_queries_slice_the_graphs_values():
    traced = traced_every_group()
    sig = traced.signature
    x, buf = torch.randn(2, 3), torch.zeros(3)
    results = traced.forward(x, buf)
    torch.testing.assert_close(results[sig.outputs_in_forward][0], x.sin())
    torch.testing.assert_close(results[sig.bases_in_forward][0], x.exp())
    torch.testing.assert_close(results[sig.mutated_in_forward][0], buf + 1)
    cotangents = [torch.ones(2, 3), torch.ones(2, 3)]
    grad_x, grad_buf = traced.backward(*results[sig.saved_in_forward], *cotangents)
    torch.testing.assert_close(grad_x, x.cos() + x.exp())
    assert grad_buf is None


def test_empty_groups_are_empty_slices_where_they_would_sit():
    sig = traced_f().signature
    assert sig.bases_in_forward == sig.mutated_in_forward == slice(1, 1)
    no_backward = aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4)).signature
    assert not no_backward.has_backward
    assert no_backward.saved_in_forward == slice(1, 1)
    assert no_backward.saved_in_backward == no_backward.cotangents_in_backward == slice(0, 0)


def test_the_joint_signature_has_nothing_saved_and_grads_follow_the_results():
    traced = traced_every_group()
    joint = traced.partitioned.joint
    assert joint.signature.saved == ()
    assert joint.signature.grads_in_joint == slice(5, 7)
    assert joint.signature.with_saved(traced.signature.saved) == traced.signature
    grads = joint.results()[joint.signature.grads_in_joint]
    assert [g is None for g in grads] == [False, True]
    with pytest.raises(AssertionError, match="none saved"):
        _ = traced.signature.grads_in_joint


def test_a_joint_without_a_backward_has_no_grads():
    joint = aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4)).partitioned.joint
    assert joint.signature.grads_in_joint == slice(1, 1)
    assert joint.grad_results() == []


def descriptors(**changes):
    fields = {
        "forward_inputs": (Input("x"),),
        "forward_outputs": (Output(""), Saved("cos")),
        "backward_inputs": (Saved("cos"), Cotangent(Output(""))),
        "backward_outputs": (Grad(Input("x")),),
    }
    return {**fields, **changes}


def test_a_well_formed_signature_is_accepted():
    assert Signature(**descriptors()).saved_in_forward == slice(1, 2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"forward_outputs": (Saved("cos"), Output(""))}, "forward outputs in the order"),
        ({"backward_inputs": (Cotangent(Output("")), Saved("cos"))}, "backward inputs in the"),
        ({"backward_inputs": (Input("x"), Saved("cos"))}, "backward inputs in the"),
        ({"backward_inputs": (Cotangent(Output("")),)}, "receive the saved values"),
        ({"forward_outputs": (Output(""), Saved("sin"))}, "receive the saved values"),
        ({"backward_outputs": ()}, "expected 1 grads"),
    ],
)
def test_a_signature_out_of_order_is_refused(changes, message):
    with pytest.raises(AssertionError, match=message):
        Signature(**descriptors(**changes))


def test_the_joint_graph_reads_its_descriptors_off_its_one_signature():
    """JointGraph holds the joint Signature capture built once; its graph inputs, outputs,
    bases, mutated inputs and cotangents are that signature's, in its order."""
    joint = traced_every_group().partitioned.joint
    sig = joint.signature
    assert [str(d) for d in joint.graph_inputs] == ["x", "buf"]
    assert [str(d) for d in joint.outputs] == ["output[0]", "output[1]", "output[2]"]
    assert joint.forward_results() and sig.forward_outputs == (
        *joint.outputs,
        *joint.bases,
        *joint.mutated_descriptors,
    )
    assert len(joint.bases) == 1 and [d.of for d in joint.mutated_descriptors] == [
        sig.forward_inputs[1]
    ]
    assert joint.cotangents == sig.cotangents and len(joint.cotangents) == 2  # output[0], base
    with pytest.raises(AssertionError, match="none saved"):
        dataclasses.replace(joint, signature=traced_every_group().signature)


def test_the_runtime_plan_reads_its_positions_off_the_signature():
    plan = Plan.of(traced_every_group().partitioned)
    assert plan.returned == (0, 3, 4)
    assert plan.bases_in_returned == slice(1, 2)
    assert plan.mutated_in_returned == slice(2, 3)
    assert plan.saved_in_forward == slice(5, 7)


def test_mutations_kept_in_the_graph_leave_no_new_values_to_return():
    with torch.no_grad():
        traced = aotgrad.trace(every_group, torch.randn(2, 3), torch.zeros(3))
    partitioned = partition(traced.partitioned.joint, keep_input_mutations=True)
    sig = partitioned.signature
    assert partitioned.mutations_in_graph and sig.mutated_in_forward == slice(4, 4)
    assert "copy_" in partitioned.forward.code
    plan = Plan.of(partitioned)
    assert plan.returned == (0, 3) and plan.mutated_in_returned == slice(2, 2)
