"""Forward mode and torch.func through compiled functions (issue 18), against eager.

- JVP of mlp8 with dual tensors: aotgrad + Inductor runs a captured JVP graph (Note [Forward
  mode captures a JVP graph]); the reference is the eager module on the same dual tensors.
- ``torch.func.grad`` of mlp8's loss over an ``aot_module``: the function runs eagerly under
  the transform (Note [Transforms run the function]); the reference is eager ``grad``, so the
  ratio shows what that path costs (about nothing) and gains (nothing).

Median seconds per call, the two alternating call by call so machine noise hits both.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

import aotgrad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import make


def _jvp(model: Callable[..., torch.Tensor], x: torch.Tensor, tangent: torch.Tensor) -> Any:
    with fwAD.dual_level():
        return fwAD.unpack_dual(model(fwAD.make_dual(x, tangent))).tangent


def _grad(model: Callable[..., torch.Tensor], x: torch.Tensor) -> Any:
    return torch.func.grad(lambda x: model(x))(x)


def _median_seconds(
    calls: dict[str, Callable[[], Any]], warmup: int, rounds: int
) -> dict[str, float]:
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(warmup: int = 3, rounds: int = 20) -> dict[str, dict[str, float]]:
    """``{"jvp": {"aotgrad_inductor", "eager"}, "grad": {"aotgrad", "eager"}}`` in seconds."""
    model, (x,) = make("mlp8")
    model.requires_grad_(False)
    tangent = torch.randn_like(x)
    inductor = aotgrad.aot_module(
        copy.deepcopy(model), aotgrad.compilers.inductor, aotgrad.compilers.inductor
    )
    jvp = _median_seconds(
        {
            "aotgrad_inductor": lambda: _jvp(inductor, x, tangent),
            "eager": lambda: _jvp(model, x, tangent),
        },
        warmup,
        rounds,
    )
    assert aotgrad.cache_info(inductor).jvp_runs > 0, "the JVP graph did not run"
    compiled = aotgrad.aot_module(copy.deepcopy(model))
    grad = _median_seconds(
        {"aotgrad": lambda: _grad(compiled, x), "eager": lambda: _grad(model, x)}, warmup, rounds
    )
    return {"jvp": jvp, "grad": grad}


if __name__ == "__main__":
    print(measure())
