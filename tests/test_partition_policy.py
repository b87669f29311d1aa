"""Partition policies (Note [Partition policies]): a strategy is a function answering "save this
op's output?"; the library builds the graphs, applies the rules and checkpoints, and checks it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import CheckpointPolicy

import aotgrad
from aotgrad import PartitionError
from aotgrad.partition import partition
from aotgrad.testing import verify
from library_models import build
from test_real_models import compare

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def save_matmuls(node: torch.fx.Node) -> bool:
    return node.target in MATMULS


def test_a_policy_saving_only_matmuls_trains_gpt2_like_eager() -> None:
    """The acceptance test: three SGD steps of a dropout GPT-2, loss and grads equal to eager."""
    case, made = build("gpt2", dropout=0.1), []

    def compile_fn(module, inputs):  # type: ignore[no-untyped-def]
        made.append(aotgrad.aot_module(module, partition=save_matmuls))
        return made[-1]

    compare(case, compile_fn, [case.inputs] * 3, sgd=True)
    plan = made[0].compiled.partitioned
    matmuls = {str(op) for op in MATMULS}
    for value in plan.saved:  # what the policy allowed, and what the rules force
        assert value.is_input or value.producer in matmuls or "never recomputed" in value.reason
    assert any(v.producer in matmuls for v in plan.saved)
    assert any("never recomputed" in v.reason for v in plan.saved)  # dropout's draws
    assert {r.op for r in plan.recomputed} >= {
        "aten.tanh.default",
        "aten.native_layer_norm.default",
    }
    assert not {r.op for r in plan.recomputed} & matmuls


def _with(policy):  # type: ignore[no-untyped-def]
    return lambda fn: aotgrad.aot_function(fn, partition=policy)


def _mlp(x, w, w2):  # type: ignore[no-untyped-def]
    return (x @ w).relu().mm(w2).sum()


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(4, 4, requires_grad=True) for _ in range(3))


def test_the_notes_worked_example() -> None:
    """Note [Partition policies] and docs/rematerialization.md: mm saved, relu recomputed."""
    traced = aotgrad.trace(_mlp, *_inputs(), partition=save_matmuls)
    assert [s.name for s in traced.saved] == ["x", "w", "w2", "mm"]
    assert [r.name for r in traced.partitioned.recomputed] == ["relu"]
    assert traced.partitioned.strategy == "policy 'save_matmuls'"
    verify(_mlp, *_inputs(), compile_fn=_with(save_matmuls))


def test_what_no_plan_recomputes_is_saved_without_asking() -> None:
    asked: list[str] = []

    def nothing(node: torch.fx.Node) -> bool:
        asked.append(str(node.target))
        return False

    def fn(x, buf):  # type: ignore[no-untyped-def]
        buf.add_(1)
        y = torch.nn.functional.layer_norm(torch.nn.functional.dropout(x.sin(), 0.5), (4,))
        return (y * buf.cos()).sum()

    x, buf = torch.randn(4, 4, requires_grad=True), torch.zeros(4)
    traced = aotgrad.trace(fn, x, buf.clone(), partition=nothing)
    reasons = {s.producer: s.reason for s in traced.saved if not s.is_input}
    assert "never recomputed" in reasons["aten.cos.default"]  # reads the mutated buf
    assert any("random" in r for r in reasons.values())  # dropout's mask
    assert "aten.cos.default" not in asked and asked.count("aten.native_layer_norm.default") == 1
    verify(fn, x, buf, compile_fn=_with(nothing))


def test_a_checkpoint_region_is_recomputed_whatever_the_policy_answers() -> None:
    def fn(x, w, w2):  # type: ignore[no-untyped-def]
        return cp.checkpoint(_mlp, x, w, w2, use_reentrant=False)

    traced = aotgrad.trace(fn, *_inputs(), partition=lambda node: True)
    assert [s.name for s in traced.saved] == ["x", "w", "w2"]
    assert {r.op for r in traced.partitioned.recomputed} == {"aten.mm.default", "aten.relu.default"}
    verify(fn, *_inputs(), compile_fn=_with(lambda node: True))


def test_a_recompute_tag_overrules_the_policy() -> None:
    joint = aotgrad.trace(_mlp, *_inputs()).partitioned.joint
    (relu,) = [n for n in joint.gm.graph.nodes if n.name == "relu"]
    relu.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE  # as Dynamo's selective checkpoint
    plan = partition(joint, lambda node: True)
    assert [s.name for s in plan.saved] == ["x", "w", "w2", "mm"]
    assert {r.name: r.reason for r in plan.recomputed} == {
        "relu": "selective checkpoint policy MUST_RECOMPUTE"
    }


def test_a_policy_with_dynamic_shapes() -> None:
    compiled = aotgrad.aot_function(_mlp, partition=save_matmuls, dynamic=True)
    for rows in (4, 7):
        x, w, w2 = torch.randn(rows, 4, requires_grad=True), *_inputs()[1:]
        compiled(x, w, w2).backward()
        (expected,) = torch.autograd.grad(_mlp(x, w, w2), x)
        torch.testing.assert_close(x.grad, expected)


def test_an_answer_that_is_not_a_bool_is_refused_naming_the_op() -> None:
    with pytest.raises(
        PartitionError, match=r"answered int 1, not True or False, about forward op mm"
    ):
        aotgrad.trace(_mlp, *_inputs(), partition=lambda node: 1)
    with pytest.raises(PartitionError, match="answered FakeTensor"):  # truthy, yet no decision
        aotgrad.trace(_mlp, *_inputs(), partition=lambda node: node.meta["val"].sum() > 0)


def test_a_joint_to_partitioned_callable_is_refused_with_how_to_port_it() -> None:
    def old(joint):  # type: ignore[no-untyped-def]
        return dataclasses.replace(partition(joint, "mincut"))

    with pytest.raises(PartitionError, match="no longer accepted") as info:
        aotgrad.trace(_mlp, *_inputs(), partition=old)
    assert "partition policy 'test_a_joint" in str(info.value)
    assert isinstance(info.value.__cause__, AttributeError)  # a Node has no has_backward


@dataclasses.dataclass(frozen=True)
class SaveOps:
    """A policy with fields: its repr names them, not the code of ``__call__``."""

    ops: tuple[str, ...]

    def __call__(self, node: torch.fx.Node) -> bool:
        return str(node.target) in self.ops


def test_a_policy_is_never_keyed_in_the_disk_cache_even_a_dataclass(cache_dir) -> None:  # type: ignore[no-untyped-def]
    compiled = aotgrad.aot_function(_mlp, partition=SaveOps(("aten.mm.default",)))
    compiled(*_inputs())
    assert "partition policy has no stable key" in aotgrad.cache_info(compiled).disk_skipped
    budget = aotgrad.aot_function(_mlp, partition=aotgrad.budget(0.5))
    budget(*_inputs())
    assert aotgrad.cache_info(budget).disk_skipped is None
