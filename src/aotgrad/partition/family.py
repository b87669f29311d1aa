"""The family of plans a peak budget chooses from (Note [Peak budgets] in
``partition/peak_budget.py``): save_all, mincut, the policy saving matmul-class outputs, and
two series of saved-bytes budgets, each budget solved only when the choice needs it (Note
[Budgets solved when the choice needs them]). The solver (numpy, SciPy) loads only here.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.ops.table import is_compute_intensive, must_run
from aotgrad.partition.memory import held_after_forward, shared_node_facts
from aotgrad.partition.remat import RematPlan, forward_ops, needed_by_backward, node_flops
from aotgrad.partition.sizes import hinted_bytes
from aotgrad.partition.split import backward_order
from aotgrad.partition.strategies import (
    apply_checkpoint_policy,
    from_saved,
    mincut,
    save_all,
    with_policy,
)

# The saved-bytes budgets tried, as fractions from the smallest plan to save_all (Note
# [Budget units]); fixed, so that the family does not depend on the peak asked for.
FRACTIONS = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
# Each of those solves stops within 10% of the least recompute FLOPs: a candidate's FLOPs and
# peak are counted exactly after, and a gap, unlike a time limit, gives the same family on
# every run, in a fraction of an exact solve's time (bench/findings.md, 2026-12-07).
REL_GAP = 0.1


# Note [Budgets solved when the choice needs them]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The family's saved-bytes budgets are the costly part of building it: two
# HiGHS solves each (least FLOPs under the cap, then fewest bytes at those
# FLOPs), 34 for a 32-layer Llama (bench/findings.md, 2026-12-08). The choice (Note [Peak
# budgets]) walks the options in order of (matmul-class FLOPs, FLOPs) and
# stops at the first group that fits, so a budget whose FLOPs are known to lie
# beyond that group need not be solved at all. Its FLOPs are bounded before
# it is solved: a budget at cap c recomputes at least the least FLOPs of any
# plan under c, which is at least the least FLOPs under any larger cap c' of the
# same series, which is at least the lower bound HiGHS proves when it solves c'
# (``BudgetResult.flops_bound``, its dual bound). So an unsolved budget's key is
# at least (0, the largest bound of a solved budget of its series at a cap at
# least its own), and the choice solves it only when that could come before the
# group it would split next. Budgets wait in order of that bound, larger caps
# first; the family stays the one every budget defines (its members, their
# order, their positions), so the choice is the one splitting every option
# gives (``_exhaustive_choice``; tests/test_fast_peak_planning.py).
#
# Worked example, the 32-layer Llama of bench/planning.py at its middle budget
# (10,598,344 bytes): the plan is "saved-bytes cap 11374686, no matmul
# recomputed" at (0, 2,252,800) FLOPs. The plain series solves its caps
# 20,374,660, 15,582,603 and 10,790,546; the last proves at least 3,246,964
# FLOPs under its cap, beyond 2,252,800, so its six smaller caps are never
# solved. The other series solves down to cap 11,074,687, which proves at
# least 2,326,711, and skips 10,774,688: 7 of 17 budgets (14 of 34 solves)
# skipped, and 2 of the 24 candidates split.
#
# The bound assumes what the solver weighs is what the plan recomputes: every
# solved budget's options are checked against the bounds of its series (its
# own and those of larger caps); a plan recomputing fewer FLOPs than a bound
# (a checkpoint policy re-planning it, say) turns the bounds off, and every
# budget left is then solved before the next group is split, as if there were
# none.


@dataclass(frozen=True)
class Option:
    """One plan of the family before its split, with what the choice weighs first: the FLOPs
    its backward re-runs, counted off the plan (:meth:`_Backward.recompute_cost`)."""

    label: str
    plan: RematPlan
    # Of ``flops``, those of recomputed matmuls, convolutions and attention.
    intensive_flops: int
    flops: int
    # What its forward holds at its end beyond the inputs: no split predicts a lower peak
    # (Note [A floor under a plan's peak] in ``partition/memory.py``).
    floor: int
    # Its place in the family's fixed order (the choice's last tie-break): twice its plan's
    # place, plus one for the plan recomputed at the backward's start.
    position: int


@dataclass(frozen=True)
class Candidate:
    """One plan of the family, split, with what the choice weighs."""

    label: str
    plan: RematPlan
    flops: int
    # Of ``flops``, those of recomputed matmuls, convolutions and attention.
    intensive_flops: int
    # Predicted ``peak.allocated``, and the op running at the peak (``graph/op``).
    peak: int
    where: str
    saved_bytes: int


@dataclass(frozen=True)
class _Series:
    """Saved-bytes budgets at ``FRACTIONS`` from the series' floor to save_all's bytes; ``kept``
    never recomputed (the series recomputing no matmul-class op)."""

    suffix: str
    kept: frozenset[fx.Node]
    floor: int


@dataclass
class _Slot:
    """One plan of the family: known from the start, or a budget solved when needed."""

    label: str
    index: int
    series: _Series | None = None
    cap: int = 0
    solved: bool = False
    plan: RematPlan | None = None
    # The solver's proven lower bound on the recompute FLOPs under ``cap`` (Note [Budgets
    # solved when the choice needs them]); whether it hit its time limit.
    flops_bound: float = 0.0
    timed_out: bool = False
    options: tuple[Option, ...] = ()


@dataclass
class _Context:
    """What solving a budget and weighing its plan read, computed once per joint. It holds the
    joint weakly: the family cache must not keep a joint alive (:func:`candidates`)."""

    joint_ref: weakref.ref[JointGraph]
    needed: dict[fx.Node, str]
    free_inputs: set[fx.Node]
    time_limit: float
    backward: _Backward
    inputs: list[fx.Node]
    # The budget program's parts, shared by every solve (``budget_solver.shared_problems``),
    # and the joint's nodes' facts, by every floor and split (Note [Plans share their nodes'
    # facts] in ``partition/memory.py``).
    problems: dict[Any, Any] = field(default_factory=dict)
    facts: dict[Any, Any] = field(default_factory=dict)

    @property
    def joint(self) -> JointGraph:
        joint = self.joint_ref()
        if joint is None:  # a family is only asked for plans while its joint is planned
            raise AssertionError("expected the family's joint graph alive, got it collected")
        return joint


@dataclass
class Family:
    """The plans of one joint graph in their fixed order, budgets solved as the choice asks."""

    slots: list[_Slot]
    context: _Context
    # Why the family is smaller than usual (the solver ran out of time finding a floor).
    floor_note: str | None = None
    # The options split so far, by position: a budget splits only those it must (Note [Peak
    # budgets]), and another budget on the same joint finds them here.
    split: dict[int, Candidate] = field(default_factory=dict)
    # Whether every solved plan respects the FLOPs bounds (Note [Budgets solved when the
    # choice needs them]); once False, no bound is used.
    bounds_hold: bool = True
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def options(self) -> tuple[Option, ...]:
        """Every option of the family, every budget solved."""
        for slot in self.slots:
            self.solve(slot)
        return self.known()

    def known(self) -> tuple[Option, ...]:
        """The options of the plans solved so far, in order; a plan met before (the same saved
        and recomputed values) counts once, under its first label."""
        seen: set[tuple[frozenset[fx.Node], frozenset[fx.Node]]] = set()
        options: list[Option] = []
        for slot in self.slots:
            if slot.plan is None:
                continue
            identity = (frozenset(slot.plan.saved), frozenset(slot.plan.recompute))
            if identity not in seen:
                seen.add(identity)
                options.extend(slot.options)
        return tuple(options)

    def waiting(self) -> list[_Slot]:
        """The budgets not solved yet."""
        return [s for s in self.slots if not s.solved]

    def least_flops(self, slot: _Slot) -> float:
        """A lower bound on the FLOPs of ``slot``'s plan before it is solved (Note [Budgets
        solved when the choice needs them]); -inf once a plan broke a bound."""
        if not self.bounds_hold:
            return -math.inf
        bounds = [
            s.flops_bound
            for s in self.slots
            if s.solved and s.series is slot.series and s.cap >= slot.cap and not s.timed_out
        ]
        return max(bounds, default=0.0)

    def solve(self, slot: _Slot) -> None:
        """Solve ``slot``'s budget (once) and weigh its plan."""
        with self.lock:
            if slot.solved:
                return
            _solve(self.context, slot)
            slot.solved = True
            self.bounds_hold = self.bounds_hold and _within_bounds(self, slot)

    @property
    def note(self) -> str | None:
        """What limited the family: budgets the solver's time limit cut short, so far."""
        cut = [s.label for s in self.slots if s.solved and s.timed_out]
        notes = [self.floor_note] if self.floor_note else []
        if cut:
            notes.append(
                f"the budget solver hit its {self.context.time_limit:g} s time limit at"
                f" {', '.join(cut)}: those candidates are the best found or left out and may"
                " differ between runs (raise time_limit in aotgrad.budget)"
            )
        return "; ".join(notes) or None


def _within_bounds(family: Family, solved: _Slot) -> bool:
    """Whether the plans of ``solved``'s series recompute at least the bound of every solved
    budget of the series at a cap at least theirs (Note [Budgets solved when the choice needs
    them])."""
    if solved.series is None:
        return True
    series = [s for s in family.slots if s.solved and s.series is solved.series]
    # The solver's bound, less its tolerance: its objective is a sum of floats.
    return all(
        o.flops >= bound.flops_bound * (1 - 1e-6) - 1
        for s in series
        for o in s.options
        for bound in series
        if bound.cap >= s.cap and not bound.timed_out
    )


# Families by joint graph: another peak on the same joint re-splits one plan. An entry
# holds plans (fx nodes of the joint's module), never the JointGraph itself, and leaves
# when the joint is collected.
_FAMILIES: dict[int, tuple[weakref.ref[JointGraph], float, Family]] = {}
_LOCK = threading.Lock()


def candidates(joint: JointGraph, time_limit: float) -> Family:
    """The fixed family of plans for ``joint`` (Note [Peak budgets]), cached per joint."""
    key = id(joint)
    with _LOCK:
        entry = _FAMILIES.get(key)
    if entry is not None and entry[0]() is joint and entry[1] == time_limit:
        return entry[2]
    family = build_family(joint, time_limit)
    with _LOCK:
        fresh = key not in _FAMILIES
        _FAMILIES[key] = (weakref.ref(joint), time_limit, family)
    if fresh:
        weakref.finalize(joint, _FAMILIES.pop, key, None)
    return family


def build_family(joint: JointGraph, time_limit: float) -> Family:
    """A new family for ``joint``: save_all, mincut and the matmul policy weighed, the
    budgets' caps set (two floor solves), no budget solved yet."""
    full = save_all(joint)
    context = _Context(
        joint_ref=weakref.ref(joint),
        needed=needed_by_backward(joint),
        free_inputs={n for n in full.saved if n.op == "placeholder"},
        time_limit=time_limit,
        backward=_Backward.of(joint),
        inputs=[n for n in joint.gm.graph.nodes if n.op in ("placeholder", "get_attr")],
    )
    known = [
        ("save_all", full),
        ("mincut", mincut(joint)),
        ("saved matmul/convolution/attention outputs", with_policy(joint, _saves_matmul_class)),
    ]
    slots = [_Slot(label, i, solved=True, plan=plan) for i, (label, plan) in enumerate(known)]
    top = hinted_bytes(full.saved)  # Note [Budgets at the example sizes]
    matmuls = frozenset(n for n in forward_ops(joint) if is_compute_intensive(n.target))
    floor_note = None
    for suffix, kept, fractions in (
        ("", frozenset(), FRACTIONS),
        (_NO_MATMUL, matmuls, FRACTIONS[:-1]),
    ):
        if suffix and not kept:
            continue
        floor = _floor(context, kept)
        if floor is None:
            what = "the smallest plan" + (suffix and " without matmul recompute")
            floor_note = (
                f"the budget solver hit its {time_limit:g} s time limit finding {what};"
                " those budgets are left out (raise time_limit in aotgrad.budget)"
            )
            continue
        series = _Series(suffix, kept, min(floor, top))
        caps = {series.floor + int(f * (top - series.floor)): None for f in fractions}
        for cap in caps:  # as Budget.bytes_for, each once (a floor at the top gives one cap)
            slots.append(_Slot(f"saved-bytes cap {cap}{suffix}", len(slots), series, cap))
    family = Family(slots=slots, context=context, floor_note=floor_note)
    with shared_node_facts(context.facts):  # every plan's floor reads the same nodes
        for slot in slots[: len(known)]:
            slot.plan = apply_checkpoint_policy(joint, slot.plan)  # type: ignore[arg-type]
            slot.options = _options_of(context, slot)
    return family


_NO_MATMUL = ", no matmul recomputed"


def _floor(context: _Context, kept: frozenset[fx.Node]) -> int | None:
    from aotgrad.partition.budget_solver import shared_problems, smallest_saved_bytes  # SciPy

    with shared_problems(context.problems):
        return smallest_saved_bytes(
            context.joint, context.needed, context.free_inputs, context.time_limit, kept
        )


def _solve(context: _Context, slot: _Slot) -> None:
    """``slot``'s budget solved within ``REL_GAP``, its plan weighed (Note [Budget units])."""
    from aotgrad.partition.budget_solver import budget_saved, shared_problems  # SciPy

    assert slot.series is not None
    joint = context.joint
    with shared_problems(context.problems):
        result = budget_saved(
            joint,
            context.needed,
            slot.cap,
            context.time_limit,
            context.free_inputs,
            rel_gap=REL_GAP,
            kept=slot.series.kept,
        )
    slot.flops_bound = result.flops_bound
    slot.timed_out = result.saved is None or result.note is not None
    if result.saved is not None:
        plan = from_saved(joint, context.needed, result.saved, slot.label)
        slot.plan = apply_checkpoint_policy(joint, plan)
        with shared_node_facts(context.facts):
            slot.options = _options_of(context, slot)


def _options_of(context: _Context, slot: _Slot) -> tuple[Option, ...]:
    """``slot``'s plan as options: in the default order, and recomputed at the backward's
    start when that moves something (else the same graphs count once)."""
    assert slot.plan is not None
    joint, graph, plan = context.joint, context.backward, slot.plan
    live = graph.live(plan.recompute)
    intensive, flops = graph.recompute_cost(plan.recompute, live)
    floor = held_after_forward(context.inputs, [*joint.forward_results(), *plan.saved])
    first = Option(slot.label, plan, intensive, flops, floor, 2 * slot.index)
    orders = [
        backward_order(joint, plan.recompute, recompute_late=late, backward_ops=graph.ops)
        for late in (True, False)
    ]
    if orders[0] == orders[1]:
        return (first,)
    early = replace(plan, recompute_late=False)
    named = f"{slot.label}, recomputed at the backward's start"
    held = graph.held_after_recompute(plan, orders[1], live)
    floor_early = max(floor, held_after_forward(context.inputs, held))
    return first, Option(named, early, intensive, flops, floor_early, first.position + 1)


@dataclass(frozen=True)
class _Backward:
    """What every plan's backward graph starts from, for counting its recompute off the joint."""

    # The joint's nodes, last first.
    reversed_nodes: tuple[fx.Node, ...]
    # The backward's own ops and checkpoint regions (not its placeholders).
    ops: frozenset[fx.Node]
    # What it returns, and the nodes dead-code removal keeps (``must_run``).
    results: frozenset[fx.Node]
    kept: frozenset[fx.Node]

    @staticmethod
    def of(joint: JointGraph) -> _Backward:
        ops = frozenset(n for n in joint.backward_nodes() if n.op != "placeholder")
        return _Backward(
            reversed_nodes=tuple(reversed(joint.gm.graph.nodes)),
            ops=ops,
            results=frozenset(n for n in joint.backward_results() if n is not None),
            kept=frozenset(n for n in joint.gm.graph.nodes if n.op != "output" and must_run(n)),
        )

    def live(self, recompute: set[fx.Node]) -> set[fx.Node]:
        """The backward's ops and a plan's recomputed ops that survive dead-code removal
        (``remove_dead_code``)."""
        live: set[fx.Node] = set()
        for node in self.reversed_nodes:
            if (node in self.ops or node in recompute) and (
                node in self.results or node in self.kept or not live.isdisjoint(node.users)
            ):
                live.add(node)
        return live

    def recompute_cost(
        self, recompute: set[fx.Node], live: set[fx.Node] | None = None
    ) -> tuple[int, int]:
        """(matmul-class, all) FLOPs of the forward ops a plan's backward re-runs, counted as
        the split keeps them: its recomputed ops and checkpoint regions among ``live`` (what
        survives dead-code removal; ``partition._recomputed`` counts the same)."""
        live = self.live(recompute) if live is None else live
        ran = [
            n
            for n in live
            if n.op == "call_function" and (n in recompute or phase_of(n) is Phase.RECOMPUTE)
        ]
        costs = [(is_compute_intensive(n.target), node_flops(n)) for n in ran]
        return sum(f for hot, f in costs if hot), sum(f for _, f in costs)

    def held_after_recompute(
        self, plan: RematPlan, order: list[fx.Node], live: set[fx.Node]
    ) -> list[fx.Node]:
        """The values live when the recomputed ops that lead ``order`` (the backward's order
        with everything recomputed at its start) have run: those of them and of the saved
        values that a later op reads or the backward returns (Note [A floor under a plan's
        peak] in ``partition/memory.py``)."""
        first = next((i for i, n in enumerate(order) if n not in plan.recompute), len(order))
        leading = [n for n in order[:first] if n in live]
        read = {u for n in order[first:] if n in live for u in n.all_input_nodes}
        held = [n for n in leading if n in read or n in self.results]
        return held + [s for s in plan.saved if s in read or s in self.results]


def _saves_matmul_class(node: fx.Node) -> bool:
    """The policy of the family's "save matmuls" candidate (Note [Peak budgets])."""
    return is_compute_intensive(node.target)
