"""Autocast around compiled functions (Note [Autocast] in ``aotgrad/capture/analyses/autocast.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

import aotgrad

BF16 = torch.bfloat16


def autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=BF16)


def f32_region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w  # bfloat16 under the caller's autocast
    with torch.autocast("cpu", enabled=False):
        return y.float() @ w  # float32: autocast is off here


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g).requires_grad_()


def _run(fn, x, w, under_autocast=True):  # type: ignore[no-untyped-def]
    w = w.detach().clone().requires_grad_()
    if under_autocast:
        with autocast():
            out = fn(x, w)
    else:
        out = fn(x, w)
    out.float().sum().backward()  # outside the region, as PyTorch recommends
    return out, w.grad


def test_region_without_autocast_keeps_its_dtype() -> None:
    # The graphs ran under the caller's autocast: the float32 matmul became a bfloat16 one.
    x, w = _inputs()
    eager_out, eager_grad = _run(f32_region, x, w)
    out, grad = _run(aotgrad.aot_function(f32_region), x, w)
    assert out.dtype == eager_out.dtype == torch.float32
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


def test_autocast_is_part_of_the_cache_key() -> None:
    # Captured without autocast, then called under it: the graph had no casts (it crashed
    # with "expected m1 and m2 to have the same dtype" or computed in the wrong dtype).
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = aotgrad.aot_module(compiled_model)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for _ in range(2):  # the second call under autocast hits the new entry
        with autocast():
            e, c = eager(x), compiled(x)
        assert c.dtype == e.dtype == BF16
        torch.testing.assert_close(c, e, rtol=0, atol=0)
        e.float().sum().backward()
        c.float().sum().backward()
    for p, q in zip(eager.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    info = aotgrad.cache_info(compiled)
    assert info.misses == 2
    assert info.reasons[1] == "autocast off != cpu/bfloat16"


def test_traced_refuses_another_autocast() -> None:
    x, w = _inputs()
    traced = aotgrad.trace(f32_region, x, w)
    with (
        autocast(),
        pytest.raises(
            aotgrad.CallError, match=r"autocast off != cpu/bfloat16 \(the capture's first\)"
        ),
    ):
        traced(x, w)


def test_backward_under_autocast() -> None:
    x, w = _inputs()
    # Its matmuls already run in bfloat16: autocast changes nothing in the backward.
    plain = aotgrad.aot_function(lambda x, w: (x @ w).relu())
    with autocast():
        out = plain(x, w)
        out.float().sum().backward()
    with autocast():
        expected = (x @ w).relu()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # A float32 matmul in the backward would be cast by eager's autocast: refused.
    with autocast():
        out = aotgrad.aot_function(f32_region)(x, w)
        with pytest.raises(aotgrad.AutocastBackwardError, match=r"f32_region|y.float\(\) @ w"):
            out.sum().backward()
