"""Fast peak planning (Note [Peak budgets]): splitting options in order of their recompute FLOPs
chooses what splitting every option chooses, at every budget; the shared facts and the sparse
budget program change no answer."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

import aotgrad
from aotgrad.partition import _split, partition
from aotgrad.partition.budget_solver import _BudgetProblem, _row_scale, shared_problems
from aotgrad.partition.family import build_family
from aotgrad.partition.memory import predict_peak, shared_node_facts
from aotgrad.partition.peak_budget import (
    _choice,
    _exhaustive_choice,
    _rank,
    candidates,
    every_candidate,
    least_peak,
)
from aotgrad.partition.remat import needed_by_backward
from aotgrad.partition.strategies import save_all
from aotgrad.partition.workspace import op_peak
from library_models import build
from models import GPT, MLP, ConvBN, DeepMLP, SeedNet


def _suite_joint(name: str):
    torch.manual_seed(0)
    if name in ("gpt2", "llama"):
        case = build(name)
        args, kwargs = case.resized(8, 32)

        def step(*args, **kwargs):
            return case.loss(case.model(*args, **kwargs))

        return aotgrad.trace(step, *args, **kwargs).partitioned.joint
    model, args = {
        "mlp": (MLP(), (torch.randn(8, 16),)),
        "convbn": (ConvBN(), (torch.randn(4, 1, 8, 8), torch.randn(4, 10))),
        "gpt": (GPT(), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))),
        "deep_mlp": (DeepMLP(width=32), (torch.randn(16, 32),)),
        "seednet": (SeedNet(), (torch.randn(1, 4, 4, 4), torch.randn(1))),
    }[name]
    return aotgrad.trace(model, *args).partitioned.joint


def _budgets(peaks: list[int]) -> list[int]:
    """Every candidate's peak, one byte below each, and the midpoints: every boundary."""
    ordered = sorted(set(peaks))
    mids = [(a + b) // 2 for a, b in itertools.pairwise(ordered)]
    return sorted({*ordered, *(p - 1 for p in ordered), *mids, ordered[-1] * 2})


@pytest.mark.parametrize("name", ["mlp", "convbn", "gpt", "deep_mlp", "seednet", "gpt2", "llama"])
def test_the_fast_choice_is_the_exhaustive_one_at_every_budget(name):
    joint = _suite_joint(name)
    split = functools.partial(_split, joint)
    family = candidates(joint, 60.0)
    every = every_candidate(family, split)  # each option's FLOPs checked against its split
    chosen = []
    for peak in _budgets([c.peak for c in every]):
        fresh = build_family(joint, 60.0)  # nothing solved or split yet
        fast = _choice(fresh, peak, split, {})
        slow = _exhaustive_choice(family, peak, split)
        assert fast == slow, (name, peak)
        assert fresh.bounds_hold, "a solved plan recomputes fewer FLOPs than a proven bound"
        assert len(fresh.split) <= len(family.options)
        if slow is None:
            with pytest.raises(ValueError, match="no plan fits"):
                partition(joint, aotgrad.budget(peak=peak))
            continue
        position, best = slow
        planned = partition(joint, aotgrad.budget(peak=peak))
        assert planned.peak.allocated == best.peak <= peak
        assert f"chose {best.label} (" in planned.note
        (option,) = [o for o in family.options if o.position == position]
        expected = split(option.plan, "exhaustive")
        assert [s.name for s in planned.saved] == [s.name for s in expected.saved]
        assert planned.backward.code == expected.backward.code
        chosen.append((best.peak, best.intensive_flops, best.flops))
    # Note [Peak budgets]: monotone; a larger budget never recomputes more
    assert [c[0] for c in chosen] == sorted(c[0] for c in chosen)
    keys = [c[1:] for c in chosen]
    assert keys == sorted(keys, reverse=True)


def test_a_budget_at_save_alls_peak_splits_one_option():
    joint = _suite_joint("gpt")
    family = candidates(joint, 60.0)
    top = partition(joint, "save_all").peak.allocated
    fresh = build_family(joint, 60.0)
    _position, best = _choice(fresh, top, functools.partial(_split, joint), {})
    assert best.flops == 0 and best.label == "save_all"
    # save_all's group: the options recomputing nothing (and ones equal in FLOPs), no more
    assert set(fresh.split) == {
        o.position for o in family.options if (o.intensive_flops, o.flops) == (0, 0)
    }
    assert len(fresh.split) < len(family.options)
    # Note [Budgets solved when the choice needs them]: budgets proven to recompute are not solved
    assert 0 < len(fresh.waiting()) < len(fresh.slots)


def test_shared_node_facts_change_no_prediction():
    # Note [Plans share their nodes' facts]: every split of a joint predicts as it would alone.
    joint = _suite_joint("gpt")
    family = candidates(joint, 60.0)
    plans = [_split(joint, o.plan, o.label) for o in family.options[:6]]
    alone = [predict_peak(p.forward, p.backward, p.signature, op_peak) for p in plans]
    with shared_node_facts():
        shared = [predict_peak(p.forward, p.backward, p.signature, op_peak) for p in plans]
        again = [predict_peak(p.forward, p.backward, p.signature, op_peak) for p in plans]
    assert alone == shared == again
    assert len({p.allocated for p in alone}) > 1  # the plans differ in their peaks


def test_the_sparse_budget_program_is_the_dense_one():
    joint = _suite_joint("gpt")
    full = save_all(joint)
    free = {n for n in full.saved if n.op == "placeholder"}
    needed = list(needed_by_backward(joint))
    with shared_problems():
        problem = _BudgetProblem.of(joint, free, 60.0)
        assert _BudgetProblem.of(joint, free, 30.0, rel_gap=0.1).ops is problem.ops  # shared
    n = len(problem.ops)
    dense = []
    for v in needed:
        if v in problem.index:
            row = np.zeros(2 * n)
            row[problem.index[v]] = row[n + problem.index[v]] = 1
            dense.append(row)
    for v in problem.ops:
        for u in v.all_input_nodes:
            if u in problem.index:
                row = np.zeros(2 * n)
                row[n + problem.index[v]] = 1
                row[problem.index[u]] -= 1
                row[n + problem.index[u]] -= 1
                dense.append(row)
    scale = _row_scale(problem.weights)  # Note [Rows scaled by a power of two]
    dense.append(problem.on_save(problem.weights * scale))
    constraint = problem.constraint(needed, 12345)
    np.testing.assert_array_equal(constraint.A.toarray(), np.array(dense))
    assert constraint.ub[-1] == 12345 * scale and constraint.A.has_sorted_indices


@pytest.mark.parametrize(
    "values", [[0.0], [1.0], [3.0, 1.5], [2.0**20, 3 * 2.0**20], [117_964_800.0, 4.0, 0.0]]
)
def test_a_row_scaled_by_a_power_of_two_is_the_same_row(values):
    # Note [Rows scaled by a power of two]: the largest coefficient lands in [1, 2), exactly
    row = np.array(values)
    scale = _row_scale(row)
    scaled = row * scale
    assert np.array_equal(scaled / scale, row)  # nothing rounded
    largest = np.abs(scaled).max()
    assert largest == 0 or 1 <= largest < 2
    assert scale == 2.0 ** round(np.log2(scale))


def test_a_plans_floor_is_what_its_forward_returns_beyond_the_inputs():
    # Note [A floor under a plan's peak]: f returns its loss (4 bytes) and saves relu's output
    # (64 x 32 floats); x and w are the caller's and count nothing.
    def f(x, w):
        return (x @ w).relu().sum()

    x, w = torch.randn(64, 16), torch.randn(16, 32, requires_grad=True)
    joint = aotgrad.trace(f, x, w, partition="save_all").partitioned.joint
    family = candidates(joint, 60.0)
    (everything,) = [o for o in family.options if o.label == "save_all"]
    assert everything.floor == 4 + 64 * 32 * 4
    for option, candidate in zip(
        family.options, every_candidate(family, functools.partial(_split, joint)), strict=True
    ):
        assert option.floor <= candidate.peak


def test_options_whose_floor_is_above_the_budget_are_not_split():
    joint = _suite_joint("gpt")
    split = functools.partial(_split, joint)
    family = candidates(joint, 60.0)
    peak = max(o.floor for o in family.options) - 1  # save_all's floor, less a byte
    assert min(c.peak for c in every_candidate(family, split)) <= peak  # some plan fits
    fresh = build_family(joint, 60.0)
    for slot in fresh.slots:  # every budget solved: this test is about splits
        fresh.solve(slot)
    position, best = _choice(fresh, peak, split, {})
    floors = {o.position: o.floor for o in family.options}
    ahead = {
        o.position
        for o in family.options
        if (o.intensive_flops, o.flops) <= (best.intensive_flops, best.flops)
    }
    ruled_out = {i for i in ahead if floors[i] > peak}
    assert ruled_out, "expected some option ahead of the choice to be ruled out by its floor"
    assert set(fresh.split) == ahead - ruled_out
    assert (position, best) == _exhaustive_choice(family, peak, split)


@pytest.mark.parametrize("name", ["mlp", "convbn", "gpt", "deep_mlp", "gpt2"])
def test_the_least_peak_is_the_least_of_every_candidate(name):
    # The ValueError below the floor names it: found splitting in order of the floors only
    joint = _suite_joint(name)
    split = functools.partial(_split, joint)
    family = candidates(joint, 60.0)
    every = [
        (o.position, c) for o, c in zip(family.options, every_candidate(family, split), strict=True)
    ]
    expected = min(every, key=lambda pc: (pc[1].peak, *_rank(pc)))
    fresh = build_family(joint, 60.0)
    assert least_peak(fresh, split) == expected
    if name in ("gpt", "gpt2"):  # floors rule out the plans saving most
        assert len(fresh.split) < len(fresh.options)
