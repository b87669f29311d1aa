"""Per-call overhead on ``f(x, w) = (x @ w).relu().sum()`` with 8×8 inputs, in microseconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import aot_function

import aotgrad


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu().sum()


def bare_function(x: torch.Tensor, w: torch.Tensor) -> Callable[..., Any]:
    """A bare autograd.Function running aotgrad's own graphs: the floor for any wrapper."""
    traced = aotgrad.trace(f, x, w)
    forward, backward = traced.forward.forward, traced.backward.forward  # type: ignore[union-attr]

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out, *saved = forward(x, w)
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            return tuple(backward(*ctx.saved_tensors, grad))

    return Bare.apply


def per_call_us(
    fn: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, backward: bool, n: int = 2000
) -> float:
    for _ in range(200):
        out = fn(x, w)
        if backward:
            out.backward()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            out = fn(x, w)
            if backward:
                out.backward()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def measure() -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    tools = {
        "eager": f,
        "aotgrad": aotgrad.aot_function(f),
        "pytorch": aot_function(f, fw_compiler=aotgrad.nop),
        "bare": bare_function(x, w),
    }
    return {
        phase: {
            name: per_call_us(fn, x, w, backward=phase == "forward+backward")
            for name, fn in tools.items()
        }
        for phase in ("forward", "forward+backward")
    }
