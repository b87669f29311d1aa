"""Dynamic shapes: one trace with symbolic sizes serves every size its guards allow."""

from __future__ import annotations

import copy

import pytest
import torch

import aotgrad
from aotgrad.testing import verify
from models import MLP


def test_one_entry_serves_batch_sizes_2_to_64_with_eager_gradients():
    torch.manual_seed(0)
    model = MLP()
    ours = copy.deepcopy(model)
    compiled = aotgrad.aot_module(ours, dynamic=True)
    for batch in (2, 3, 8, 17, 64):
        x = torch.randn(batch, 16)
        out = compiled(x)
        ref = model(x)
        torch.testing.assert_close(out, ref)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
    for p, q in zip(model.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    info = aotgrad.cache_info(compiled)
    assert (info.misses, info.hits, info.entries) == (1, 4, 1)


def test_symbolic_sizes_appear_in_the_graphs_and_signature():
    traced = aotgrad.trace(MLP(), torch.randn(8, 16), dynamic=True)
    assert "sym_size" in traced.forward.code
    sizes = [s for s in traced.saved if s.is_size]
    assert sizes and all(
        str(d).startswith("saved: sym_size") for d in traced.signature.saved if "sym" in str(d)
    )


def test_marked_dimensions_are_dynamic_and_others_specialize():
    f = aotgrad.aot_function(lambda x, w: (x @ w).relu())
    w = torch.randn(16, 4, requires_grad=True)
    for batch in (4, 9, 30):
        x = aotgrad.dynamic(torch.randn(batch, 16), dim=0)
        torch.testing.assert_close(f(x, w), (x @ w).relu())
    assert aotgrad.cache_info(f).entries == 1
    f(aotgrad.dynamic(torch.randn(4, 32), dim=0), torch.randn(32, 4))
    assert aotgrad.cache_info(f).entries == 2  # the unmarked dimension changed


def test_a_size_outside_the_guards_traces_again():
    f = aotgrad.aot_function(lambda x: x.sin() * 2, dynamic=True)
    f(torch.randn(8))
    f(torch.randn(1))  # size 1 is specialized
    assert aotgrad.cache_info(f).entries == 2


def test_dynamic_with_a_view_output_is_refused_clearly():
    with pytest.raises(aotgrad.UnsupportedOutputError, match="dynamic shapes"):
        aotgrad.trace(lambda x: x.view(-1), torch.randn(4, 4, requires_grad=True), dynamic=True)


def test_only_save_all_partitions_dynamic_graphs():
    with pytest.raises(ValueError, match="dynamic"):
        aotgrad.trace(MLP(), torch.randn(8, 16), dynamic=True, partition="mincut")


def test_dynamic_traces_match_eager():
    compile_fn = lambda fn: aotgrad.aot_function(fn, dynamic=True)  # noqa: E731
    verify(
        lambda x: torch.softmax(x * 3, -1),
        torch.randn(5, 7, requires_grad=True),
        compile_fn=compile_fn,
    )
