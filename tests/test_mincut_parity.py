"""``partition="mincut"`` against PyTorch's min-cut partitioner, and ``MUST_SAVE`` in every
strategy (issue 42 item 3; Note [Min-cut weights], Note [Selective checkpoint policies]).

Saved bytes are counted alike on both sides (``tests/reference.py``): the unique storages
the backward receives, inputs and parameters included.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import aotgrad
import library_models  # before anything imports torchvision: it installs the shim
from aotgrad.capture import Phase
from aotgrad.errors import PartitionError
from aotgrad.testing import verify
from models import partition_suite
from reference import WithLoss, mincut_saved_bytes

aten = torch.ops.aten


class Function(nn.Module):
    """A plain function as a module (PyTorch's side takes modules)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def mincut_matches_eager(fn: Callable[..., Any], *args: Any) -> None:
    verify(fn, *args, compile_fn=functools.partial(aotgrad.aot_function, partition="mincut"))


# ------------------------------------------------------------------ pointwise chains


def cos_chain(length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(length):
            x = x.cos()
        return x

    return fn


@pytest.mark.parametrize("shape", [(1000,), (8, 16), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("length", [1, 2, 3, 6])
def test_a_pointwise_chain_is_recomputed_from_its_input(length, shape):
    # The case at length 3: aotgrad saved x, cos, cos_1 (12,000 B), PyTorch x alone.
    x = torch.randn(*shape, requires_grad=True)
    ours, theirs = mincut_saved_bytes(Function(cos_chain(length)), (x,))
    assert ours == x.nbytes <= theirs
    traced = aotgrad.trace(cos_chain(length), x, partition="mincut")
    assert [s.name for s in traced.saved] == ["x"]
    assert len(traced.partitioned.recomputed) == length - 1
    mincut_matches_eager(cos_chain(length), x)


def test_an_input_weighs_its_bytes():
    # Free inputs recomputed x[:10].exp() from all of x (4,000 B) instead of saving it (40 B).
    def fn(x, w):
        return x[:10].exp().sum() * (w @ w).sum()

    x, w = torch.randn(1000, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    ours, theirs = mincut_saved_bytes(Function(fn), (x, w))
    assert ours <= theirs
    traced = aotgrad.trace(fn, x, w, partition="mincut")
    assert "x" not in [s.name for s in traced.saved] and "exp" in [s.name for s in traced.saved]
    mincut_matches_eager(fn, x, w)


def test_compute_intensive_ops_are_saved_and_their_pointwise_tails_recomputed():
    def fn(x, w):
        return (x @ w).relu().cos().cos()

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    traced = aotgrad.trace(fn, x, w, partition="mincut")
    assert [s.name for s in traced.saved] == ["x", "w", "relu"]  # relu's grad reads relu
    assert sorted(r.op for r in traced.partitioned.recomputed) == ["aten.cos.default"]
    ours, theirs = mincut_saved_bytes(Function(fn), (x, w))
    assert ours <= theirs
    mincut_matches_eager(fn, x, w)


def to_copy_chain(x, w):
    return (x.float() @ w).bfloat16().float().sin().cos()


def mild_reduction(x, w):
    return x * x.sum(-1, keepdim=True) * (w @ w).sum()


@pytest.mark.parametrize(
    ("fn", "shape", "recomputed"),
    [
        (to_copy_chain, (16, 8), "aten._to_copy.default"),  # the casts of a mixed precision
        (mild_reduction, (64, 2), "aten.sum.dim_IntList"),  # shrinks x 2x: recomputed
    ],
    ids=["to_copy", "sum(64, 2)"],
)
def test_what_pytorch_recomputes_is_recomputed(fn, shape, recomputed):
    dtype = torch.bfloat16 if fn is to_copy_chain else torch.float32
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(shape[1], shape[1], requires_grad=True)
    ours, theirs = mincut_saved_bytes(Function(fn), (x, w))
    assert ours <= theirs
    traced = aotgrad.trace(fn, x, w, partition="mincut")
    assert recomputed in [r.op for r in traced.partitioned.recomputed]
    mincut_matches_eager(fn, x, w)


def test_a_reduction_that_shrinks_much_is_saved():
    # Shrinking x (8, 64) 64x, the sum is saved (256 B), not recomputed from x.
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    traced = aotgrad.trace(mild_reduction, x, w, partition="mincut")
    assert "aten.sum.dim_IntList" not in [r.op for r in traced.partitioned.recomputed]
    assert "sum_1" in [s.name for s in traced.saved]


UNARY: list[Callable[[torch.Tensor], torch.Tensor]] = [
    torch.sin,
    torch.exp,
    torch.tanh,
    torch.sigmoid,
    torch.relu,
    F.gelu,
    lambda t: t * t,
]


def program(steps: list[tuple[str, int, float]]) -> Callable[..., torch.Tensor]:
    """A small DAG: each step reads an earlier value (``pick`` in [0, 1) of those so far)."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        values = [x]
        for kind, op, pick in steps:
            a = values[int(pick * len(values))]
            if kind == "unary":
                values.append(UNARY[op](a))
            elif kind == "binary":
                values.append(a * values[-1])
            elif kind == "matmul":
                values.append(a @ w)
            else:  # a reduction broadcast back
                values.append(a.sum(-1, keepdim=True) * a)
        return values[-1]

    return fn


STEPS = st.lists(
    st.tuples(
        st.sampled_from(["unary"] * 4 + ["binary", "matmul", "reduce"]),
        st.integers(0, len(UNARY) - 1),
        st.floats(0, 0.999),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(steps=STEPS, rows=st.sampled_from([1, 4, 32]))
def test_random_pointwise_programs_save_no_more_than_pytorch(steps, rows):
    fn = program(steps)
    x, w = torch.randn(rows, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    ours, theirs = mincut_saved_bytes(Function(fn), (x, w))
    assert ours <= theirs, steps
    mincut_matches_eager(fn, x, w)


# ------------------------------------------------------------------ models


@pytest.mark.parametrize("name", list(partition_suite()))
def test_the_model_suite_saves_no_more_than_pytorch(name):
    model, args = partition_suite()[name]
    loss = (lambda out: out[0]) if name == "seednet" else (lambda out: out.sum())
    ours, theirs = mincut_saved_bytes(WithLoss(model, loss), args)
    assert ours <= theirs
    compile_fn = functools.partial(aotgrad.aot_module, partition="mincut")
    verify(model, *args, compile_fn=compile_fn, atol=1e-4, rtol=1e-4)


class NormThenGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        return (h.relu() * h.sigmoid()).sum()


def test_ops_after_a_batchnorm_are_recomputed_from_its_output():
    # Note [Reading a mutated input]: the BatchNorm reads the running stats it updates and is
    # never recomputed; relu and sigmoid read its output, and were saved beside it.
    torch.manual_seed(0)
    model, x = NormThenGate(), torch.randn(2, 3, 8, 8)
    traced = aotgrad.trace(model, x, partition="mincut")
    assert {"relu", "sigmoid"} <= {r.name for r in traced.partitioned.recomputed}
    assert not {"relu", "sigmoid"} & {s.name for s in traced.saved}
    ours, theirs = mincut_saved_bytes(model, (x,))
    assert ours <= theirs
    compile_fn = functools.partial(aotgrad.aot_module, partition="mincut")
    report = verify(NormThenGate(), x, compile_fn=compile_fn, atol=1e-5, rtol=1e-5)
    assert report.compared_reached == 7  # the running stats too: parameters and buffers


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet18", "vit", "mobilenet_v3"])
def test_library_models_save_no_more_than_pytorch(name):
    case = library_models.build(name)
    ours, theirs = mincut_saved_bytes(WithLoss(case.model, case.loss), case.args, case.kwargs)
    assert ours <= theirs


# ------------------------------------------------------------------ MUST_SAVE


def _must_save_exp(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op is aten.exp.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``exp`` is read by the backward only (its own gradient); recomputing it from ``x`` and
    ``w``, which the backward reads anyway, would be free in bytes, but the policy says
    MUST_SAVE."""
    context = functools.partial(create_selective_checkpoint_contexts, _must_save_exp)
    body = lambda x, w: (x * w).exp()  # noqa: E731
    return cp.checkpoint(body, x, w, use_reentrant=False, context_fn=context)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def smallest_peak(fn: Callable[..., Any], *args: Any) -> int:
    """The smallest peak a peak budget can plan (its refusal says it)."""
    with pytest.raises(PartitionError) as refused:
        aotgrad.trace(fn, *args, partition=aotgrad.budget(peak=0), tracer="full")
    found = re.search(r"is (\d+) bytes", str(refused.value))
    assert found is not None, str(refused.value)
    return int(found.group(1))


def smallest_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """The tightest byte budget: what the smallest plan saves."""
    tight = aotgrad.trace(fn, *args, partition=aotgrad.budget(1e-6), tracer="full")
    return tight.partitioned.saved_bytes


STRATEGIES: dict[str, Callable[[], Any]] = {
    "save_all": lambda: "save_all",
    "mincut": lambda: "mincut",
    "budget(0.01)": lambda: aotgrad.budget(0.01),
    "budget(bytes)": lambda: aotgrad.budget(smallest_bytes(selective, *_inputs())),
    "budget(peak)": lambda: aotgrad.budget(peak=smallest_peak(selective, *_inputs())),
    "policy False": lambda: lambda node: False,
    "policy True": lambda: lambda node: True,
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_must_save_is_saved_by_every_strategy(strategy):
    partition = STRATEGIES[strategy]()
    traced = aotgrad.trace(selective, *_inputs(), partition=partition, tracer="full")
    tagged = [
        n.name
        for n in traced.partitioned.joint.gm.graph.nodes
        if n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE and n.target is aten.exp.default
    ]
    assert tagged == ["exp"]
    assert "exp" in [s.name for s in traced.saved]
    assert "exp" not in [r.name for r in traced.partitioned.recomputed]
    compile_fn = functools.partial(aotgrad.aot_function, partition=partition, tracer="full")
    verify(selective, *_inputs(), compile_fn=compile_fn)


def test_without_must_save_the_same_value_is_recomputed():
    # The test above can fail: with the policy's tag gone, min-cut recomputes exp.
    traced = aotgrad.trace(selective, *_inputs(), partition="mincut", tracer="full")
    for node in traced.partitioned.joint.gm.graph.nodes:
        node.meta.pop("recompute", None)
    again = aotgrad.partition.partition(traced.partitioned.joint, "mincut")
    assert "exp" not in [s.name for s in again.saved]


def test_a_policy_answering_false_says_why_must_save_wins():
    traced = aotgrad.trace(selective, *_inputs(), partition=lambda node: False, tracer="full")
    (exp,) = [s for s in traced.saved if s.name == "exp"]
    assert "MUST_SAVE" in exp.reason


# ------------------------------------------------------------------ the default tracer
# The direct trace stops at a selective checkpoint's policy, so "auto" gives the full trace's
# tagged graph (Note [Selective checkpoints stop the direct trace]).


def _tags(traced: Any, op: Any) -> list[Any]:
    """The selective checkpoint tag of each forward node calling ``op``."""
    forward = traced.partitioned.joint.nodes(Phase.FORWARD)
    return [n.meta.get("recompute") for n in forward if n.target is op]


@pytest.mark.parametrize("strategy", ["mincut", "save_all", "budget(0.01)", "policy False"])
def test_must_save_under_the_default_tracer(strategy):
    partition = STRATEGIES[strategy]()
    traced = aotgrad.trace(selective, *_inputs(), partition=partition)
    assert _tags(traced, aten.exp.default) == [CheckpointPolicy.MUST_SAVE]
    assert "exp" in [s.name for s in traced.saved]
    assert "exp" not in [r.name for r in traced.partitioned.recomputed]
    compile_fn = functools.partial(aotgrad.aot_function, partition=partition)
    verify(selective, *_inputs(), compile_fn=compile_fn)


def test_must_save_under_torch_compile():
    torch.compiler.reset()
    forward_codes = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        forward_codes.append(gm.code)
        return gm

    backend = aotgrad.backend(forward_compiler, lambda gm, _: gm, partition="mincut")
    x, w = _inputs()
    out = torch.compile(selective, backend=backend)(x, w)
    out.sum().backward()
    eager_x, eager_w = (t.detach().clone().requires_grad_() for t in _inputs())
    expected = selective(eager_x, eager_w)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, eager_x.grad)
    torch.testing.assert_close(w.grad, eager_w.grad)
    (code,) = forward_codes
    assert "# saved: exp" in code  # the direct trace's untagged graph recomputed it


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (aten.mm.default, aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def matmul_saved(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``mm`` MUST_SAVE, ``exp`` and ``sin`` PREFER_RECOMPUTE."""
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    body = lambda x, w: (x @ w).exp().sin()  # noqa: E731
    return cp.checkpoint(body, x, w, use_reentrant=False, context_fn=context)


PREFER_RECOMPUTE_STRATEGIES: dict[str, Callable[[], Any]] = {
    "mincut": lambda: "mincut",
    "save_all": lambda: "save_all",
    # recomputed the MUST_SAVE mm too while the direct trace left it untagged
    "budget(0.5)": lambda: aotgrad.budget(0.5),
    "policy True": lambda: lambda node: True,
}


@pytest.mark.parametrize("strategy", list(PREFER_RECOMPUTE_STRATEGIES))
def test_prefer_recompute_and_must_save_under_the_default_tracer(strategy):
    partition = PREFER_RECOMPUTE_STRATEGIES[strategy]()
    traced = aotgrad.trace(matmul_saved, *_inputs(), partition=partition)
    assert _tags(traced, aten.exp.default) == [CheckpointPolicy.PREFER_RECOMPUTE]
    assert _tags(traced, aten.mm.default) == [CheckpointPolicy.MUST_SAVE]
    assert [s.name for s in traced.saved] == ["x", "w", "mm"]
    recomputed = traced.partitioned.recomputed
    assert [r.name for r in recomputed] == ["exp"]
    assert "selective checkpoint policy PREFER_RECOMPUTE" in recomputed[0].reason
    compile_fn = functools.partial(aotgrad.aot_function, partition=partition)
    verify(matmul_saved, *_inputs(), compile_fn=compile_fn)


class SelectiveBlock(nn.Module):
    """A residual MLP block checkpointed selectively inside its forward: the matmuls saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        h = cp.checkpoint(self._mlp, x, use_reentrant=False, context_fn=context)
        return self.norm(h + x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("partition", ["mincut", "save_all"])
def test_a_module_checkpointing_selectively_in_its_forward(partition):
    torch.manual_seed(0)
    model = SelectiveBlock()
    eager = copy.deepcopy(model)
    compiled = aotgrad.aot_module(model, partition=partition)
    x = torch.randn(4, 8, requires_grad=True)
    eager_x = x.detach().clone().requires_grad_()
    for _ in range(2):  # the trace, then the cached graphs
        out, expected = compiled(x), eager(eager_x)
        torch.testing.assert_close(out, expected)
        cotangent = torch.randn_like(out)
        out.backward(cotangent)
        expected.backward(cotangent)
    torch.testing.assert_close(x.grad, eager_x.grad)
    params = dict(eager.named_parameters())
    assert len(params) == 6
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, params[name].grad, msg=name)
    partitioned = compiled.compiled.partitioned
    tags = {n.meta.get("recompute") for n in partitioned.joint.nodes(Phase.FORWARD)}
    assert CheckpointPolicy.MUST_SAVE in tags
    saved = [s.producer for s in partitioned.saved if not s.is_input]
    assert saved.count("aten.addmm.default") == 2  # fc1's and fc2's, as the policy says
    assert "aten.gelu.default" not in saved


@pytest.mark.fast_path  # Note [The fast path as a layer]
def test_the_direct_trace_stops_at_a_selective_checkpoint_only():
    traced = aotgrad.trace(selective, *_inputs(), partition="mincut")
    assert traced.tracer == "full"
    assert traced.fallback_reason.startswith("the direct trace stopped at ")
    assert "an op ran under a selective checkpoint's policy" in traced.fallback_reason
    module = aotgrad.aot_module(SelectiveBlock())
    module(torch.randn(4, 8)).sum().backward()
    assert module.compiled.partitioned.joint.tracer.name == "full"
    with pytest.raises(aotgrad.DirectTraceError, match="selective checkpoint's policy"):
        aotgrad.trace(selective, *_inputs(), partition="mincut", tracer="direct")


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cp.checkpoint(lambda x, w: (x * w).exp(), x, w, use_reentrant=False)


class PlainBlock(SelectiveBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(cp.checkpoint(self._mlp, x, use_reentrant=False) + x)


@pytest.mark.fast_path
def test_a_plain_checkpoint_stays_on_the_direct_trace():
    traced = aotgrad.trace(plain, *_inputs(), partition="mincut")
    assert (traced.tracer, traced.fallback_reason) == ("direct", None)
    assert "exp" not in [s.name for s in traced.saved]  # untagged: mincut recomputes it
    module = aotgrad.aot_module(PlainBlock())
    module(torch.randn(4, 8)).sum().backward()
    assert module.compiled.partitioned.joint.tracer.name == "direct"
    assert aotgrad.trace(PlainBlock(), torch.randn(4, 8)).tracer == "direct"
