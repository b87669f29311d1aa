"""bench/memory.py (issue 30): the peak-memory sweep against PyTorch, on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory
from memory import Curve, Point


def tiny_step() -> memory.Step:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)
    )
    loss = memory.WithLoss(model, lambda out: out.pow(2).mean())
    return memory.Step("tiny", loss, (torch.randn(64, 32),), {})


def test_sweep_measures_both_sides_and_reports_rows():
    curve = memory.sweep(tiny_step())
    assert [p.budget for p in curve.pytorch] == list(memory.FRACTIONS)
    assert all(p.peak and p.peak > 0 for p in curve.pytorch)
    # aotgrad ran at each peak PyTorch measured, or says why it could not.
    assert [p.budget for p in curve.aotgrad] == [p.peak for p in curve.pytorch]
    assert all((p.peak is None) == (p.refused is not None) for p in curve.aotgrad)
    found = curve.as_json()
    assert isinstance(found["peak_ratio_at_equal_flops"], float)
    assert isinstance(found["aotgrad_monotone"], bool)
    assert isinstance(found["pytorch_monotone"], bool)

    sys.path.insert(0, str(Path(memory.__file__).parent))
    import run

    rows = run.memory_rows({"tiny": curve})
    assert [r["target"] for r in rows] == ["<= 1.00", "within 2%", "yes"]
    assert rows[2]["aotgrad"] == ("yes" if curve.aotgrad_monotone else "no")
    assert abs(rows[1]["ratio"] - 1) <= 0.02  # predicted = measured on the tiny model too
    assert "| tiny predicted peak / measured peak, worst plan | " in run.table(
        {**_header(), "rows": rows}
    )
    assert "| tiny measured peak monotone in the budget |" in run.table({**_header(), "rows": rows})


def _header() -> dict[str, str]:
    return {"machine": "test", "date": "today"}


def test_a_step_that_computes_no_gradient_fails_the_sweep():
    """A side whose step runs no backward into the parameters must not be measured."""
    step = tiny_step()

    def no_backward(x: torch.Tensor) -> torch.Tensor:
        return step.module(x).detach().requires_grad_()

    no_backward(*step.args)
    with pytest.raises(AssertionError, match=r"computed no gradient for model\.0\.weight"):
        step.measure(no_backward)


def test_pytorch_side_runs_its_backward():
    step = tiny_step()
    peak, flops = step.pytorch(0.5)  # checks every gradient against eager's
    assert peak > 0
    assert all(p.grad is None for _, p in step.params())  # left as it found them
    # Its FLOPs are a whole step's: a forward alone would count a third of them.
    assert flops >= memory.step_flops(lambda: step.module(*step.args).backward())


def test_flops_of_a_compiled_step_are_eagers():
    """FlopCounterMode's global module hooks would make aotgrad recapture under the counter,
    and count the capture's fake ops: save_all's FLOPs would be twice eager's."""
    step = tiny_step()
    eager = memory.step_flops(lambda: step.module(*step.args).backward())
    _, flops, _ = step.aotgrad("save_all")  # raises if the counted step recaptured
    assert flops == eager


def test_monotone_and_ratio_at_equal_flops():
    def curve(aotgrad: tuple[Point, ...]) -> Curve:
        pytorch = (Point(0.1, 100, 50), Point(0.5, 150, 10), Point(0.9, 200, 0))
        return Curve("m", pytorch, aotgrad, save_all_peak=300, save_all_flops=1000)

    good = curve((Point(100, 90, 40), Point(150, 140, 10), Point(200, 190, 0)))
    assert good.aotgrad_monotone and good.pytorch_monotone
    worst = good.worst_at_equal_flops
    assert worst.ratio == pytest.approx(0.95) and worst.pytorch.budget == 0.9
    # An aotgrad plan may stand in for a PyTorch point with more recompute.
    few = curve((Point(100, 95, 0), Point(150, None, None, "below"), Point(200, 190, 0)))
    assert few.worst_at_equal_flops.ratio == pytest.approx(0.95)
    assert not few.aotgrad_monotone  # refused above a budget that had a plan
    falling = curve((Point(100, 90, 40), Point(150, 80, 50), Point(200, 190, 0)))
    assert not falling.aotgrad_monotone
    # No aotgrad plan recomputes as little as PyTorch's 0.9 point: infinitely worse.
    none = curve((Point(100, 90, 40), Point(150, 140, 10), Point(200, 190, 5)))
    assert none.worst_at_equal_flops.ratio == float("inf")
    assert none.worst_at_equal_flops.aotgrad is None
