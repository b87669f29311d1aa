"""What a user meets first (issue 38): ``aot_module(...).partitioned`` and ``aotgrad.cache_info``
on every frontend's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.testing import verify


def test_aot_module_has_the_partitioned_of_its_last_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = aotgrad.aot_module(model, partition="mincut")
    assert compiled.partitioned is None  # before the first call, as aot_function's
    x = torch.randn(3, 4)
    compiled(x).sum().backward()
    traced = aotgrad.trace(model, x, partition="mincut").partitioned
    assert compiled.partitioned is compiled.compiled.partitioned
    assert compiled.partitioned.strategy == "mincut"
    assert [s.name for s in compiled.partitioned.saved] == [s.name for s in traced.saved]
    assert compiled.partitioned.peak.allocated == traced.peak.allocated
    with torch.no_grad():
        compiled(torch.randn(5, 4))  # another specialization: the last call's graphs
    assert compiled.partitioned.saved == () and compiled.partitioned.backward is None
    verify(model, x, compile_fn=lambda m: aotgrad.aot_module(m, partition="mincut"))


def test_cache_info_of_a_trace():
    traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
    traced(torch.zeros(2, requires_grad=True))  # the same specialization
    torch.func.grad(lambda x: traced(x).sum())(torch.zeros(2))
    info = aotgrad.cache_info(traced)
    assert (info.misses, info.entries, info.graphs, info.transform_runs) == (1, 1, 1, 1)
    assert info.reasons == ["captured by aotgrad.trace: one specialization, no cache"]


def test_cache_info_of_a_scan_counts_its_body_captures():
    def step(h, x):
        h = torch.tanh(h * x)
        return h, h.sum()

    run = aotgrad.scan_function(step)
    run(torch.ones(2), torch.ones(4, 2))
    run(torch.ones(2), torch.ones(7, 2))  # another length: the same body
    run.over_rows(torch.ones(2), list(torch.ones(3, 2)))
    run(torch.ones(3), torch.ones(4, 3))  # another carry: a capture
    info = aotgrad.cache_info(run)
    assert (info.hits, info.misses, info.entries) == (2, 2, 2) == (2, run.captures, 2)
    assert info.reasons[0] == "first call"
    assert info.reasons[1].startswith("the carry's tensors: ((torch.Size([2]),")
    torch.func.grad(lambda h: run(h, torch.ones(4, 3))[0].sum())(torch.ones(3))
    assert aotgrad.cache_info(run).transform_runs == 1  # ran unrolled

    def body(h, x):  # aotgrad.scan(fn, ...) runs scan_function(fn)'s loop
        return h * x, None

    aotgrad.scan(body, torch.ones(2), torch.ones(3, 2))
    aotgrad.scan(body, torch.ones(2), torch.ones(5, 2))
    info = aotgrad.cache_info(aotgrad.scan_function(body))
    assert (info.hits, info.misses, info.reasons) == (1, 1, ["first call"])

    layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
    aotgrad.scan_layers(layers, torch.randn(2, 3))
    aotgrad.scan_layers(layers, torch.randn(2, 3))
    info = aotgrad.cache_info(aotgrad.scan_layers_function(layers))
    assert (info.hits, info.misses) == (1, 1)


class _Breaks(nn.Module):
    """Two graphs for Dynamo: a print is a graph break."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        y = self.a(x).relu()
        print("graph break")
        return self.b(y)


@pytest.mark.parametrize("how", ["backend", "registered", "in_place"])
def test_cache_info_of_a_torch_compiled_model_sums_its_graphs(how, capsys):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Breaks()
    model = _Breaks()
    model.load_state_dict(eager.state_dict())
    if how == "backend":
        compiled = torch.compile(model, backend=aotgrad.backend(partition="mincut"))
    elif how == "registered":
        compiled = torch.compile(model, backend="aotgrad")
    else:
        model.compile(backend="aotgrad")
        compiled = model
    assert aotgrad.cache_info(compiled).graphs == 0  # nothing compiled yet
    x = torch.randn(2, 3)
    for _ in range(2):
        out = compiled(x)
        out.sum().backward()
    torch.testing.assert_close(out, eager(x))
    eager(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    info = aotgrad.cache_info(compiled)
    assert (info.graphs, info.misses, info.hits) == (2, 2, 2), info
    assert info.reasons == ["graph 0: first call", "graph 1: first call"]
    assert str(info).startswith("2 graphs compiled by Dynamo\n2 hits, 2 misses")


def test_cache_info_of_a_torch_compiled_function_and_of_other_backends():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sin() * 2, backend=aotgrad.backend())
    f(torch.ones(3))
    f(torch.ones(3))
    info = aotgrad.cache_info(f)
    assert (info.graphs, info.hits, info.misses) == (1, 1, 1)

    class Other(nn.Module):
        def forward(self, x):
            return x.cos()

    other = torch.compile(Other(), backend="eager")
    other(torch.ones(2))
    with pytest.raises(TypeError, match="compiled by another backend, not aotgrad's"):
        aotgrad.cache_info(other)
    with pytest.raises(TypeError, match=r"for aotgrad.scan\(fn, ...\), pass aotgrad.scan_function"):
        aotgrad.cache_info(lambda x: x)
