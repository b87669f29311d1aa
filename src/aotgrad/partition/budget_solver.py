"""The exact memory-budget solver: an integer program over save/recompute choices, solved by
SciPy's HiGHS (``milp``). Its own module so that numpy and SciPy load only when a budget is
solved (``aotgrad.budget``), never with ``import aotgrad`` (issue 29)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch.fx as fx
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csc_array

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.errors import PartitionError
from aotgrad.partition.remat import (
    forward_ops,
    is_size_node,
    is_tensor_node,
    is_view_node,
    never_recomputed,
    node_flops,
    reads_mutated_input,
    recompute_closure,
)
from aotgrad.partition.sizes import hinted_bytes

# A constraint matrix's rows as (row indices, column indices, values, lower bounds, upper bounds).
_Rows = tuple[list[int], list[int], list[float], list[float], list[float]]
# Within :func:`shared_problems`: each joint's problem, by joint, free inputs and kept ops.
_SHARED: ContextVar[dict[Any, _BudgetProblem] | None] = ContextVar("budget_problems", default=None)


@contextmanager
def shared_problems(store: dict[Any, Any] | None = None) -> Iterator[None]:
    """Solves of one joint inside share their problem's parts, built once: a peak budget's
    family solves the same program at many caps (Note [Peak budgets]). ``store`` keeps them
    for later scopes (a family solves its budgets when its choice needs them)."""
    token = _SHARED.set({} if store is None else store)
    try:
        yield
    finally:
        _SHARED.reset(token)


@dataclass(frozen=True)
class BudgetResult:
    # None when the solver found no plan in time (the caller falls back).
    saved: set[fx.Node] | None
    note: str | None
    # What the solver proved: no plan under the budget recomputes fewer FLOPs (its dual
    # bound; Note [Budgets solved when the choice needs them] in ``partition/family.py``).
    flops_bound: float = 0.0


def budget_saved(
    joint: JointGraph,
    needed: Iterable[fx.Node],
    budget_bytes: int,
    time_limit: float,
    free_inputs: set[fx.Node],
    *,
    rel_gap: float = 0.0,
    kept: frozenset[fx.Node] = frozenset(),
) -> BudgetResult:
    """The exact memory-budget solver: a mixed-integer program solved by HiGHS.

    Per forward op ``v``: ``save_v`` and ``recompute_v`` in {0, 1}.
    minimize  Σ flops(v) · recompute_v                       (then Σ bytes · save_v)
    subject   save_v + recompute_v ≥ 1           for v the backward reads
              recompute_v ≤ save_u + recompute_u for each op input u of v
              Σ bytes(v) · save_v ≤ budget − bytes(free_inputs);  views are never saved;
              random ops, and ops reading a mutated input, never recomputed
    Minimizing saved bytes second, among the FLOP-optimal plans, makes the
    result monotone: a smaller budget never saves more bytes. ``budget_bytes``
    caps the total, inputs included (Note [Budget units]). Inputs are
    variables too: ``free_inputs`` (what ``save_all`` saves anyway, and every
    plan with it) are paid for up front, others (a bias a recomputation needs) weigh their bytes, so no
    plan saves more than ``save_all``. ``rel_gap`` > 0 stops each solve within that
    fraction of the optimum (deterministic, unlike a time limit): a peak budget's
    candidates (Note [Peak budgets] in ``partition/peak_budget.py``). Ops in ``kept`` are
    never recomputed either (a peak budget's candidates that recompute no matmul).
    """
    needed = list(needed)  # read several times below
    p = _BudgetProblem.of(joint, free_inputs, time_limit, rel_gap, kept)
    constraint = p.constraint(needed, budget_bytes - p.held)
    first = p.solve(p.on_recompute(p.costs), [constraint])
    if first.x is None and first.status == 1:  # the time limit struck before any plan
        fallback = (
            f"the budget solver hit its {time_limit:g} s time limit before finding a plan;"
            " falling back to save_all (raise time_limit in aotgrad.budget)"
        )
        return BudgetResult(saved=None, note=fallback, flops_bound=_dual_bound(first))
    if first.x is None:
        least = smallest_saved_bytes(joint, needed, free_inputs, time_limit, kept)
        smallest = "?" if least is None else str(least)
        raise PartitionError(
            f"no plan fits a budget of {budget_bytes} bytes: the inputs the backward reads take"
            f" {p.held}, and with what cannot be recomputed (random ops, ops reading an input the"
            f" function mutates, MUST_SAVE values) the smallest plan saves {smallest} bytes. Raise the budget."
        )
    best = p.rounded(first.x, needed)
    scale = _row_scale(p.costs)  # Note [Rows scaled by a power of two]
    tie = LinearConstraint(
        p.on_recompute(p.costs * scale)[None, :], -np.inf, (best.flops + 0.5) * scale
    )
    second = p.solve(p.on_save(p.weights), [constraint, tie])
    candidates = [best]
    if second.x is not None:
        candidates.append(p.rounded(second.x, needed))
    fits = [c for c in candidates if c.bytes <= budget_bytes - p.held] or candidates
    chosen = min(fits, key=lambda c: (c.bytes > budget_bytes - p.held, c.flops, c.bytes))
    note: str | None = None
    if not (first.success and second.success):
        note = (
            f"the budget solver hit its {time_limit:g} s time limit; the plan is the best found,"
            " not proven optimal (raise time_limit in aotgrad.budget)"
        )
    return BudgetResult(saved=chosen.saved, note=note, flops_bound=_dual_bound(first))


def _dual_bound(result: Any) -> float:
    """HiGHS's proven lower bound on the least objective (0 when it reports none)."""
    bound = getattr(result, "mip_dual_bound", None)
    return 0.0 if bound is None or not math.isfinite(bound) else max(0.0, float(bound))


def smallest_saved_bytes(
    joint: JointGraph,
    needed: Iterable[fx.Node],
    free_inputs: set[fx.Node],
    time_limit: float,
    kept: frozenset[fx.Node] = frozenset(),
) -> int | None:
    """The fewest bytes any plan saves (inputs included): the floor of every budget.

    Above the inputs when some values cannot be recomputed (random ops, ops
    reading an input the function mutates, such as a BatchNorm in training).
    None when the solver ran out of time.
    """
    needed = list(needed)
    p = _BudgetProblem.of(joint, free_inputs, time_limit, kept=kept)
    least = p.solve(p.on_save(p.weights), [p.constraint(needed, None)])
    return None if least.x is None else p.held + p.rounded(least.x, needed).bytes


@dataclass(frozen=True)
class _Rounded:
    """A solver answer rounded to a plan, with its bytes and FLOPs counted exactly.

    HiGHS accepts values within 1e-6 of an integer, and with coefficients in
    the hundreds of millions that slack is worth a few FLOPs or bytes: the
    plan is re-measured from its saved set rather than read off the solution.
    """

    saved: set[fx.Node]
    bytes: int
    flops: int


@dataclass(frozen=True)
class _BudgetProblem:
    """The parts of the budget program that do not depend on the budget; its variables are
    ``[save_0..save_n, recompute_0..recompute_n]``."""

    # Forward inputs, then forward ops: one save and one recompute variable each.
    ops: list[fx.Node]
    index: dict[fx.Node, int]
    # Bytes a saved op costs (0 for views and for inputs every plan saves), and its FLOPs.
    weights: np.ndarray
    costs: np.ndarray
    # Bytes of the inputs every plan saves.
    held: int
    bounds: Bounds
    time_limit: float
    # HiGHS stops when its plan is proven within this fraction of the optimum (0: exact).
    rel_gap: float = 0.0
    # The constraint rows but the cap's, by what the backward reads: built once per problem.
    structure: dict[tuple[fx.Node, ...], _Rows] = field(default_factory=dict, compare=False)

    @staticmethod
    def of(
        joint: JointGraph,
        free_inputs: set[fx.Node],
        time_limit: float,
        rel_gap: float = 0.0,
        kept: frozenset[fx.Node] = frozenset(),
    ) -> _BudgetProblem:
        shared = _SHARED.get()
        key = (id(joint), frozenset(free_inputs), kept)
        if shared is not None and key in shared:  # the same problem at another time or gap
            return replace(shared[key], time_limit=time_limit, rel_gap=rel_gap)
        inputs = [
            p
            for p in joint.gm.graph.nodes
            if p.op == "placeholder" and phase_of(p) is Phase.FORWARD
        ]
        ops = [*inputs, *forward_ops(joint)]
        weights = np.array(
            [0 if is_view_node(v) or v in free_inputs else hinted_bytes([v]) for v in ops],
            dtype=float,
        )
        problem = _BudgetProblem(
            ops=ops,
            index={n: i for i, n in enumerate(ops)},
            weights=weights,
            costs=np.array([node_flops(v) for v in ops], dtype=float),
            held=hinted_bytes(free_inputs),  # Note [Weights at the example sizes]
            bounds=_budget_bounds(ops, reads_mutated_input(joint) | kept),
            time_limit=time_limit,
            rel_gap=rel_gap,
        )
        if shared is not None:
            shared[key] = problem
        return problem

    def constraint(self, needed: Iterable[fx.Node], cap: float | None) -> LinearConstraint:
        """What the backward reads is saved or recomputed; a recomputed op's op inputs are
        too; with a ``cap``, the saved bytes are at most that. Sparse, row by row as a dense
        matrix would be: HiGHS receives the same matrix either way (``milp`` converts to CSC)."""
        needed = tuple(needed)
        if needed not in self.structure:
            self.structure[needed] = self._structure(needed)
        rows, cols, vals, lower, upper = (list(part) for part in self.structure[needed])
        if cap is not None:
            (nonzero,) = np.nonzero(self.weights)
            scale = _row_scale(self.weights)  # Note [Rows scaled by a power of two]
            rows += [len(lower)] * len(nonzero)
            cols += nonzero.tolist()
            vals += (self.weights[nonzero] * scale).tolist()
            lower.append(-np.inf)
            upper.append(float(cap) * scale)
        matrix = csc_array((vals, (rows, cols)), shape=(len(lower), 2 * len(self.ops)))
        matrix.sum_duplicates()  # also sorts the indices, as a dense matrix's CSC has them
        return LinearConstraint(matrix, lower, upper)

    def _structure(self, needed: tuple[fx.Node, ...]) -> _Rows:
        """The rows of :meth:`constraint` but the cap's: (rows, columns, values, lower, upper)."""
        n, index = len(self.ops), self.index
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lower: list[float] = []
        upper: list[float] = []
        for v in needed:
            if v in index:
                rows += [len(lower)] * 2
                cols += [index[v], n + index[v]]
                vals += [1.0, 1.0]
                lower.append(1)
                upper.append(np.inf)
        for v in self.ops:
            for u in v.all_input_nodes:
                if u in index:  # recompute_v - save_u - recompute_u <= 0
                    rows += [len(lower)] * 3
                    cols += [n + index[v], index[u], n + index[u]]
                    vals += [1.0, -1.0, -1.0]
                    lower.append(-np.inf)
                    upper.append(0)
        return rows, cols, vals, lower, upper

    def on_save(self, values: np.ndarray) -> np.ndarray:
        return np.concatenate([values, np.zeros(len(self.ops))])

    def on_recompute(self, values: np.ndarray) -> np.ndarray:
        return np.concatenate([np.zeros(len(self.ops)), values])

    def solve(self, objective: np.ndarray, constraints: list[LinearConstraint]) -> Any:
        return milp(
            objective,
            constraints=constraints,
            integrality=np.ones(2 * len(self.ops)),
            bounds=self.bounds,
            options={"time_limit": self.time_limit, "disp": False, "mip_rel_gap": self.rel_gap},
        )

    def rounded(self, x: np.ndarray, needed: Iterable[fx.Node]) -> _Rounded:
        """The plan of solver answer ``x`` (:class:`_Rounded`)."""
        saved = {v for v in self.ops if round(x[self.index[v]]) == 1}
        recompute, inputs = recompute_closure(needed, saved)
        used = set(needed) | {u for v in recompute for u in v.all_input_nodes} | inputs
        kept = {v for v in saved | inputs if v in used and v in self.index}
        return _Rounded(
            saved,
            int(sum(self.weights[self.index[v]] for v in kept)),
            int(sum(self.costs[self.index[v]] for v in recompute if v in self.index)),
        )


# Note [Rows scaled by a power of two]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The cap's row weighs each saved value by its bytes (up to hundreds of
# millions), the tie's row each recomputed op by its FLOPs, while every other
# row has coefficients of 1. HiGHS solves such a matrix more slowly (it warns of
# "excessively large row bounds"), so both rows are multiplied by a power of
# two that brings their largest coefficient into [1, 2): a row of 2**20 and
# 3 * 2**20 bytes under a cap of 5 * 2**20 becomes 1, 3 under 5. Multiplying by
# a power of two is exact in floating point, so the program is the same one; only
# HiGHS's path through it changes, and it takes fewer iterations (bench/findings.md,
# 2026-12-08). Its feasibility tolerance now reads in units of
# the largest coefficient (1e-7 of a megabyte is 0.1 byte), and every answer is
# re-measured exactly in any case (``_Rounded``).


def _row_scale(values: np.ndarray) -> float:
    """The power of two that brings ``values``' largest magnitude into [1, 2) (Note [Rows
    scaled by a power of two]); 1 for a row of zeros."""
    largest = float(np.abs(values).max(initial=0.0))
    if largest == 0.0:
        return 1.0
    _, exponent = math.frexp(largest)  # largest = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(1.0, 1 - exponent)


def _budget_bounds(ops: list[fx.Node], pinned: set[fx.Node]) -> Bounds:
    n = len(ops)
    upper = np.ones(2 * n)
    for i, v in enumerate(ops):
        fixed = v.op == "placeholder" or never_recomputed(v) or v in pinned
        if fixed:  # never recompute a random op, a collective, or one reading a mutated input
            upper[n + i] = 0
        if not (is_tensor_node(v) or is_size_node(v)) or (is_view_node(v) and not fixed):
            upper[i] = 0  # never save a tuple (its getitems are saved), nor a replayable view
    return Bounds(np.zeros(2 * n), upper)
