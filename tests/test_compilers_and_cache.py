"""Compilers (nop, print_graphs, inductor), cache hits/misses with reasons, double backward."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import linecache
import traceback
import warnings

import pytest
import torch

import aotgrad
from aotgrad.compilers import inductor, nop, print_graphs
from aotgrad.testing import verify
from models import GPT


def test_print_graphs_dumps_both_graphs_with_descriptors():
    out = io.StringIO()
    compiler = print_graphs(out)
    f = aotgrad.aot_function(lambda x, w: (x @ w).sin().sum(), compiler, compiler)
    f(torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)).backward()
    text = out.getvalue()
    assert "w,  # w" in text and "# grad of w" in text and "# cotangent of output" in text


def test_nop_is_the_default_compiler():
    f = aotgrad.aot_function(lambda x: x.cos(), nop, nop)
    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, -x.detach().sin())


def test_compilers_get_ordinary_graph_modules_while_inspected_graphs_generate_code_on_demand():
    # Note [Code on demand]: a compiler reading gm.forward's source sees the graph's code.
    sources = []

    def reading(gm, _):
        sources.append(inspect.getsource(gm.forward))
        return gm

    f = aotgrad.aot_function(lambda x, w: (x @ w).relu().sum(), reading)
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    f(x, w).backward()
    torch.testing.assert_close(w.grad, x.t() @ ((x @ w) > 0).to(x.dtype))
    assert "aten.mm.default(x, w)" in sources[0] and "aten.mm.default" in sources[1]
    traced = aotgrad.trace(lambda x, w: (x @ w).relu().sum(), x, w)
    assert "aten.mm.default(x, w)" in traced.joint.code  # generated when asked for
    assert traced.forward(x, w)[0].item() == pytest.approx((x @ w).relu().sum().item())


def test_inductor_training_step_of_the_transformer_matches_eager():
    torch.manual_seed(0)
    model = GPT(blocks=4, dim=64, heads=4, context=32)
    compiled_model = copy.deepcopy(model)
    idx, targets = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    compiled = aotgrad.aot_module(compiled_model, inductor, inductor)
    loss = compiled(idx, targets)
    loss.backward()
    eager = model(idx, targets)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_cache_info_counts_hits_and_names_the_failed_guard():
    f = aotgrad.aot_function(lambda x: x.sin())
    f(torch.ones(4, 8))
    f(torch.ones(4, 8))
    f(torch.ones(4, 16))
    f(torch.ones(4, 16, dtype=torch.float64))
    info = aotgrad.cache_info(f)
    assert (info.hits, info.misses, info.entries) == (1, 3, 3)
    assert info.reasons == [
        "first call",
        "input x: shape (4, 8) != (4, 16)",
        "input x: dtype torch.float32 != torch.float64",
    ]


def test_the_last_entry_answers_exactly_like_the_full_key():
    # Note [The last entry]: after a hit the next call is checked by a guard on
    # its tensors; every change the full key would see must still miss.
    def f(x, w):
        return (x @ w).relu() * 2

    g = aotgrad.aot_function(f)
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    g(x, w)
    g(x, w)  # a hit: now the last entry
    calls = [
        (torch.randn(4, 4), w),  # same fields: the last entry
        (x.double(), w.double()),  # dtype
        (x, w.detach()),  # requires_grad
        (x.t(), w),  # a view with other strides
        (torch.randn(5, 4)[1:], w),  # a view with an offset
        (w, w),  # the same tensor twice
    ]
    for args in calls:
        out, expected = g(*args), f(*args)
        torch.testing.assert_close(out, expected)
        assert out.requires_grad == expected.requires_grad
    with torch.no_grad():
        assert not g(x, w).requires_grad
    info = aotgrad.cache_info(g)
    assert info.hits == 2 and info.misses == 7, info


def test_straight_line_code_calls_kernels_and_frees_values():
    traced = aotgrad.trace(lambda x, w: (x @ w).relu().sum(), torch.ones(2, 2), torch.ones(2, 2))
    source, _ = aotgrad.runtime.straight_line.straight_line_source(traced.forward)
    assert "aten_mm_default(x, w)" in source and "torch.ops" not in source
    assert "mm = None" in source  # freed after its last use, like the GraphModule


def _straight_line_sources() -> int:
    return sum(name.startswith("<aotgrad straight-line") for name in linecache.cache)


def test_dropped_compiled_functions_leave_no_source_lines():
    """Note [Source lines of generated code]: 400 dropped functions once left 779 entries."""

    def compile_and_drop(i: int) -> None:
        f = aotgrad.aot_function(lambda x: (x * (i + 1)).sin(), disk_cache=False)
        f(torch.ones(3, requires_grad=True)).sum().backward()
        assert _straight_line_sources() >= 2  # forward and backward, while f lives

    compile_and_drop(0)
    gc.collect()
    before = _straight_line_sources()
    for i in range(20):
        compile_and_drop(i)
    gc.collect()
    assert _straight_line_sources() == before


def test_a_straight_line_graph_shows_its_source_while_its_code_lives():
    traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2))
    forward = aotgrad.runtime.straight_line.straight_line(traced.forward)
    with pytest.raises(ValueError) as raised:
        forward([])  # its first line unpacks the inputs
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert [t.line for t in frames if t.filename.startswith("<aotgrad straight-line")] == [
        "x, = args"
    ]
    (name,) = {t.filename for t in frames if t.filename.startswith("<aotgrad straight-line")}
    del forward, raised, frames
    gc.collect()
    assert name not in linecache.cache


def test_cache_info_on_modules_names_parameters_and_modes():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    compiled = aotgrad.aot_module(model)
    compiled(torch.ones(1, 2))
    model[0].weight.requires_grad_(False)
    compiled(torch.ones(1, 2))
    model.eval()
    compiled(torch.ones(1, 2))
    assert aotgrad.cache_info(compiled).reasons[1:] == [
        "param 0.weight: requires_grad True != False",
        "a module switched between train() and eval() (closure self.training: value True != False)",
    ]


def test_a_full_cache_warns_and_runs_eagerly():
    f = aotgrad.aot_function(lambda x, n: x * n, cache_limit=2)
    f(torch.ones(2), 1)
    f(torch.ones(2), 2)
    with pytest.warns(UserWarning, match=r"cache_limit.*input n: value 2 != 3"):
        out = f(torch.ones(2), 3)
    torch.testing.assert_close(out, torch.full((2,), 3.0))
    assert aotgrad.cache_info(f).fallbacks == 1


def test_double_backward_works_and_tracing_the_gradient_too():
    f = aotgrad.aot_function(lambda x: x.sin().sum())
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)  # docs/higher-order.md
    torch.testing.assert_close(torch.autograd.grad(g.sum(), x)[0], -x.sin().detach())

    def first_derivative(x):
        return torch.autograd.grad(x.sin().sum(), x, create_graph=True)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verify(first_derivative, x)
