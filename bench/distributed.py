"""One FSDP2 training step on 2 gloo processes: aotgrad + Inductor vs ``torch.compile`` (Inductor).

Each rank trains two copies of the same ``fully_shard`` MLP (one unit per layer, and the root),
one per tool, alternating step by step so noise hits both; a step is forward, backward (with
FSDP2's all-gathers and reduce-scatters) and an SGD step. Rank 0's medians are reported.

    python bench/distributed.py      # prints {"aotgrad_inductor": s, "torch_compile": s}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

WIDTH, LAYERS, BATCH = 256, 4, 64


def _model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def _step(run: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start = time.perf_counter()
    run(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def rank_medians(warmup: int, steps: int) -> dict[str, float]:
    """On one rank: median seconds per training step of each tool."""
    import aotgrad

    torch.set_num_threads(1)
    inductor = aotgrad.compilers.inductor
    tools: dict[str, Any] = {}
    for name in ("aotgrad_inductor", "torch_compile"):
        model = _model()
        run = aotgrad.aot_module(model, inductor, inductor) if name == "aotgrad_inductor" else None
        run = run if run is not None else torch.compile(model)
        tools[name] = (run, torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(BATCH, WIDTH)
    for run, opt in tools.values():
        for _ in range(warmup):
            _step(run, opt, x)
    times: dict[str, list[float]] = {name: [] for name in tools}
    for _ in range(steps):
        for name, (run, opt) in tools.items():
            times[name].append(_step(run, opt, x))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def measure(warmup: int = 3, steps: int = 20) -> dict[str, float]:
    """Rank 0's median seconds per FSDP2 training step, by tool (2 gloo processes)."""
    from multiproc import run_ranks

    return dict(run_ranks(rank_medians, warmup, steps, timeout=900)[0])


if __name__ == "__main__":
    print(measure())
