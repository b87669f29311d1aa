"""Per-call overhead on ``f(x, w) = (x @ w).relu().sum()`` with 8×8 inputs, in microseconds."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import aot_function

import aotgrad


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu().sum()


def bare_function(x: torch.Tensor, w: torch.Tensor) -> Callable[..., Any]:
    """A bare autograd.Function running aotgrad's own compiled graphs: the floor for any wrapper.

    The graphs go through the same compiler aotgrad's wrapper uses (``nop``:
    straight-line code), so the ratio measures the wrapper alone.
    """
    traced = aotgrad.trace(f, x, w)
    assert traced.backward is not None
    forward = aotgrad.nop(traced.forward, [])
    backward = aotgrad.nop(traced.backward, [])

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out, *saved = forward([x, w])
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            return tuple(backward([*ctx.saved_tensors, grad]))

    return Bare.apply


def per_call_us(
    fn: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, backward: bool, n: int = 1000
) -> float:
    """Microseconds per call over ``n`` calls (one round)."""
    start = time.perf_counter()
    for _ in range(n):
        out = fn(x, w)
        if backward:
            out.backward()
    return (time.perf_counter() - start) / n * 1e6


def interleaved(
    tools: dict[str, Callable[..., Any]], x: torch.Tensor, w: torch.Tensor, backward: bool
) -> dict[str, float]:
    """Best round per tool, the tools taking turns round by round so noise hits them alike."""
    best = dict.fromkeys(tools, float("inf"))
    for fn in tools.values():
        per_call_us(fn, x, w, backward, n=200)  # warm up
    for _ in range(15):
        for name, fn in tools.items():
            best[name] = min(best[name], per_call_us(fn, x, w, backward))
    return best


def measure() -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    tools = {
        "eager": f,
        "aotgrad": aotgrad.aot_function(f, disk_cache=False),  # a trace, as in make bench
        "pytorch": aot_function(f, fw_compiler=aotgrad.nop),
        "bare": bare_function(x, w),
    }
    return {
        phase: interleaved(tools, x, w, backward=phase == "forward+backward")
        for phase in ("forward", "forward+backward")
    }


def steps() -> dict[str, float]:
    """Microseconds of each step of a warm forward call (Note [Where a call's microseconds go]).

    Each step is timed alone, the steps taking turns round by round (best round);
    a step's time includes the steps it calls.
    """
    from aotgrad._torch_compat import FUNCTION_BASE_APPLY
    from aotgrad.cache.specializations import common_state

    torch.set_num_threads(1)
    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    compiled = aotgrad.aot_function(f, disk_cache=False)
    compiled(x, w)
    compiled(x, w)  # now the last entry (Note [The last entry])
    cache, args = compiled.cache, (x, w)
    last = cache._last
    assert last is not None
    (entry,) = cache.entries.values()
    graphs = entry.compiled
    assert graphs._function is not None
    raw = FUNCTION_BASE_APPLY.__get__(None, graphs._function)
    bare = bare_function(x, w)
    bare_raw = FUNCTION_BASE_APPLY.__get__(None, bare.__self__)  # type: ignore[attr-defined]
    calls: dict[str, Callable[[], Any]] = {
        "the whole call": lambda: compiled(x, w),
        "last_entry (common_state + guard)": lambda: cache.last_entry(args),
        "common_state": common_state,
        "guard": lambda: last.guard.passes(args),
        "the direct call (lambda + C++ apply)": lambda: last.call(args),
        "the Function, C++ apply": lambda: raw(x, w),
        "bare Function.apply": lambda: bare(x, w),
        "bare Function, C++ apply": lambda: bare_raw(x, w),
    }
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(30):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(2000):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / 2000 * 1e6)
    return best


def main() -> None:
    """``python bench/overhead.py``: microseconds per call and the ratios the bench rows check;
    ``python bench/overhead.py steps``: where a warm call's microseconds go."""
    if sys.argv[1:] == ["steps"]:
        for name, us in steps().items():
            print(f"{name:40} {us:6.2f}")
        return
    calls = measure()
    for phase, numbers in calls.items():
        times = "  ".join(f"{name} {us:6.2f}" for name, us in numbers.items())
        print(
            f"{phase:17} {times}  aotgrad/bare {numbers['aotgrad'] / numbers['bare']:.3f}", end=""
        )
        if phase == "forward":
            print(f"  aotgrad/pytorch {numbers['aotgrad'] / numbers['pytorch']:.3f}", end="")
        print()


if __name__ == "__main__":
    main()
