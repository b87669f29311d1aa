"""``aotgrad.budget(peak=BYTES)``: the least recompute whose predicted step peak fits (Note [Peak
budgets]); monotone in the budget, predicted and measured; a budget below the smallest peak
raises with it."""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import re

import pytest
import torch

import aotgrad
from aotgrad.partition import partition
from aotgrad.partition.peak_budget import _intensive_flops
from aotgrad.settings import Options
from aotgrad.store.persist import options_text
from aotgrad.testing import measure_peak, verify
from library_models import build


def _smallest_peak(joint) -> int:
    """The family's smallest predicted peak, read off the error a zero budget raises."""
    with pytest.raises(ValueError, match="no plan fits budget") as error:
        partition(joint, aotgrad.budget(peak=0))
    return int(
        re.search(
            r"smallest predicted peak of \d+ candidate plans is (\d+) bytes", str(error.value)
        )[1]
    )


def _step(compiled, case, args, kwargs):
    def step():
        case.loss(compiled(*args, **kwargs)).backward()

    return step


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_smaller_peak_budgets_never_give_larger_peaks(name):
    # Batch 8 (sequence 32): the peak is in the backward, where remat moves it.
    case = build(name)
    args, kwargs = case.resized(8, 32)
    model = case.model
    full = aotgrad.trace(model, *args, **kwargs).partitioned
    top, floor = full.peak.allocated, _smallest_peak(full.joint)
    assert floor < top  # remat lowers the peak of this step at all

    model.zero_grad(set_to_none=True)
    case.loss(model(*args, **kwargs)).backward()
    eager = _grads(model)

    rng = random.Random(name)
    budgets = sorted([floor, *(rng.randint(floor, top) for _ in range(5)), top])
    predicted, measured, flops = [], [], []
    for peak in budgets:
        compiled = aotgrad.aot_module(model, partition=aotgrad.budget(peak=peak))
        step = _step(compiled, case, args, kwargs)
        model.zero_grad(set_to_none=True)
        step()  # compiles; the same grads as eager
        for key, grad in _grads(model).items():
            torch.testing.assert_close(grad, eager[key], msg=f"{name} {peak}: {key}")
        model.zero_grad(set_to_none=True)
        measured.append(measure_peak(step))
        model.zero_grad(set_to_none=True)
        plan = compiled.compiled.partitioned
        assert plan.strategy == f"budget(peak={peak})"
        assert plan.note.startswith(f"budget(peak={peak}): predicted peak {plan.peak.allocated}")
        assert plan.peak.allocated <= peak
        predicted.append(plan.peak.allocated)
        flops.append((_intensive_flops(plan), plan.recompute_flops))
    assert predicted == sorted(predicted), (budgets, predicted)
    assert measured == sorted(measured), (budgets, measured)
    # The outputs beside the loss (logits) die before this step's backward; the prediction holds
    # every output to the end of the step (Note [What a step holds]): measured <= predicted.
    assert all(m <= p for m, p in zip(measured, predicted, strict=True)), (predicted, measured)
    assert all(m <= b for m, b in zip(measured, budgets, strict=True)), (budgets, measured)
    assert flops == sorted(flops, reverse=True), (budgets, flops)
    assert predicted[0] == floor and flops[0] > (0, 0) and flops[-1] == (0, 0)


def _two_layers(x, w1, w2):
    h = (x @ w1).relu() @ w2
    return ((h @ w1).relu() @ w2).sum()


def _two_layer_args():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    return x, torch.randn(16, 256, requires_grad=True), torch.randn(256, 16, requires_grad=True)


def test_a_budget_below_the_smallest_peak_raises_with_it():
    joint = aotgrad.trace(_two_layers, *_two_layer_args()).partitioned.joint
    floor = _smallest_peak(joint)
    assert partition(joint, aotgrad.budget(peak=floor)).peak.allocated == floor
    with pytest.raises(ValueError) as error:
        partition(joint, aotgrad.budget(peak=floor - 1))
    message = str(error.value)
    assert f"no plan fits budget(peak={floor - 1})" in message
    assert f"is {floor} bytes ({floor / 1e6:.2f} MB)" in message
    assert f"Raise the budget to at least {floor}" in message and "scan_layers" in message


def test_a_budget_at_save_alls_peak_recomputes_nothing():
    args = _two_layer_args()
    full = aotgrad.trace(_two_layers, *args).partitioned
    for peak in (full.peak.allocated, full.peak.allocated + 1, 10**12):
        plan = partition(full.joint, aotgrad.budget(peak=peak))
        assert plan.recompute_flops == 0 and plan.peak.allocated == full.peak.allocated
        assert "chose save_all" in plan.note


def test_recomputing_just_before_use_lowers_the_measured_peak():
    # Note [Recompute just before use]: at the backward's start every recomputed op runs before
    # the first backward op, and no saved-bytes plan lowers this step's peak; just before use does.
    args = _two_layer_args()
    full = aotgrad.trace(_two_layers, *args).partitioned
    compiled = aotgrad.aot_function(_two_layers, partition=aotgrad.budget(peak=250_000))
    for arg in args:
        arg.grad = None
    compiled(*args).backward()
    grads = [a.grad for a in args[1:]]
    for arg in args:
        arg.grad = None
    measured = measure_peak(lambda: compiled(*args).backward())
    plan = compiled.partitioned
    assert plan.peak.allocated == measured < 250_000 < full.peak.allocated
    assert "chose saved-bytes cap" in plan.note and "backward's start" not in plan.note
    for arg in args:
        arg.grad = None
    _two_layers(*args).backward()
    for grad, arg in zip(grads, args[1:], strict=True):
        torch.testing.assert_close(grad, arg.grad)


def test_peak_budget_arguments():
    assert str(aotgrad.budget(peak=10**6)) == "budget(peak=1000000)"
    assert aotgrad.budget(peak=1e9).peak == 10**9 and aotgrad.budget(peak=1e9).limit is None
    assert str(aotgrad.budget(0.5)) == "budget(0.5)" and aotgrad.budget(0.5).peak is None
    with pytest.raises(TypeError, match="exactly one of"):
        aotgrad.budget()
    with pytest.raises(TypeError, match="exactly one of"):
        aotgrad.budget(0.5, peak=10**6)
    with pytest.raises(ValueError, match="whole number of bytes"):
        aotgrad.budget(peak=1.5)
    with pytest.raises(ValueError, match="whole number of bytes"):
        aotgrad.budget(peak=float("nan"))
    with pytest.raises(ValueError, match=">= 0"):
        aotgrad.budget(peak=-1)
    for bad in ("1e9", True, [10**6]):
        with pytest.raises(TypeError, match="number of bytes"):
            aotgrad.budget(peak=bad)
    with pytest.raises(TypeError, match="bounds the peak"):
        aotgrad.budget(peak=10**6).bytes_for(None)


def test_peak_budgets_key_the_disk_cache_apart(cache_dir):
    a, b = aotgrad.budget(peak=300_000), aotgrad.budget(peak=250_000)
    assert options_text(Options(partition=a)) != options_text(Options(partition=b))
    assert options_text(Options(partition=a)) != options_text(
        Options(partition=aotgrad.budget(0.5))
    )
    args = _two_layer_args()
    flops = []
    for budget, hits in ((a, 0), (b, 0), (aotgrad.budget(peak=250_000), 1)):
        compiled = aotgrad.aot_function(_two_layers, partition=budget)
        compiled(*args).backward()
        assert aotgrad.cache_info(compiled).disk_hits == hits, budget
        if hits == 0:
            flops.append(compiled.partitioned.recompute_flops)
    assert flops[0] == 0 < flops[1]  # two different plans, neither read for the other


def test_a_scan_bounds_the_peak_of_its_whole_step():
    # A body runs once per iteration: a scan's peak budget bounds the whole loop's step (Note
    # [Peak budgets over a scan]); tests/test_scan_peak.py measures it.
    run = aotgrad.scan_function(lambda h, x: (h + x, None), partition=aotgrad.budget(peak=10**6))
    run(torch.zeros(3, requires_grad=True), torch.randn(4, 3))
    assert run.step_peak.allocated <= 10**6
    assert run.traced.partitioned.strategy == "budget(peak=1000000)"


def test_the_family_is_built_once_per_joint_and_dies_with_it(monkeypatch):
    from aotgrad.partition import budget_solver, family

    solves = []
    real = budget_solver.budget_saved
    monkeypatch.setattr(
        budget_solver, "budget_saved", lambda *a, **k: solves.append(1) or real(*a, **k)
    )
    traced = aotgrad.trace(_two_layers, *_two_layer_args(), partition=aotgrad.budget(peak=10**9))
    key = id(traced.partitioned.joint)
    budgets = [s for s in family._FAMILIES[key][2].slots if s.series is not None]
    # Note [Budgets solved when the choice needs them]: save_all fits, and the budgets proven
    # to recompute are never solved; each solved one, once
    assert 0 < len(solves) == sum(s.solved for s in budgets) < len(budgets)
    for peak in (250_000, 240_000, 10**9):  # lower budgets solve the budgets they need
        partition(traced.partitioned.joint, aotgrad.budget(peak=peak))
    built = len(solves)
    assert built == sum(s.solved for s in budgets) <= len(budgets)
    for peak in (250_000, 240_000, 10**9):  # another budget on the same joint: no new solve
        partition(traced.partitioned.joint, aotgrad.budget(peak=peak))
    assert len(solves) == built
    del traced, budgets
    gc.collect()
    assert key not in family._FAMILIES  # the cache holds no joint alive


@pytest.mark.parametrize(("name", "checkpointed"), [("bert", False), ("t5", True)])
def test_the_tightest_plan_matches_eager_with_dropout_and_checkpoints(name, checkpointed):
    # Dropout is never recomputed, checkpoint regions are re-run as traced; recomputing just
    # before use only moves ops, so the tightest plan is eager's values and gradients.
    case = build(name, dropout=0.1)
    args, kwargs = case.resized(4, 16)
    with case.checkpointing(case.model, False) if checkpointed else contextlib.nullcontext():

        def step(*args, **kwargs):
            return case.loss(case.model(*args, **kwargs))

        floor = _smallest_peak(aotgrad.trace(step, *args, **kwargs).partitioned.joint)
        compile_fn = functools.partial(aotgrad.aot_function, partition=aotgrad.budget(peak=floor))
        assert verify(step, *args, compile_fn=compile_fn, **kwargs).ok


def test_a_saved_bytes_budget_that_leaves_the_peak_says_so():
    """Note [A saved-bytes budget and the peak]: on a 2-block GPT, budget(0.01) recomputes and
    leaves the step's peak at save_all's; its note says so, where, and points to
    budget(peak=...), which does lower it. budget(0.1) lowers the peak: no such note."""
    from models import GPT

    torch.manual_seed(0)
    model = aotgrad.aot_module(GPT(), partition=aotgrad.budget(0.01))
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    budgeted = lambda m: aotgrad.aot_module(m, partition=aotgrad.budget(0.01))  # noqa: E731
    verify(model.orig_module, ids, targets, compile_fn=budgeted)  # the plan is right
    model(ids, targets).backward()
    small = model.partitioned
    full = aotgrad.trace(model.orig_module, ids, targets).partitioned
    assert small.recompute_flops > 0 and small.peak.allocated == full.peak.allocated
    assert small.note == (
        f"budget(0.01) saves {small.saved_bytes} bytes where save_all saves {full.saved_bytes},"
        f" recomputing {small.recompute_flops} FLOPs, but the step's predicted peak stays at"
        f" save_all's {full.peak.allocated} bytes, at backward op {full.peak.node}"
        f" ({full.peak.op}): a saved-bytes budget bounds what the backward keeps, not the peak."
        " To bound the peak, pass aotgrad.budget(peak=BYTES) (Note [Peak budgets])"
    )
    assert f"plan: {small.note}" in model.memory_report()  # where the user reads the peak
    lower = aotgrad.trace(model.orig_module, ids, targets, partition=aotgrad.budget(0.1))
    assert lower.partitioned.peak.allocated < full.peak.allocated
    assert lower.partitioned.note is None and "plan:" not in lower.memory_report()
    peak = aotgrad.budget(peak=full.peak.allocated - 1)  # the pointer leads somewhere
    assert (
        aotgrad.trace(model.orig_module, ids, targets, partition=peak).partitioned.peak.allocated
        < full.peak.allocated
    )
