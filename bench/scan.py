"""``scan_layers`` over the 12 blocks of gpt12 against the unrolled blocks (issue 14).

Capture: the first call (forward and backward, on a 1 x 8 activation, so that the
step itself costs ~ms) of ``scan_layers`` against
``aot_module`` of the unrolled blocks and PyTorch's ``aot_function`` over
``functional_call`` of them, each on fresh modules, the best of ``repeats``.
Training step: forward and backward of the blocks, interleaved, best of rounds.
Saved bytes: what ``checkpoint=True`` keeps (the inputs, parameters, cost nothing
new) against the carries plus one body's saved values.
Peak budgets (issue 42): ``budget(peak=)`` over the 12 blocks, its predicted step peak
(``step_peak``) against ``measure_peak`` of the step, at save_all's peak, the midpoint and the
family's floor, with and without checkpoint; and its planning time (first call with the budget
minus first call with save_all, fresh blocks) for 12 blocks against 1.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from bench_models import make
from functorch.compile import aot_function, default_partition

import aotgrad
from aotgrad.errors import PartitionError
from aotgrad.testing import measure_peak


class Unrolled(nn.Module):
    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _blocks(batch: int = 4, length: int = 128) -> tuple[nn.ModuleList, torch.Tensor]:
    """gpt12's blocks and an activation; capture is timed on a small one (its step is ~ms)."""
    model, _ = make("gpt12")
    x = torch.randn(batch, length, 256, requires_grad=True)
    return model.blocks, x  # type: ignore[return-value]


def _step(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    run(x).pow(2).mean().backward()


def _pytorch(blocks: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
    model = Unrolled(blocks)
    params = dict(model.named_parameters())
    compiled = aot_function(
        lambda state, x: torch.func.functional_call(model, state, (x,)),
        fw_compiler=aotgrad.nop,
        partition_fn=default_partition,
    )
    return lambda x: compiled(params, x)


def _capture_seconds(
    make_run: Callable[[nn.ModuleList], Callable[..., Any]], repeats: int
) -> float:
    best = float("inf")
    for _ in range(repeats):
        blocks, x = _blocks(batch=1, length=8)
        start = time.perf_counter()
        _step(make_run(blocks), x)
        best = min(best, time.perf_counter() - start)
    return best


def measure(repeats: int = 3, rounds: int = 5, steps: int = 3) -> dict[str, float]:
    _step(lambda x: aotgrad.scan_layers(_blocks()[0], x), _blocks()[1])  # import and warm up
    found = {
        "capture scan_layers": _capture_seconds(
            lambda b: lambda x: aotgrad.scan_layers(b, x), repeats
        ),
        "capture aot_module": _capture_seconds(lambda b: aotgrad.aot_module(Unrolled(b)), repeats),
        "capture pytorch": _capture_seconds(_pytorch, repeats),
    }
    blocks, x = _blocks()
    unrolled = aotgrad.aot_module(Unrolled(blocks))
    runs = {"step scan_layers": lambda x: aotgrad.scan_layers(blocks, x), "step unrolled": unrolled}
    for name, run in runs.items():
        _step(run, x)
        found[name] = float("inf")
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                _step(run, x)
            found[name] = min(found[name], (time.perf_counter() - start) / steps)
    found.update(_saved_bytes(blocks, x))
    return found


def _saved_bytes(blocks: nn.ModuleList, x: torch.Tensor) -> dict[str, float]:
    inputs = {t.data_ptr() for t in blocks.parameters()} | {x.data_ptr()}
    new: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in inputs:
            new.append(t.untyped_storage().nbytes())
        return t

    aotgrad.scan_layers(blocks, x, checkpoint=True)  # capture outside the hooks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        aotgrad.scan_layers(blocks, x, checkpoint=True)
    traced = aotgrad.scan_layers_function(blocks, checkpoint=True).traced
    body = sum(s.nbytes for s in traced.saved if not s.is_input)
    carries = len(blocks) * x.numel() * x.element_size()
    return {"saved checkpoint": float(sum(new)), "saved carries + one body": float(carries + body)}


def peak_budgets(batch: int = 2, length: int = 64) -> dict[str, float]:
    """Predicted step peak / measured, the worst of six budgets; planning 12 blocks vs 1."""
    worst = (1.0, 1.0)
    for checkpoint in (False, True):
        blocks, x = _blocks(batch, length)
        top, _ = _step_peak(blocks, x, checkpoint, "save_all")
        floor = _floor(blocks, x, checkpoint)
        for peak in (top, (top + floor) // 2, floor):
            found = _step_peak(blocks, x, checkpoint, aotgrad.budget(peak=peak))
            if abs(found[0] / found[1] - 1) >= abs(worst[0] / worst[1] - 1):
                worst = found
    planning = {depth: _planning_seconds(depth, batch, length) for depth in (1, 12)}
    return {
        "peak predicted": worst[0],
        "peak measured": worst[1],
        "planning 12 blocks": planning[12],
        "planning 1 block": planning[1],
    }


def _step_peak(
    blocks: nn.ModuleList, x: torch.Tensor, checkpoint: bool, partition: Any
) -> tuple[float, float]:
    """(predicted, measured) peak of the step: the scan, then its backward (dense cotangent)."""

    def step() -> None:
        h = aotgrad.scan_layers(blocks, x, checkpoint=checkpoint, partition=partition)
        h.backward(torch.ones_like(h))

    step()  # captures and plans
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    measured = measure_peak(step)
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    run = aotgrad.scan_layers_function(blocks, checkpoint=checkpoint, partition=partition)
    return float(run.step_peak.allocated), float(measured)


def _floor(blocks: nn.ModuleList, x: torch.Tensor, checkpoint: bool) -> int:
    """The family's smallest predicted step peak: what budget(peak=0)'s refusal names."""
    try:
        aotgrad.scan_layers(blocks, x, checkpoint=checkpoint, partition=aotgrad.budget(peak=0))
    except PartitionError as e:
        found = re.search(r"smallest predicted step peak of \d+ candidate plans is (\d+)", str(e))
        assert found is not None, str(e)
        return int(found.group(1))
    raise AssertionError("budget(peak=0) fitted")


def _planning_seconds(depth: int, batch: int, length: int, repeats: int = 2) -> float:
    """The first call with a peak budget minus the first call with save_all, fresh blocks."""
    best = float("inf")
    for _ in range(repeats):
        times = []
        for partition in ("save_all", aotgrad.budget(peak=10**12)):
            blocks, x = _blocks(batch, length)
            start = time.perf_counter()
            aotgrad.scan_layers(blocks[:depth], x, partition=partition).sum().backward()
            times.append(time.perf_counter() - start)
        best = min(best, times[1] - times[0])
    return best


if __name__ == "__main__":
    for key, value in peak_budgets().items():
        print(f"{key}: {value:.4g}")
    for key, value in measure().items():
        print(f"{key}: {value:.4g}")
