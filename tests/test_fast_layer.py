"""Note [The fast path as a layer]: capture with the fast path off (the full trace in PyTorch's
fake mode) gives the graphs, values, gradients and provenance it gives with the fast path on."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.fx as fx

import aotgrad
from aotgrad.capture import node_info
from aotgrad.capture.tracing.fast import FastFakeMode
from aotgrad.errors import CaptureError
from library_models import build

MODELS = ["gpt2", "llama", "resnet18", "mobilenet_v3", "convnext"]


def _traced(monkeypatch, fast: bool, fn, *args, **kwargs):
    monkeypatch.setenv("AOTGRAD_FAST", "1" if fast else "0")
    return aotgrad.trace(fn, *args, **kwargs)


def _structure(gm: fx.GraphModule, regenerated: set[int]) -> list[tuple[object, ...]]:
    """Each node's op, target, arguments (by position), provenance and descriptor, no names
    (the full trace names views it then drops: Note [Writes through views, directly]); the
    nodes at ``regenerated`` without their seq_nr (Note [Two tracers])."""
    position = {n: f"%{i}" for i, n in enumerate(gm.graph.nodes)}

    def arg(a: object) -> object:
        return position[a] if isinstance(a, fx.Node) else a

    def info(i: int, n: fx.Node) -> object:
        if n.op == "output":
            return None
        return replace(node_info(n), seq_nr=None) if i in regenerated else node_info(n)

    return [
        (
            n.op,
            str(n.target),
            str(fx.node.map_aggregate(n.args, arg)),
            str(fx.node.map_aggregate(n.kwargs, arg)),
            info(i, n),
            n.meta.get("desc"),
        )
        for i, n in enumerate(gm.graph.nodes)
    ]


def _same_graphs(fast: fx.GraphModule, slow: fx.GraphModule) -> None:
    regenerated = {
        i for i, n in enumerate(slow.graph.nodes) if n.meta.get("is_functional_regenerated")
    }
    assert _structure(fast, regenerated) == _structure(slow, regenerated)


def _loss_and_grads(monkeypatch, fast: bool, case):
    monkeypatch.setenv("AOTGRAD_FAST", "1" if fast else "0")
    case.model.zero_grad(set_to_none=True)
    loss = case.loss(aotgrad.aot_module(case.model)(*case.args, **case.kwargs))
    loss.backward()
    return loss.detach(), [p.grad for p in case.model.parameters()]


@pytest.mark.parametrize("name", MODELS)
def test_library_models_capture_the_same_with_the_fast_path_off(monkeypatch, name):
    case = build(name)
    fast = _traced(monkeypatch, True, case.model, *case.args, **case.kwargs)
    slow = _traced(monkeypatch, False, case.model, *case.args, **case.kwargs)
    assert fast.tracer == "direct"  # these models take the direct trace: node for node
    assert (slow.tracer, slow.fallback_reason) == (
        "full",
        "the direct trace was not tried: the fast path is off (Note [The fast path as a layer])",
    )
    for mine, theirs in (
        (fast.joint, slow.joint),
        (fast.forward, slow.forward),
        (fast.backward, slow.backward),
    ):
        _same_graphs(mine, theirs)
    assert str(fast.signature) == str(slow.signature)
    assert [s.to_dict() for s in fast.saved] == [s.to_dict() for s in slow.saved]
    loss_fast, grads_fast = _loss_and_grads(monkeypatch, True, case)
    loss_slow, grads_slow = _loss_and_grads(monkeypatch, False, case)
    case.model.zero_grad(set_to_none=True)
    eager = case.loss(case.model(*case.args, **case.kwargs))
    eager.backward()
    torch.testing.assert_close(loss_slow, loss_fast, rtol=0, atol=0)
    torch.testing.assert_close(loss_slow, eager.detach())
    for g_slow, g_fast, p in zip(grads_slow, grads_fast, case.model.parameters(), strict=True):
        torch.testing.assert_close(g_slow, g_fast, rtol=0, atol=0)
        torch.testing.assert_close(g_slow, p.grad)


def test_the_fast_path_off_runs_none_of_its_shortcuts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the fast fake mode ran with the fast path off")

    monkeypatch.setattr(FastFakeMode, "dispatch", refuse)
    traced = _traced(monkeypatch, False, lambda x: x.view(2, 3).t().relu(), torch.randn(6))
    assert traced.tracer == "full"


def test_tracer_direct_needs_the_fast_path(monkeypatch):
    monkeypatch.setenv("AOTGRAD_FAST", "0")
    with pytest.raises(ValueError, match="tracer='direct' needs the fast path"):
        aotgrad.trace(lambda x: x.sin(), torch.randn(3), tracer="direct")


@pytest.mark.parametrize("sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr])
def test_a_sparse_input_needing_grad_is_refused_by_the_full_trace(monkeypatch, sparse):
    """Functionalization loses its gradient (COO: None, eager has one) or aborts the process
    (CSR): refused first, with what to do."""
    x = sparse(torch.eye(4)).requires_grad_()
    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(CaptureError, match=f"{x.layout} tensor that requires grad"):
        _traced(monkeypatch, False, lambda a, b: a.to_dense() * b, x, w)
    assert _traced(monkeypatch, True, lambda a, b: a.to_dense() * b, x, w).tracer == "direct"


def test_on_a_release_not_verified_the_fast_path_declines_and_says_so(monkeypatch):
    """Note [Behaviour by torch release]: the fast path's rules hold only where the suite
    verified them; elsewhere capture runs in the stock fake mode, with the full trace."""
    from aotgrad.capture.tracing import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("the fast fake mode ran on a release it was not verified on")

    monkeypatch.setattr(FastFakeMode, "dispatch", refuse)
    monkeypatch.setattr(assemble, "FAST_PATH_VERIFIED", frozenset())
    x = torch.randn(6, requires_grad=True)
    traced = aotgrad.trace(lambda x: x.view(2, 3).t().relu(), x)
    assert traced.tracer == "full"
    assert f"not verified on torch {torch.__version__}" in traced.fallback_reason
    (grad,) = torch.autograd.grad(traced(x).sum(), x)
    torch.testing.assert_close(grad, (x > 0).float())
