"""Note [Direct tracing]: the direct trace gives the full trace's graphs, node for node."""

from __future__ import annotations

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as cp

import aotgrad
import aotgrad.capture as capture
from aotgrad.capture import node_info
from models import GPT, DeepMLP


def _checkpointed(x, w):
    return cp.checkpoint(lambda a, b: (a @ b).sin() @ b, x, w, use_reentrant=False)


def _returns_views_and_constants(x, w):
    y = (x @ w).relu()
    return {"y": y, "t": y.t(), "x_view": x.view(-1), "scale": 2.0}


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
    }


def _trace(fn, args, direct: bool, monkeypatch):
    used = []
    original = capture._trace_directly

    def attempt(trace):
        result = original(trace) if direct else None
        used.append(result is not None)
        return result

    monkeypatch.setattr(capture, "_trace_directly", attempt)
    traced = aotgrad.trace(fn, *args)
    monkeypatch.setattr(capture, "_trace_directly", original)
    return traced, used


def _described(gm):
    return [
        (n.op, n.name, str(n.target), str(n.args), str(n.kwargs), _info(n), n.meta.get("desc"))
        for n in gm.graph.nodes
    ]


def _info(node):
    return None if node.op == "output" else node_info(node)


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_and_full_traces_give_the_same_graphs_and_provenance(case, monkeypatch):
    fn, args = _cases()[case]
    direct, used_direct = _trace(fn, args, True, monkeypatch)
    full, used_full = _trace(fn, args, False, monkeypatch)
    assert used_direct == [True] and used_full == [False]
    for mine, theirs in ((direct.joint, full.joint), (direct.forward, full.forward)):
        assert _described(mine) == _described(theirs)
    assert (direct.backward is None) == (full.backward is None)
    if full.backward is not None:
        assert _described(direct.backward) == _described(full.backward)
    assert str(direct.signature) == str(full.signature)
    assert [s.to_dict() for s in direct.saved] == [s.to_dict() for s in full.saved]


def test_mutations_and_random_ops_take_the_full_trace(monkeypatch):
    def mutates(x):
        x.mul_(2)
        return x.sin()

    def drops(x):
        return torch.nn.functional.dropout(x, 0.5, training=True).sum()

    for fn in (mutates, drops):
        _, used = _trace(fn, (torch.randn(3),), True, monkeypatch)
        assert used == [False]


def test_a_trace_that_stops_inside_a_module_leaves_no_annotations_behind():
    before = dict(fx_traceback.current_meta)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))  # stops in [1]
    aotgrad.aot_module(model)(torch.ones(1, 2))
    assert fx_traceback.current_meta == before
    traced = aotgrad.trace(lambda x: x.cos(), torch.randn(2, requires_grad=True))
    ops = [n for n in traced.forward.graph.nodes if n.op == "call_function"]
    assert ops and all(node_info(n).module == "<lambda>" for n in ops)
