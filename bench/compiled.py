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


def step_seconds(step: Any, args: tuple[Any, ...], warmup: int = 3, steps: int = 10) -> float:
    for _ in range(warmup):
        step(*args).backward()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(*args).backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure() -> dict[str, float]:
    model, args = make("gpt4")
    ours = aotgrad.aot_module(
        copy.deepcopy(model), aotgrad.compilers.inductor, aotgrad.compilers.inductor
    )
    theirs = torch.compile(copy.deepcopy(model))
    return {
        "aotgrad_inductor": step_seconds(ours, args),
        "torch_compile": step_seconds(theirs, args),
    }
