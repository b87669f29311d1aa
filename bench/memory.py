"""Measured peak memory along the budget curve: aotgrad against PyTorch (issue 30, item 4).

For each model, PyTorch's AOTAutograd (``min_cut_rematerialization_partition``) runs at
``activation_memory_budget`` 0.1, 0.3, 0.5, 0.7 and 0.9, and aotgrad at a peak budget equal
to each peak PyTorch measured. Every point is one compiled training step,
``fn(*args, **kwargs).backward()`` with the loss inside ``fn``, run once to warm up (the
capture is not measured) and then measured twice with every ``.grad`` set to None: its
peak by :func:`aotgrad.testing.measure_peak`, its FLOPs by PyTorch's ``FlopCounterMode``.
A point's recompute FLOPs are its step's FLOPs minus those of aotgrad's ``save_all`` step
of the same model (both sides alike). Every measured step's gradients are checked against
eager's: a side that silently ran no backward, or another one, fails the run.

Models: the benchmark GPT (4 blocks, untied head), and three library models from
``tests/library_models.py`` at a larger batch: BERT, timm's ConvNeXt, torchvision's ResNet-18
(its BatchNorms on batch statistics only: see :func:`batch_statistics_only`). Rows: aotgrad's
measured peak over PyTorch's at no more recompute FLOPs (worst over PyTorch's points), and
whether each side's peak is monotone in its budget.

As a script: ``python bench/memory.py`` runs the sweep, prints it and writes
``bench/memory.png``; ``bench/run.py`` (``make bench``) turns it into README rows.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from functorch.compile import aot_module, make_boxed_func, min_cut_rematerialization_partition
from torch.utils.flop_counter import FlopCounterMode

import aotgrad
from aotgrad.capture.tracing.joint import compiling
from aotgrad.testing import measure_peak

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
# First-process work, as every benchmark: no plan comes from an earlier run's disk cache.
os.environ["AOTGRAD_CACHE"] = "0"

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)  # PyTorch's activation_memory_budget values
MODELS = ("gpt4", "bert", "convnext", "resnet18")
# Library models at a batch (and sequence) that puts their peaks at a few MB.
LIBRARY_SIZES = {"bert": (64, 32), "convnext": (64, 0), "resnet18": (32, 0)}
# An aotgrad point "recomputes no more" than a PyTorch point within this relative slack.
FLOP_SLACK = 0.01


@dataclass(frozen=True)
class Point:
    """One plan's measured step."""

    # PyTorch: its activation_memory_budget fraction; aotgrad: its peak budget in bytes.
    budget: float
    # Bytes the step allocated at its peak (Note [Measured peak]); None when refused.
    peak: int | None
    # FLOPs of the step beyond the model's save_all step; None when refused.
    recompute_flops: int | None
    # Why there is no plan at this budget (aotgrad's ValueError: below its smallest peak).
    refused: str | None = None
    # aotgrad's predicted peak of the same step (``Partitioned.peak.allocated``).
    predicted: int | None = None


@dataclass(frozen=True)
class Comparison:
    """aotgrad's measured peak against one PyTorch point's, at no more recompute FLOPs."""

    # aotgrad's peak / PyTorch's; infinite when no aotgrad point recomputes as little.
    ratio: float
    pytorch: Point
    # aotgrad's lowest-peak point within PyTorch's recompute FLOPs; None when there is none.
    aotgrad: Point | None


@dataclass(frozen=True)
class Curve:
    """One model's sweep: PyTorch's points by fraction, aotgrad's at PyTorch's peaks."""

    model: str
    pytorch: tuple[Point, ...]
    aotgrad: tuple[Point, ...]
    # The model's save_all step, the zero of recompute FLOPs.
    save_all_peak: int
    save_all_flops: int
    seconds: float = 0.0
    save_all_predicted: int | None = None

    @property
    def worst_prediction(self) -> float:
        """aotgrad's predicted peak over its measured one, farthest from 1 over its points
        (save_all's included)."""
        pairs = [(p.predicted, p.peak) for p in self.aotgrad if p.peak is not None]
        pairs.append((self.save_all_predicted, self.save_all_peak))
        ratios = [pred / peak for pred, peak in pairs if pred is not None and peak]
        return max(ratios, key=lambda r: abs(r - 1.0), default=float("nan"))

    @property
    def worst_at_equal_flops(self) -> Comparison:
        """The PyTorch point where aotgrad's peak over PyTorch's is largest.

        For each PyTorch point, aotgrad's answer is its lowest measured peak among its
        points recomputing no more FLOPs (FLOP_SLACK); when none does, the ratio is infinite.
        """
        worst: Comparison | None = None
        for theirs in self.pytorch:
            assert theirs.peak is not None and theirs.recompute_flops is not None
            ours = _lowest_peak_within(self.aotgrad, theirs.recompute_flops)
            ratio = float("inf") if ours is None else ours.peak / theirs.peak  # type: ignore[operator]
            if worst is None or ratio > worst.ratio:
                worst = Comparison(ratio, theirs, ours)
        assert worst is not None
        return worst

    @property
    def aotgrad_monotone(self) -> bool:
        return is_monotone(self.aotgrad)

    @property
    def pytorch_monotone(self) -> bool:
        return is_monotone(self.pytorch)

    def as_json(self) -> dict[str, Any]:
        return {
            "pytorch": [vars(p) for p in self.pytorch],
            "aotgrad": [vars(p) for p in self.aotgrad],
            "save_all_peak": self.save_all_peak,
            "save_all_flops": self.save_all_flops,
            "peak_ratio_at_equal_flops": self.worst_at_equal_flops.ratio,
            "predicted_over_measured": self.worst_prediction,
            "aotgrad_monotone": self.aotgrad_monotone,
            "pytorch_monotone": self.pytorch_monotone,
            "seconds": self.seconds,
        }


def _lowest_peak_within(points: Sequence[Point], flops: int) -> Point | None:
    fits = [
        p
        for p in points
        if p.peak is not None
        and p.recompute_flops is not None
        and p.recompute_flops <= flops * (1 + FLOP_SLACK)
    ]
    return min(fits, key=lambda p: p.peak or 0, default=None)


def is_monotone(points: Sequence[Point]) -> bool:
    """Measured peak never falls as the budget grows, and no budget is refused above one
    that had a plan."""
    planned = False
    last = -1
    for p in sorted(points, key=lambda p: p.budget):
        if p.peak is None:
            if planned:
                return False
            continue
        planned = True
        if p.peak < last:
            return False
        last = p.peak
    return True


# ---------------------------------------------------------------- one model's step


class WithLoss(nn.Module):
    """The model and its loss as one module: what both sides capture, loss included."""

    def __init__(self, model: nn.Module, loss: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss(self.model(*args, **kwargs))


class _NoModules:
    """FlopCounterMode's module tracker, without its global module hooks.

    ``FlopCounterMode`` registers global forward hooks to attribute FLOPs to modules; an
    aotgrad function reads those hooks (they run around the module), so under the counter
    it would recapture, and the fake tensors of that capture would be counted as the step's.
    Only the "Global" total is read here. Should a torch release rename ``mod_tracker``, the
    hooks come back and :meth:`Step.aotgrad`'s recapture check fails the run.
    """

    parents = frozenset({"Global"})

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def step_flops(step: Callable[[], object]) -> int:
    """FLOPs of ``step()`` by PyTorch's ``FlopCounterMode`` (matmuls, convolutions, attention)."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModules()  # type: ignore[assignment]
    with counter:
        step()
    return counter.get_total_flops()


@dataclass
class Step:
    """A model's training step, measured the same way whatever runs it."""

    name: str
    module: WithLoss
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # Eager's gradients, by parameter name: what every measured step must reproduce.
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._zero_grads()
        self.module(*self.args, **self.kwargs).backward()
        self.grads = {n: p.grad.clone() for n, p in self.params() if p.grad is not None}
        if not self.grads:
            raise AssertionError(f"{self.name}: eager computed no gradient")

    def params(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    def _zero_grads(self) -> None:
        for _, p in self.params():
            p.grad = None

    def _run(self, fn: Callable[..., torch.Tensor]) -> None:
        self._zero_grads()
        fn(*self.args, **self.kwargs).backward()

    def measure(self, fn: Callable[..., torch.Tensor]) -> tuple[int, int]:
        """(measured peak bytes, FLOPs) of ``fn``'s step; ``fn`` was called once already."""
        self._zero_grads()
        peak = measure_peak(lambda: self._run(fn))
        self._check_grads(fn)
        flops = step_flops(lambda: self._run(fn))
        self._check_grads(fn)
        self._zero_grads()
        return peak, flops

    def _check_grads(self, fn: object) -> None:
        for name, p in self.params():
            if name not in self.grads:
                continue
            if p.grad is None:
                raise AssertionError(f"{self.name}: {fn} computed no gradient for {name}")
            close = torch.allclose(p.grad, self.grads[name], rtol=1e-3, atol=1e-5)
            if not close:
                raise AssertionError(f"{self.name}: {fn}'s gradient of {name} is not eager's")

    # ---- the two sides

    def pytorch(self, fraction: float) -> tuple[int, int]:
        """PyTorch's min-cut partitioner at ``activation_memory_budget=fraction``: (measured
        peak, FLOPs) of its step."""
        with functorch_config.patch(activation_memory_budget=fraction):
            fn = aot_module(
                self.module,
                fw_compiler=_boxed_nop,
                bw_compiler=_boxed_nop,
                partition_fn=min_cut_rematerialization_partition,
            )
            # The capture, with the budget in force. transformers' mask code takes its
            # traceable branch only when told it is being compiled, as aotgrad's capture does
            # (Note [Capture is compiling]).
            with compiling():
                self._run(fn)
        return self.measure(fn)

    def aotgrad(self, partition: Any) -> tuple[int, int, int]:
        """aotgrad with ``partition``: (measured peak, FLOPs, predicted peak) of its step."""
        fn = aotgrad.aot_function(self.module, partition=partition)
        self._run(fn)
        peak, flops = self.measure(fn)
        info = aotgrad.cache_info(fn)
        if info.misses != 1:  # the measured steps ran what the warm-up captured
            raise AssertionError(f"{self.name}: aotgrad recaptured while measured: {info}")
        assert fn.partitioned is not None
        return peak, flops, fn.partitioned.peak.allocated


def _boxed_nop(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    return make_boxed_func(gm)


def make_step(name: str) -> Step:
    """The sweep's models: the benchmark GPT (4 blocks, untied head) or a library model."""
    if name == "gpt4":
        from bench_models import make

        model, args = make("gpt4")
        # PyTorch's aot_module rejects tied weights: both sides run an untied copy.
        model.head.weight = nn.Parameter(model.tok.weight.detach().clone())  # type: ignore[union-attr]
        return Step(name, WithLoss(model, lambda loss: loss), args, {})
    from library_models import build

    case = build(name)
    batch, seq = LIBRARY_SIZES[name]
    args, kwargs = case.resized(batch, seq)
    if name == "resnet18":
        batch_statistics_only(case.model)
    return Step(name, WithLoss(case.model, case.loss), args, kwargs)


def batch_statistics_only(model: nn.Module) -> None:
    """BatchNorm layers normalizing by batch statistics, without running ones to update.

    With running statistics, PyTorch's min-cut at any ``activation_memory_budget`` below 1
    recomputes a BatchNorm in the backward, so saves the running statistic it reads, which
    its epilogue then updates in place: the backward fails on the version counter ("one of
    the variables needed for gradient computation has been modified by an inplace
    operation", torch 2.13). The training-mode math is the same either way.
    """
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None


# ---------------------------------------------------------------- aotgrad's plan at a peak


def _aotgrad_plan_at_peak(step: Step, peak: int) -> Any:
    """aotgrad's minimum-recompute plan whose peak is at most ``peak`` bytes (ValueError when
    none is)."""
    return aotgrad.budget(peak=peak)


def aotgrad_at(step: Step, peak: int, save_all_flops: int) -> Point:
    """aotgrad's plan at a peak budget of ``peak`` bytes, measured; or why it has none."""
    try:
        partition = _aotgrad_plan_at_peak(step, peak)
        measured, flops, predicted = step.aotgrad(partition)
    except ValueError as e:  # the budget is below aotgrad's smallest peak
        return Point(peak, None, None, refused=str(e).splitlines()[0])
    return Point(peak, measured, flops - save_all_flops, predicted=predicted)


# ---------------------------------------------------------------- the sweep


def sweep(step: Step) -> Curve:
    """PyTorch at every fraction, then aotgrad at every peak PyTorch measured."""
    start = time.perf_counter()
    save_all_peak, save_all_flops, save_all_predicted = step.aotgrad("save_all")
    theirs = []
    for fraction in FRACTIONS:
        peak, flops = step.pytorch(fraction)
        theirs.append(Point(fraction, peak, flops - save_all_flops))
    at: dict[int, Point] = {}  # PyTorch's fractions often meet at one peak: one plan per peak
    for p in theirs:
        assert p.peak is not None
        if p.peak not in at:
            at[p.peak] = aotgrad_at(step, p.peak, save_all_flops)
    return Curve(
        model=step.name,
        pytorch=tuple(theirs),
        aotgrad=tuple(at[p.peak] for p in theirs if p.peak is not None),
        save_all_peak=save_all_peak,
        save_all_flops=save_all_flops,
        seconds=time.perf_counter() - start,
        save_all_predicted=save_all_predicted,
    )


def run(models: Sequence[str] = MODELS) -> dict[str, Curve]:
    """Every model's curves, by name."""
    return {name: sweep(make_step(name)) for name in models}


def plot(curves: dict[str, Curve], path: str | Path) -> None:
    """Two panels: measured peak against the budget, and recompute FLOPs against measured peak.

    The budget axis is PyTorch's point index: at index i PyTorch ran at fraction
    ``FRACTIONS[i]``, and aotgrad at a peak budget of what PyTorch's point i measured.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, curve), colour in zip(curves.items(), colours, strict=False):
        for side, points, style in (
            ("PyTorch", curve.pytorch, "--o"),
            ("aotgrad", curve.aotgrad, "-s"),
        ):
            done = [(i, p) for i, p in enumerate(points) if p.peak is not None]
            xs = [i for i, _ in done]
            mb = [p.peak / 1e6 for _, p in done]  # type: ignore[operator]
            # As a share of the step's FLOPs: the models' steps differ a hundredfold.
            share = [100 * p.recompute_flops / curve.save_all_flops for _, p in done]  # type: ignore[operator]
            label = f"{name} {side}"
            left.plot(xs, mb, style, color=colour, label=label)
            right.plot(mb, share, style, color=colour, label=label)
        refused = [(i, p.budget / 1e6) for i, p in enumerate(curve.aotgrad) if p.peak is None]
        if refused:
            left.scatter(*zip(*refused, strict=True), marker="x", color=colour, s=60)
    no_plan = left.scatter([], [], marker="x", color="0.3", label="aotgrad: no plan at this budget")
    left.set_xticks(range(len(FRACTIONS)))
    left.set_xticklabels([f"{f:g}" for f in FRACTIONS])
    left.set_xlabel(
        "budget: PyTorch's activation_memory_budget;\naotgrad's peak budget = PyTorch's measured peak"
    )
    left.set_ylabel("measured peak (MB)")
    left.set_yscale("log")
    left.set_title("measured peak vs budget")
    right.set_xscale("log")
    for axis in (left.yaxis, right.xaxis):  # 2, 5, 10, 20, 50 rather than 10^1 alone
        axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(ticker.NullFormatter())
    left.legend(handles=[no_plan], fontsize=7, loc="center left")  # the lines: right panel
    right.set_xlabel("measured peak (MB)")
    right.set_ylabel("recompute FLOPs (% of the save_all step's FLOPs)")
    right.set_title("recompute FLOPs vs measured peak")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(curves: dict[str, Curve]) -> str:
    lines = []
    for name, c in curves.items():
        worst = c.worst_at_equal_flops
        lines.append(
            f"{name} ({c.seconds:.1f} s): save_all peak {c.save_all_peak:,} B,"
            f" {c.save_all_flops / 1e9:.2f} GFLOP; worst peak ratio at equal recompute FLOPs"
            f" {worst.ratio:.3f} (PyTorch {worst.pytorch.budget:g}); monotone:"
            f" aotgrad {c.aotgrad_monotone}, PyTorch {c.pytorch_monotone}"
        )
        for side, points in (("pytorch", c.pytorch), ("aotgrad", c.aotgrad)):
            for p in points:
                lines.append(f"  {side:8} budget {p.budget:<12g} {_describe(p)}")
    return "\n".join(lines)


def _describe(p: Point) -> str:
    if p.peak is None or p.recompute_flops is None:
        return f"refused: {p.refused}"
    return f"peak {p.peak:,} B, recompute {p.recompute_flops / 1e9:.3f} GFLOP"


if __name__ == "__main__":
    start = time.perf_counter()
    found = run(sys.argv[1:] or MODELS)
    print(summary(found))
    print(f"sweep: {time.perf_counter() - start:.1f} s")
    plot(found, HERE / "memory.png")
