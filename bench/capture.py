"""Capture cost: wrap to both graphs compiled (nop compilers, first forward+backward included).

aotgrad's ``aot_module`` against PyTorch's ``aot_function`` over
``torch.func.functional_call`` (its ``aot_module`` fails on tied weights) with
``default_partition``; plus one forward+backward under ``FakeTensorMode`` with
no tracing (the floor no tracer can beat) and one eager forward+backward on the
real inputs (the first real step, which both tools' captures include). Run as a script it measures one
model in this process: ``python bench/capture.py gpt4 aotgrad``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from functorch.compile import aot_function, default_partition
from torch._subclasses.fake_tensor import FakeTensorMode

import aotgrad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import make

TOOLS = ("aotgrad", "pytorch", "floor", "eager")
# Capture measures a first process: aotgrad's disk cache (on by default) stays off here.
FIRST_CAPTURE = {**os.environ, "AOTGRAD_CACHE": "0"}


def run_fresh(script: str, *argv: str) -> Any:
    """``python script *argv`` in a fresh process with the disk cache off; the JSON value of the
    last line it prints."""
    out = subprocess.run(
        [sys.executable, script, *argv],
        capture_output=True,
        text=True,
        check=True,
        env=FIRST_CAPTURE,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def capture_aotgrad(model: torch.nn.Module, args: tuple[Any, ...]) -> None:
    _loss(aotgrad.aot_module(model)(*args)).backward()


def capture_pytorch(model: torch.nn.Module, args: tuple[Any, ...]) -> None:
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def fn(state: dict[str, torch.Tensor], *inputs: Any) -> Any:
        return torch.func.functional_call(model, state, inputs)

    compiled = aot_function(fn, fw_compiler=aotgrad.nop, partition_fn=default_partition)
    _loss(compiled(params, *args)).backward()


def fake_floor(model: torch.nn.Module, args: tuple[Any, ...]) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) for a in args]
        fake_model = _fake_module(model, mode)
        _loss(fake_model(*fake_args)).backward()


def _fake_module(model: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    import copy

    fake = copy.deepcopy(model)
    for module in fake.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(
                    mode.from_tensor(p.detach()), p.requires_grad
                )
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = mode.from_tensor(b)
    return fake


def eager_step(model: torch.nn.Module, args: tuple[Any, ...]) -> None:
    _loss(model(*args)).backward()


RUN = {
    "aotgrad": capture_aotgrad,
    "pytorch": capture_pytorch,
    "floor": fake_floor,
    "eager": eager_step,
}


def measure(name: str, tool: str) -> dict[str, float]:
    """Cold (first model in this process) and warm (a second, fresh model) seconds."""
    torch.set_num_threads(1)
    times = {}
    for label, seed in (("cold", 0), ("warm", 1)):
        model, args = make(name, seed)
        start = time.perf_counter()
        RUN[tool](model, args)
        times[label] = time.perf_counter() - start
    return times


def measure_in_fresh_processes(name: str, repeats: int) -> dict[str, dict[str, float]]:
    """Per tool, the median over ``repeats`` fresh processes of cold and warm seconds.

    The tools take turns process by process, so a burst of load on this shared
    machine hits them alike instead of one tool's whole series.
    """
    runs: dict[str, list[dict[str, float]]] = {tool: [] for tool in TOOLS}
    for _ in range(repeats):
        for tool in TOOLS:
            runs[tool].append(run_fresh(__file__, name, tool))
    return {
        tool: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("cold", "warm")}
        for tool, rs in runs.items()
    }


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
