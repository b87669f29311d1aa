"""Per-call guard cost on a 37-module MLP: reading the lifted state, and whole calls, in ms.

``python bench/guards.py``: for ``aot_module(model)``, ``aot_function(lambda x: model(x))``
(closed over) and ``aot_function(lambda m, x: m(x))`` (module argument), the time of
``State.read`` (walk, value keys, tensor keys) and of a forward call, against eager.
CPU time (``process_time``), best of 30 runs of 500 calls: robust to other processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import aotgrad
from aotgrad.api import AOTFunction


def best_ms(fn: Callable[[], Any], n: int = 500, runs: int = 30) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(18) for m in (nn.Linear(8, 8), nn.ReLU())])
    assert len(list(model.modules())) == 37
    x = torch.randn(4, 8)
    cases: dict[str, tuple[AOTFunction, tuple[Any, ...]]] = {
        "aot_module": (aotgrad.aot_module(model).compiled, (x,)),
        "closed_over": (aotgrad.aot_function(lambda x: model(x)), (x,)),
        "argument": (aotgrad.aot_function(lambda m, x: m(x)), (model, x)),
    }
    for name, (compiled, args) in cases.items():
        compiled(*args)
        arguments = (("m", model),) if name == "argument" else ()
        read = best_ms(lambda c=compiled, a=arguments: c._state.read(a))
        call = best_ms(lambda c=compiled, a=args: c(*a))
        print(f"{name:12s} read {read:.3f} ms   call {call:.3f} ms")
    print(f"{'eager':12s} call {best_ms(lambda: model(x)):.3f} ms")


if __name__ == "__main__":
    main()
