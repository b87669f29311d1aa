"""Note [Two tracers], [Direct tracing], [Choosing a tracer]: the direct trace gives the full
trace's graphs node for node, stops with a reason, and the ``tracer`` option chooses."""

from __future__ import annotations

import functools
import warnings
import weakref

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as cp
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import aotgrad
from aotgrad.capture import node_info
from aotgrad.capture.tracing.fast.direct import DirectTracer
from aotgrad.capture.tracing.tracers import DirectTracerBugWarning
from models import GPT, ConvBN, DeepMLP

pytestmark = pytest.mark.fast_path  # Note [The fast path as a layer]


def _checkpointed(x, w):
    return cp.checkpoint(lambda a, b: (a @ b).sin() @ b, x, w, use_reentrant=False)


def _returns_views_and_constants(x, w):
    y = (x @ w).relu()
    return {"y": y, "t": y.t(), "x_view": x.view(-1), "scale": 2.0}


def _in_place_on_intermediates(x, w):
    h = x @ w
    h.add_(1).mul_(w.sum())
    h.masked_fill_(h > 2, 0.0)
    h.relu_()
    return torch.nn.functional.silu(h * 1, inplace=True).sum()


def _updates_a_buffer(x, count, w):
    count.add_(1)
    return (x * w).sum()


def _pools_channels_last(x):
    # adaptive_avg_pool2d restrides its fresh result in place (as_strided_) on channels_last
    x = x.contiguous(memory_format=torch.channels_last).sin()
    return torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)


def _updates_a_split(x):
    x.split(2)[0].add_(1)  # no scatter for one item of split's list
    return x.sin()


def _cases():
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    idx = torch.randint(0, 64, (2, 8))
    return {
        "gpt": (GPT(blocks=2), (idx, torch.randint(0, 64, (2, 8)))),
        "mlp": (DeepMLP(width=16, depth=3), (torch.randn(4, 16),)),
        "checkpoint": (_checkpointed, (x, w)),
        "views and constants": (_returns_views_and_constants, (x, w)),
        "no grad inputs": (lambda a: a.sin().sum(), (torch.randn(3),)),
        "in-place ops on intermediates": (_in_place_on_intermediates, (x, w)),
        "an input updated under no grad": (_updates_a_buffer, (x, torch.zeros(()), w)),
        "an intermediate restrided in place": (_pools_channels_last, (torch.randn(2, 3, 4, 4),)),
        "batchnorm running statistics": (ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))),
    }


def _described(gm):
    return [
        (n.op, n.name, str(n.target), str(n.args), str(n.kwargs), _info(n), n.meta.get("desc"))
        for n in gm.graph.nodes
    ]


def _info(node):
    return None if node.op == "output" else node_info(node)


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_and_full_traces_give_the_same_graphs_and_provenance(case):
    fn, args = _cases()[case]
    direct = aotgrad.trace(fn, *args, tracer="direct")
    full = aotgrad.trace(fn, *args, tracer="full")
    assert (direct.tracer, direct.fallback_reason) == ("direct", None)
    assert (full.tracer, full.fallback_reason) == ("full", "tracer='full' was asked")
    assert aotgrad.trace(fn, *args).tracer == "direct"  # auto
    for mine, theirs in ((direct.joint, full.joint), (direct.forward, full.forward)):
        assert _described(mine) == _described(theirs)
    assert (direct.backward is None) == (full.backward is None)
    if full.backward is not None:
        assert _described(direct.backward) == _described(full.backward)
    assert str(direct.signature) == str(full.signature)
    assert [s.to_dict() for s in direct.saved] == [s.to_dict() for s in full.saved]


def _mutates(x):
    x.t_()  # stops here
    return x.sin()


def _scales(x):
    x.mul_(2)
    return x.sin()


def _drops(x):
    return torch.nn.functional.dropout(x, 0.5, training=True).sum()


def _reentrant(x, w):
    return cp.checkpoint(lambda a, b: (a @ b).sin(), x, w, use_reentrant=True).sum()


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(x, w):
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_all)
    return cp.checkpoint(lambda a, b: (a @ b).sin(), x, w, use_reentrant=False, context_fn=context)


class _ZeroesInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.zero_()

    @staticmethod
    def backward(ctx, grad):
        return grad * 0


def _marks_dirty(x):
    with torch.no_grad():
        x.mul_(2)  # recorded directly: no grad mode
    return _ZeroesInPlace.apply(x).sum()  # autograd's refusal on the leaf: a stop


def _square():
    return torch.randn(3, 3, requires_grad=True)


# case -> (function, inputs, what the reason says)
STOPS = {
    "write through a view it cannot scatter": (
        _updates_a_split,
        lambda: (torch.randn(4),),
        "aten.add_.Tensor: a write through a view made by aten.split.Tensor",
    ),
    "metadata mutation of an input": (
        _mutates,
        lambda: (torch.randn(3),),
        "aten.t_.default mutates an input's size or strides",
    ),
    "random op": (_drops, lambda: (torch.randn(3),), "aten.bernoulli_.float mutates a tensor"),
    "in-place on an input needing grad": (
        _scales,
        lambda: (torch.randn(3, requires_grad=True) * 1,),
        "an in-place op on a tensor autograd sees as a leaf that requires grad",
    ),
    "mark_dirty on an input needing grad": (
        _marks_dirty,
        lambda: (torch.randn(3, requires_grad=True) * 1,),
        "an in-place op on a tensor autograd sees as a leaf that requires grad",
    ),
    "constant made inside": (
        lambda x: x * torch.tensor([2.0]),
        lambda: (torch.randn(3),),
        "aten.lift_fresh.default lifts a tensor constant",
    ),
    "reentrant checkpoint": (
        _reentrant,
        lambda: (_square(), _square()),
        "a reentrant checkpoint refuses autograd.grad",
    ),
    "selective checkpoint": (
        _selective,
        lambda: (_square(), _square()),
        "an op ran under a selective checkpoint's policy",
    ),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_auto_falls_back_to_the_full_trace_and_says_why(case):
    fn, inputs, reason = STOPS[case]
    traced = aotgrad.trace(fn, *inputs())
    assert traced.tracer == "full"
    assert traced.fallback_reason.startswith("the direct trace stopped")
    assert reason in traced.fallback_reason
    assert not traced.partitioned.joint.tracer.direct_tracer_bug


@pytest.mark.parametrize("case", list(STOPS))
def test_direct_refuses_what_it_does_not_handle_naming_why(case):
    fn, inputs, reason = STOPS[case]
    with pytest.raises(aotgrad.DirectTraceError) as info:
        aotgrad.trace(fn, *inputs(), tracer="direct")
    message = str(info.value)
    assert message.startswith(f"tracer='direct' cannot capture this function: {reason}")
    assert "tracer='auto'" in message and "tracer='full'" in message


def test_the_stop_names_the_users_line():
    traced = aotgrad.trace(_mutates, torch.randn(3))
    assert f"test_direct_trace.py:{_mutates.__code__.co_firstlineno + 1}:" in (
        traced.fallback_reason
    )
    with pytest.raises(aotgrad.DirectTraceError, match=r"x\.t_\(\)  # stops here"):
        aotgrad.trace(_mutates, torch.randn(3), tracer="direct")


def _policy_contexts():
    forward, _ = create_selective_checkpoint_contexts(_recompute_all)
    with forward:
        yield


def _policy_mode_left_open(x):
    # torch 2.11/2.12's checkpoint: the contexts a body raised inside stay open until the
    # frame holding the checkpoint's generator lets go
    contexts = _policy_contexts()
    next(contexts)
    return x.sin()  # stops here, under the policy's mode


def test_a_stop_under_a_policy_mode_leaves_no_dispatch_mode_on():
    # Note [Selective checkpoints stop the direct trace]: the policy's mode exits first
    traced = aotgrad.trace(_policy_mode_left_open, torch.randn(3, requires_grad=True))
    assert "selective checkpoint" in traced.fallback_reason
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not is_in_torch_dispatch_mode()


def test_calls_the_direct_trace_does_not_try():
    x = torch.randn(4, 3)
    dynamic = aotgrad.trace(lambda a: a.sin(), x, dynamic=True)
    assert dynamic.tracer == "full"
    assert dynamic.fallback_reason == (
        "the direct trace was not tried: dynamic shapes (it records static sizes only)"
    )
    shared = aotgrad.trace(lambda a, b: a + b[0], x[0], x)
    assert shared.tracer == "full"
    assert "not tried: inputs share memory" in shared.fallback_reason
    with pytest.raises(aotgrad.DirectTraceError, match="cannot capture this function: dynamic"):
        aotgrad.trace(lambda a: a.sin(), x, dynamic=True, tracer="direct")


def _counting(calls):
    def fn(x):
        calls.append(1)
        return x.sin()

    return fn


def test_full_never_runs_the_direct_trace_and_auto_runs_it_once():
    for tracer, expected in (("full", 1), ("auto", 1), ("direct", 1)):
        calls = []
        aotgrad.trace(_counting(calls), torch.randn(2), tracer=tracer)
        assert len(calls) == expected, tracer
    calls = []

    def mutates(x):
        calls.append(1)
        return x.t_()  # a metadata mutation: the direct trace stops

    aotgrad.trace(mutates, torch.randn(2), tracer="full")
    assert len(calls) == 1
    aotgrad.trace(mutates, torch.randn(2))
    assert len(calls) == 3  # auto: the direct trace stopped, the full one ran it again


def test_the_option_reaches_capture_through_every_frontend():
    model = torch.nn.Linear(3, 2)
    module = aotgrad.aot_module(model, tracer="full")
    module(torch.randn(2, 3)).sum().backward()
    assert module.compiled.partitioned.joint.tracer.name == "full"
    function = aotgrad.aot_function(lambda x: x.cos(), tracer="direct")
    function(torch.randn(2))
    assert function.partitioned.joint.tracer.name == "direct"
    with pytest.raises(aotgrad.DirectTraceError):
        aotgrad.aot_function(_mutates, tracer="direct")(torch.randn(3))


@pytest.mark.parametrize("frontend", ["trace", "aot_function", "aot_module"])
def test_an_unknown_tracer_is_refused_before_any_capture(frontend):
    calls = []
    with pytest.raises(ValueError, match="unknown tracer 'fast'; expected 'auto'"):
        if frontend == "trace":
            aotgrad.trace(_counting(calls), torch.randn(2), tracer="fast")
        elif frontend == "aot_function":
            aotgrad.aot_function(_counting(calls), tracer="fast")
        else:
            aotgrad.aot_module(torch.nn.Linear(2, 2), tracer="fast")
    assert calls == []


def test_the_functions_own_error_comes_from_the_full_trace_without_a_bug_report():
    def mismatched(x):
        return x @ torch.ones(5, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DirectTracerBugWarning
        with pytest.raises(aotgrad.OpError, match="must have same reduction dim") as info:
            aotgrad.trace(mismatched, torch.randn(2, 3))
    chain = [info.value]
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    # aotgrad's error from torch's, and nothing of the direct trace's attempt behind them
    assert [type(e) for e in chain] == [aotgrad.errors.OpRuntimeError, RuntimeError]
    with pytest.raises(aotgrad.OpError, match="must have same reduction dim"):  # the same words
        aotgrad.trace(mismatched, torch.randn(2, 3), tracer="direct")


def _planted_bug(self, value):
    raise TypeError("planted")


def test_a_direct_tracer_bug_falls_back_and_is_reported(monkeypatch):
    monkeypatch.setattr(DirectTracer, "traced", _planted_bug)
    with pytest.warns(DirectTracerBugWarning, match="direct tracer failed with TypeError: planted"):
        traced = aotgrad.trace(lambda x: x.sin(), torch.randn(2))
    assert traced.tracer == "full"
    assert traced.fallback_reason == "the direct tracer failed: TypeError: planted"
    assert traced.partitioned.joint.tracer.direct_tracer_bug
    with pytest.raises(TypeError, match="planted"):  # asked for, the direct trace is not hidden
        aotgrad.trace(lambda x: x.sin(), torch.randn(2), tracer="direct")


def test_the_suite_fails_on_a_direct_tracer_bug(monkeypatch):
    """pyproject.toml's filterwarnings makes the warning an error in every test."""
    monkeypatch.setattr(DirectTracer, "traced", _planted_bug)
    with pytest.raises(DirectTracerBugWarning):
        aotgrad.trace(lambda x: x.sin(), torch.randn(2))


def test_a_trace_that_stops_inside_a_module_leaves_no_annotations_behind():
    before = dict(fx_traceback.current_meta)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))  # stops in [1]
    aotgrad.aot_module(model)(torch.ones(1, 2))
    assert fx_traceback.current_meta == before
    traced = aotgrad.trace(lambda x: x.cos(), torch.randn(2, requires_grad=True))
    ops = [n for n in traced.forward.graph.nodes if n.op == "call_function"]
    assert ops and all(node_info(n).module == "<lambda>" for n in ops)


def test_a_stop_is_not_swallowed_by_the_functions_own_except():
    def guarded(x):
        try:  # noqa: SIM105 -- the construct under test
            x.split(1)[0].add_(1)  # through split's list: the direct trace stops
        except Exception:
            pass
        return x * 2

    x = torch.zeros(2)
    compiled = aotgrad.aot_function(guarded)
    torch.testing.assert_close(compiled(x), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(x, torch.tensor([1.0, 0.0]))
    assert compiled.partitioned.joint.tracer.name == "full"


def test_the_direct_traces_frames_are_let_go_before_the_full_trace():
    """Note [The direct trace's frames are let go]: a local of the frame the direct trace
    stopped in is freed before the full trace runs (on torch 2.11 a non-reentrant
    checkpoint's hooks stayed pushed through such a frame, and the full trace saved extra
    tensors)."""
    seen_during_full = []

    class Marker:
        pass

    def fn(x):
        marker = Marker()
        refs.append(weakref.ref(marker))
        if len(refs) == 2:  # the full trace: the direct trace's marker must be gone
            seen_during_full.append(refs[0]() is None)
        return x.t_()  # a metadata mutation: the direct trace stops here

    refs: list[weakref.ref] = []
    traced = aotgrad.trace(fn, torch.randn(2, 3))
    assert traced.fallback_reason.startswith("the direct trace stopped")
    assert seen_during_full == [True]
