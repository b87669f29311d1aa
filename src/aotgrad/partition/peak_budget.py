"""Peak budgets: ``aotgrad.budget(peak=BYTES)``, the least recompute whose predicted step peak
is at most ``BYTES`` (Note [Peak budgets]).

The plans come from a fixed family of candidates per joint graph (``partition/family.py``:
``save_all``, ``mincut`` and saved-bytes budgets on a grid, each with its recomputation in
the joint's order and just before use); in order of their recompute FLOPs, each is split
and its peak predicted (``partition/memory.py``) until one fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from aotgrad.capture import JointGraph
from aotgrad.errors import PartitionError
from aotgrad.ops.table import is_compute_intensive
from aotgrad.partition.family import Candidate, Family, Option, candidates
from aotgrad.partition.memory import shared_node_facts
from aotgrad.partition.partitioned import Partitioned
from aotgrad.partition.remat import RematPlan
from aotgrad.partition.sizes import hint
from aotgrad.partition.strategies import Budget

__all__ = ["Candidate", "Family", "candidates", "every_candidate", "with_peak_budget"]

# Turns a plan into forward and backward graphs (``partition._split``), named by its label.
Split = Callable[[RematPlan, str], Partitioned]


# Note [Peak budgets]
# ~~~~~~~~~~~~~~~~~~~
# ``budget(peak=B)`` bounds ``Partitioned.peak.allocated``: the bytes a step
# ``f(*inputs).backward()`` allocates at its peak above the inputs it is given
# (Note [What a step holds]), which ``aotgrad.testing.measure_peak`` measures.
# Per joint graph the candidates are a fixed family, built without looking at B:
# save_all, mincut, the policy saving what matmuls, convolutions and attention
# return (recomputing only cheaper ops from them), the saved-bytes budgets at
# ``FRACTIONS`` (``partition/family.py``), and those budgets again with no
# matmul-class op recomputed; each once with each recomputed op just before its first use (the
# default) and once with all of them at the backward's start (Note [Recompute
# just before use] in ``partition/split.py``: only the first lowers the peak when
# the peak is in the backward; the second frees a large saved input sooner when a
# small value is recomputed from it), the second left out when it moves nothing
# (the same graphs count once). The plan is
#
#     argmin over {c : peak(c) <= B} of
#         (recomputed matmul/conv/attention FLOPs, recompute FLOPs, peak, saved bytes, position)
#
# Matmul-class FLOPs first: they are what a step's time grows with (and what
# ``torch.utils.flop_counter`` counts); the other ops cost about their memory
# traffic, and a compiler fuses them into their users.
#
# The key is a total order (no two candidates share a position), so there is one
# argmin. Monotone by construction: take B1 < B2 and their choices c1, c2. The
# feasible sets nest, F(B1) ⊆ F(B2). If peak(c2) < peak(c1) <= B1, then c2 is in
# F(B1), so key(c1) < key(c2) (c1 won there), while c1 in F(B2) gives key(c2) <
# key(c1): a contradiction. So peak(c1) <= peak(c2): a smaller budget never gives
# a larger predicted peak, and key(c1) >= key(c2) in its first two places: never
# less recompute, matmul-class FLOPs first.
# A family re-solved for each B (PyTorch's knapsack at each budget fraction) has
# no such argument, and breaks it: its budget 0.05 gave a 1,145 MB peak where
# 0.15 gave 275 MB (PyTorch's bug #197838). Worked example: the two layers of
# the ``aotgrad.budget`` doctest (Note [Recompute just before use]), 11 candidates
# (FLOPs: matmul-class, all):
#
#     candidate                                   FLOPs               peak (bytes)
#     save_all                                    0, 0                282632
#     saved matmul/convolution/attention outputs  0, 32768            282632
#     saved-bytes cap 138240 (fraction 0.75)      524288, 540672      229384
#     saved-bytes cap 41088 (0.03125)             1048576, 1081344    229384
#     saved-bytes cap 36864 (0), either order     1572864, 1605632    282632
#     (and 6 more, some "recomputed at the backward's start")
#
#     budget(peak=300_000), budget(peak=282_632)  -> save_all, peak 282632
#     budget(peak=282_631) ... budget(peak=229_384) -> cap 138240, peak 229384
#     budget(peak=229_383)                          -> ValueError: the smallest is 229384
#
# Splitting a candidate and predicting its peak is what costs (a split copies
# the joint's nodes into two fx graphs; the prediction replays them), so a
# budget splits only the candidates it must. Their FLOPs are counted off the
# plan, without a split (``family._Backward.recompute_cost``: the forward ops the
# backward re-runs after dead-code removal, as ``partition._recomputed`` counts
# them; each split checks the count). The candidates are taken in groups of
# equal FLOPs, least first; the first group holding one whose peak fits holds
# the argmin (every later group ranks below it in the first two places), and
# within it the key's last three places choose. A candidate whose forward alone
# holds more than B at its end cannot fit, and is not split (its ``floor``:
# Note [A floor under a plan's peak] in ``partition/memory.py``; every split
# checks that its peak is not below it). In the example above:
#
#     budget(peak=300_000): group (0, 0): save_all, 282632 fits -> 1 split
#     budget(peak=250_000): (0, 0) save_all 282632; (0, 32768) the matmul policy,
#                           both orders, 282632; (524288, 540672) cap 138240,
#                           both orders: 229384 fits -> 5 splits of 11
#
# ``_exhaustive_choice`` splits every candidate: the definition the fast choice
# is tested against (tests/test_fast_peak_planning.py). The ValueError below the
# floor names the least peak of all (``least_peak``): every budget solved, the
# candidates split in order of their floors until the next floor is above the
# least peak found. Splits are remembered per family, and
# every split of a budget's call shares its nodes' facts (Note [Plans share
# their nodes' facts] in ``partition/memory.py``).
#
# The plan is the least recompute within the family, not over every plan (the
# peak of a plan depends on the order of both graphs, which no integer program
# here models); the predicted peak equals the measured one to the byte where Note
# [What a step holds] is exact. Below the family's smallest peak there is no plan:
# the ValueError names that peak, and the ways to lower it (scan_layers,
# checkpoint). Cost: two floor solves, two solves per budget the choice needs
# (``REL_GAP``; the family is in ``partition/family.py``, and a budget whose
# FLOPs are proven to lie beyond the group that fits is never solved: Note
# [Budgets solved when the choice needs them]), one budget program built for
# all of them (``shared_problems``), and the splits above. In the example above,
# budget(peak=300_000) solves 3 of the 10 budgets, budget(peak=250_000) all of
# them (its plan recomputes matmuls, and any budget might recompute fewer).
# The family is cached per joint graph, so another B on the
# same joint costs only the splits not made yet.


def with_peak_budget(joint: JointGraph, limit: Budget, split: Split) -> Partitioned:
    """The least-recompute candidate whose predicted peak fits ``limit.peak`` (Note [Peak
    budgets]); ValueError naming the smallest peak when none does."""
    if limit.peak is None:
        raise AssertionError(f"expected a peak budget, got {limit}")
    family = candidates(joint, limit.time_limit)
    splits: dict[int, Partitioned] = {}
    with shared_node_facts(family.context.facts):  # Note [Plans share their nodes' facts]
        chosen = _choice(family, limit.peak, split, splits)
        if chosen is None:
            raise PartitionError(_below_floor(limit, family, split))
    position, best = chosen
    partitioned = splits.get(position) or split(best.plan, str(limit))
    if partitioned.peak.allocated != best.peak:
        raise AssertionError(
            f"expected the chosen plan's peak {best.peak} again, got {partitioned.peak.allocated}"
        )
    solved = sum(s.solved for s in family.slots)
    note = (
        f"{limit}: predicted peak {best.peak} bytes at {best.where}; chose {best.label}"
        f" ({best.flops} recompute FLOPs) of {len(family.known())} candidates"
        f" ({solved} of the family's {len(family.slots)} plans solved, {len(family.split)} split)"
    )
    notes = [n for n in (note, family.note, best.plan.note) if n]
    return _relabelled(partitioned, str(limit), "; ".join(notes))


def _key(option: Option) -> tuple[int, int]:
    """What the choice weighs first: recomputed matmul-class FLOPs, then all."""
    return option.intensive_flops, option.flops


def _choice(
    family: Family, peak: int, split: Split, splits: dict[int, Partitioned]
) -> tuple[int, Candidate] | None:
    """The argmin of Note [Peak budgets], splitting options in order of their FLOPs only until
    a group of equal FLOPs holds one that fits (every option after it ranks below), and
    solving a budget only when its FLOPs could come before the next group (Note [Budgets
    solved when the choice needs them])."""
    done: set[tuple[int, int]] = set()
    while True:
        ahead = [o for o in family.known() if _key(o) not in done]
        head = min(map(_key, ahead), default=None)
        waiting = family.waiting()
        if waiting:
            slot = min(waiting, key=lambda s: (family.least_flops(s), -s.cap, s.index))
            if head is None or (0, family.least_flops(slot)) <= head:
                family.solve(slot)
                continue
        if head is None:
            return None
        done.add(head)
        group = [o for o in ahead if _key(o) == head and o.floor <= peak]  # the rest cannot fit
        fits = [
            (o.position, c)
            for o in group
            if (c := _evaluate(family, o, split, splits)).peak <= peak
        ]
        if fits:
            return min(fits, key=_rank)


def _exhaustive_choice(family: Family, peak: int, split: Split) -> tuple[int, Candidate] | None:
    """The same argmin over every option split: the definition :func:`_choice` must meet."""
    every = zip(family.options, every_candidate(family, split), strict=True)
    fits = [(o.position, c) for o, c in every if c.peak <= peak]
    return min(fits, key=_rank) if fits else None


def every_candidate(family: Family, split: Split) -> tuple[Candidate, ...]:
    """Every option of ``family`` split and its peak predicted, in the family's order; no split
    is kept (each candidate keeps what it weighs)."""
    return tuple(_evaluate(family, o, split, {}) for o in family.options)


def _evaluate(
    family: Family, option: Option, split: Split, splits: dict[int, Partitioned]
) -> Candidate:
    """``option`` split and its peak predicted, once per family; the split kept in ``splits``
    for this call."""
    known = family.split.get(option.position)
    if known is not None:
        return known
    partitioned = split(option.plan, option.label)
    if partitioned.backward is None:
        raise AssertionError(f"expected a backward graph for {option.label}, got None")
    intensive = _intensive_flops(partitioned)
    if (intensive, partitioned.recompute_flops) != (option.intensive_flops, option.flops):
        raise AssertionError(
            f"expected {option.label} to recompute ({option.intensive_flops}, {option.flops})"
            f" FLOPs as counted off its plan, got ({intensive}, {partitioned.recompute_flops})"
        )
    peak = partitioned.peak
    if peak.allocated < option.floor:
        raise AssertionError(
            f"expected {option.label}'s predicted peak {peak.allocated} to be at least the"
            f" {option.floor} bytes its forward holds at its end"
        )
    candidate = Candidate(
        label=option.label,
        plan=option.plan,
        flops=option.flops,
        intensive_flops=intensive,
        peak=peak.allocated,
        where=f"{peak.graph} op {peak.node} ({peak.op})",
        saved_bytes=hint(partitioned.saved_bytes),
    )
    family.split[option.position] = candidate
    splits[option.position] = partitioned
    return candidate


def _relabelled(partitioned: Partitioned, strategy: str, note: str) -> Partitioned:
    """``partitioned`` under the budget's name and note, its predicted peak kept (the
    prediction reads neither)."""
    relabelled = replace(partitioned, strategy=strategy, note=note)
    relabelled.__dict__["peak"] = partitioned.peak  # functools.cached_property's slot
    return relabelled


# Note [Budgets at the example sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under dynamic shapes (``dynamic=True``, ``aotgrad.dynamic(x, dim)``) every
# budget is posed and solved at the example inputs' sizes (Note [Weights at the
# example sizes]): the sizes of the call that traced, which the plan's note and
# every report name (``s0 = 64 (x.size()[0])``). At those sizes the plan is the
# one a static trace of them gets. ``budget(x)``'s fraction runs from the
# smallest plan to ``save_all`` at those sizes; ``budget(BYTES)`` and
# ``budget(peak=BYTES)`` bound ``saved_bytes`` and ``peak.allocated`` there.
# The plan (which values are saved) then serves every size the guards admit,
# and is right at each: the rest of what the backward reads is recomputed
# from the saved values, whatever the sizes. Its bytes grow with the sizes.
# With ``g`` of the ``aotgrad.budget`` doctest and
# ``aot_function(g, partition=budget(peak=250_000), dynamic=True)``, first
# called with ``x: (64, 16)``:
#
#     batch (s0)        32       64 (traced)      128      measured peak.allocated
#     this plan     131080           229384    425992      (recomputes mm, relu)
#     save_all      149512           282632    548872
#
# 229384 <= 250000 at the example sizes; at batch 128 the same plan holds
# 425992, and no plan of the family is below that there (a static trace at 128
# raises). Why the example sizes and not "every size the guards admit": those
# are unbounded above (``2 <= s0``), so no plan keeps a byte bound at all of
# them, and an upper bound from the guards, where one exists, says how torch
# traced, not what the user will run. So the rule is one, and predictable: the
# bound holds at the sizes you traced with; trace (call first) with the
# largest inputs you will run, or use static shapes, where each size gets its
# own plan and a size no plan fits raises.


# Note [A saved-bytes budget and the peak]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``budget(x)`` bounds the bytes the backward keeps (Note [Budget units]), and
# chooses the least recompute that fits; nothing in it looks at the step's peak.
# The peak is often elsewhere: in the backward, where one block's gradients and
# temporaries sit on top of everything still saved for the blocks before it. A
# small budget can then recompute a lot and leave the peak where it was. On the
# 2-block GPT of ``tests/models.py`` (dim 32, batch 2, 16 tokens):
#
#     plan          saved bytes  recompute FLOPs  predicted peak (allocated)
#     save_all           258180                0  178696 at backward gelu_backward
#     budget(0.01)       112772          1858880  178696 at backward gelu_backward
#     budget(0.1)        126724          1263936  162952 at backward gelu_backward_1
#
# So a saved-bytes budget's plan is compared with save_all's: when it recomputes
# and its predicted peak is not below save_all's, its note says so, where the
# peak is, and that ``budget(peak=BYTES)`` is the budget that bounds the peak
# (Note [Peak budgets]). It costs one more split, of save_all.


def with_peak_note(partitioned: Partitioned, everything: Partitioned) -> Partitioned:
    """``partitioned`` (a saved-bytes budget's plan) with a note when it recomputes and its
    predicted peak is not below ``everything``'s, save_all's (Note [A saved-bytes budget and
    the peak])."""
    peak, top = partitioned.peak, everything.peak
    if partitioned.recompute_flops == 0 or peak.allocated < top.allocated:
        return partitioned
    stays = (
        "stays at save_all's"
        if peak.allocated == top.allocated
        else f"rises above save_all's {top.allocated} bytes to"
    )
    note = (
        f"{partitioned.strategy} saves {hint(partitioned.saved_bytes)} bytes where save_all"
        f" saves {hint(everything.saved_bytes)}, recomputing {partitioned.recompute_flops} FLOPs, but the"
        f" step's predicted peak {stays} {peak.allocated} bytes, at {peak.graph} op {peak.node}"
        f" ({peak.op}): a saved-bytes budget bounds what the backward keeps, not the peak. To"
        " bound the peak, pass aotgrad.budget(peak=BYTES) (Note [Peak budgets])"
    )
    notes = [n for n in (note, partitioned.note) if n]
    return replace(partitioned, note="; ".join(notes))


def _rank(numbered: tuple[int, Candidate]) -> tuple[int, int, int, int, int]:
    """The choice's total order: recomputed matmul/convolution/attention FLOPs, then all
    recompute FLOPs, then peak, then saved bytes, then position."""
    position, c = numbered
    return (c.intensive_flops, c.flops, c.peak, c.saved_bytes, position)


def _below_floor(limit: Budget, family: Family, split: Split) -> str:
    _, least = least_peak(family, split)  # budget(peak=<its peak>)'s plan
    return (
        f"no plan fits {limit}: the smallest predicted peak of {len(family.options)}"
        f" candidate plans is {least.peak} bytes ({least.peak / 1e6:.2f} MB), with"
        f" {least.label} (at {least.where}). Raise the budget to at least {least.peak}; or lower"
        " the floor inside the step: torch.utils.checkpoint around blocks, or"
        " aotgrad.scan_layers(layers, x, checkpoint=True) for a stack of identical layers"
        " (Note [Peak budgets])"
    )


def least_peak(family: Family, split: Split) -> tuple[int, Candidate]:
    """The candidate of least predicted peak, ties by the choice's order: every budget solved,
    the options split in order of their floors until the next floor is above the least peak
    found (no later option can go below it: Note [A floor under a plan's peak])."""
    best: tuple[int, Candidate] | None = None
    for option in sorted(family.options, key=lambda o: (o.floor, o.position)):
        if best is not None and option.floor > best[1].peak:
            break
        found = (option.position, _evaluate(family, option, split, {}))  # no split kept
        if best is None or (found[1].peak, *_rank(found)) < (best[1].peak, *_rank(best)):
            best = found
    if best is None:
        raise AssertionError("expected a family with save_all among its options, got none")
    return best


def _intensive_flops(partitioned: Partitioned) -> int:
    assert partitioned.backward is not None
    targets = {n.name: n.target for n in partitioned.backward.graph.nodes}
    return sum(r.flops for r in partitioned.recomputed if is_compute_intensive(targets[r.name]))
