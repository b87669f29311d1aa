"""Compiled speed: a 4-block GPT training step, aotgrad + Inductor vs ``torch.compile``."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

import aotgrad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import make


def _one_step(step: Any, args: tuple[Any, ...]) -> float:
    start = time.perf_counter()
    step(*args).backward()
    return time.perf_counter() - start


def measure(warmup: int = 3, steps: int = 20) -> dict[str, float]:
    """Median seconds per training step; the tools alternate step by step (noise hits both)."""
    model, args = make("gpt4")
    tools = {
        "aotgrad_inductor": aotgrad.aot_module(
            copy.deepcopy(model), aotgrad.compilers.inductor, aotgrad.compilers.inductor
        ),
        "torch_compile": torch.compile(copy.deepcopy(model)),
    }
    times: dict[str, list[float]] = {name: [] for name in tools}
    for step in tools.values():
        for _ in range(warmup):
            _one_step(step, args)
    for _ in range(steps):
        for name, step in tools.items():
            times[name].append(_one_step(step, args))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
