"""Choosing what the backward saves and what it recomputes: min-cut and an exact budget solver.

Note [Saved and recomputed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward reads some forward values (``needed``). A partition picks a
``saved`` set; everything else the backward needs is recomputed from it,
walking back through forward ops until saved values or inputs::

    forward:  a = mm(x, w); b = relu(a); c = sin(b); out = mm(c, w2)
    needed by the backward: b (for relu's grad), c (for mm's grad), w, w2
    save_all: save b, c                     (recompute nothing)
    mincut:   save b; recompute c = sin(b)  (c costs as many bytes as b;
              saving one pointwise input beats saving both)
    budget(0.5): the same if it fits, chosen by an integer program that
              minimizes recompute FLOPs within the byte budget

Inputs are always available to the backward: min-cut saves one at no cost
(the caller holds it anyway), while a budget counts the bytes of every input
a plan saves (Note [Budget units]). Views are never saved (their base is, and
the view is replayed on it); random ops are never recomputed (the backward
must see the forward's draws), nor are collectives (Note [Collectives]).
Bytes are counted as Note [Counting bytes] says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import Bounds, LinearConstraint, milp

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.optable import cheap_to_recompute, draws_random, flops, is_collective, is_free_view
from aotgrad.partition.saved import unique_bytes

INF = math.inf


@dataclass
class RematPlan:
    """What the backward receives (``saved``, in forward order) and what it re-runs."""

    saved: list[fx.Node]
    recompute: set[fx.Node]
    # Why each saved node is saved, and why each recomputed node is recomputed.
    save_reasons: dict[fx.Node, str] = field(default_factory=dict)
    recompute_reasons: dict[fx.Node, str] = field(default_factory=dict)
    # Anything the solver wants the user to know (a time limit hit, say).
    note: str | None = None


def needed_by_backward(joint: JointGraph) -> dict[fx.Node, str]:
    """Forward values the backward reads, each with the first backward node reading it."""
    needed: dict[fx.Node, str] = {}
    for node in joint.backward_nodes():
        for source in node.all_input_nodes:
            if phase_of(source) is Phase.FORWARD:
                needed.setdefault(source, f"read by backward op {node.name}")
    for grad in joint.grad_results():
        if grad is not None and phase_of(grad) is Phase.FORWARD:
            needed.setdefault(grad, "is a gradient")
    return needed


def never_recomputed(node: fx.Node) -> bool:
    """An op that draws from the RNG (the backward must see the forward's draws; attention
    without dropout draws nothing) or a collective (every rank must run the same ones, once:
    Note [Collectives]): saved, whatever the strategy."""
    if node.op != "call_function":
        return False
    return draws_random(node.target, node.args, node.kwargs) or is_collective(node.target)


def is_tensor_node(node: fx.Node) -> bool:
    """Produces one tensor (multi-output ops are saved through their ``getitem`` nodes)."""
    return isinstance(node.meta.get("val"), torch.Tensor)


def node_flops(node: fx.Node) -> int:
    args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
    return flops(node.target, args, node.meta.get("val"))


def is_view_node(node: fx.Node) -> bool:
    """A view op (``t``, ``split``) or an element of a multi-output view: no storage of its own."""
    if node.op != "call_function":
        return False
    if is_free_view(node.target) or getattr(node.target, "is_view", False):
        return True
    source = node.args[0] if node.args else None
    return (
        node.target.__name__ == "getitem"  # type: ignore[union-attr]
        and isinstance(source, fx.Node)
        and getattr(source.target, "is_view", False)
    )


def recompute_closure(
    needed: Iterable[fx.Node], saved: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """Everything to re-run so the backward has ``needed`` from ``saved``; plus what else to
    save: the inputs and collectives the re-run reads."""
    recompute: set[fx.Node] = set()
    inputs: set[fx.Node] = set()
    stack = [n for n in needed if n not in saved]
    while stack:
        node = stack.pop()
        if node in recompute or node in saved or node in inputs:
            continue
        if node.op == "placeholder" or never_recomputed(node):
            inputs.add(node)  # saved: an input, or a collective (Note [Collectives])
            continue
        recompute.add(node)
        stack.extend(node.all_input_nodes)
    return recompute, inputs


def reads_mutated_input(joint: JointGraph) -> set[fx.Node]:
    """Forward ops that depend on an input the function mutates: never recomputed.

    The runtime writes the new value into the caller's tensor after the
    forward, so the backward no longer has the old one to recompute from.
    """
    placeholders = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    tainted = {placeholders[i] for i in joint.mutated}
    for node in joint.gm.graph.nodes:
        if node.op == "call_function" and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    return tainted


def forward_ops(joint: JointGraph) -> list[fx.Node]:
    return [n for n in joint.nodes(Phase.FORWARD) if n.op == "call_function"]


def mincut_saved(joint: JointGraph, needed: Iterable[fx.Node]) -> set[fx.Node]:
    """Min-cut over a graph whose edge weights are tensor bytes (Note [Saved and recomputed]).

    Each forward op is an edge ``in → out`` weighing its output's bytes
    (infinite for views: their base is saved instead). Ops that must not be
    recomputed hang off the source; what the backward reads hangs off the
    sink. The cheapest cut is the set of values to save.
    """
    graph = nx.DiGraph()
    pinned = reads_mutated_input(joint)
    for node in forward_ops(joint):
        recomputable = (
            node not in pinned
            and not never_recomputed(node)
            and (cheap_to_recompute(node.target) or is_view_node(node))
        )
        # Views are replayed rather than saved, unless they cannot be recomputed.
        savable = is_tensor_node(node) and (not is_view_node(node) or not recomputable)
        capacity = unique_bytes([node]) if savable else INF  # Note [Counting bytes]
        graph.add_edge((node, "in"), (node, "out"), capacity=capacity)
        if not recomputable:
            graph.add_edge("source", (node, "in"), capacity=INF)
        for source in node.all_input_nodes:
            if source.op == "call_function":
                graph.add_edge((source, "out"), (node, "in"), capacity=INF)
    for node in needed:
        if node.op == "call_function":
            graph.add_edge((node, "out"), "sink", capacity=INF)
    if "sink" not in graph or "source" not in graph:
        return {n for n in needed if n.op == "call_function" and not is_view_node(n)}
    _, (source_side, _) = nx.minimum_cut(graph, "source", "sink")
    return {
        node
        for node in forward_ops(joint)
        if (node, "in") in source_side and (node, "out") not in source_side
    }


@dataclass(frozen=True)
class BudgetResult:
    # None when the solver found no plan in time (the caller falls back).
    saved: set[fx.Node] | None
    note: str | None


def budget_saved(
    joint: JointGraph,
    needed: Iterable[fx.Node],
    budget_bytes: int,
    time_limit: float,
    free_inputs: set[fx.Node],
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
    plan saves more than ``save_all``.
    """
    needed = list(needed)  # read several times below
    p = _BudgetProblem.of(joint, free_inputs, time_limit)
    constraint = p.constraint(needed, budget_bytes - p.held)
    first = p.solve(p.on_recompute(p.costs), [constraint])
    if first.x is None and first.status == 1:  # the time limit struck before any plan
        fallback = (
            f"the budget solver hit its {time_limit:g} s time limit before finding a plan;"
            " falling back to save_all (raise time_limit in aotgrad.budget)"
        )
        return BudgetResult(saved=None, note=fallback)
    if first.x is None:
        least = smallest_saved_bytes(joint, needed, free_inputs, time_limit)
        smallest = "?" if least is None else str(least)
        raise ValueError(
            f"no plan fits a budget of {budget_bytes} bytes: the inputs the backward reads take"
            f" {p.held}, and with what cannot be recomputed (random ops, ops reading an input the"
            f" function mutates) the smallest plan saves {smallest} bytes. Raise the budget."
        )
    best = p.rounded(first.x, needed)
    tie = LinearConstraint(p.on_recompute(p.costs)[None, :], -np.inf, best.flops + 0.5)
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
    return BudgetResult(saved=chosen.saved, note=note)


def smallest_saved_bytes(
    joint: JointGraph, needed: Iterable[fx.Node], free_inputs: set[fx.Node], time_limit: float
) -> int | None:
    """The fewest bytes any plan saves (inputs included): the floor of every budget.

    Above the inputs when some values cannot be recomputed (random ops, ops
    reading an input the function mutates, such as a BatchNorm in training).
    None when the solver ran out of time.
    """
    needed = list(needed)
    p = _BudgetProblem.of(joint, free_inputs, time_limit)
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

    @staticmethod
    def of(joint: JointGraph, free_inputs: set[fx.Node], time_limit: float) -> _BudgetProblem:
        inputs = [
            p
            for p in joint.gm.graph.nodes
            if p.op == "placeholder" and phase_of(p) is Phase.FORWARD
        ]
        ops = [*inputs, *forward_ops(joint)]
        weights = np.array(
            [0 if is_view_node(v) or v in free_inputs else unique_bytes([v]) for v in ops],
            dtype=float,
        )
        return _BudgetProblem(
            ops=ops,
            index={n: i for i, n in enumerate(ops)},
            weights=weights,
            costs=np.array([node_flops(v) for v in ops], dtype=float),
            held=unique_bytes(free_inputs),
            bounds=_budget_bounds(ops, reads_mutated_input(joint)),
            time_limit=time_limit,
        )

    def constraint(self, needed: Iterable[fx.Node], cap: float | None) -> LinearConstraint:
        """What the backward reads is saved or recomputed; a recomputed op's op inputs are
        too; with a ``cap``, the saved bytes are at most that."""
        n, index = len(self.ops), self.index
        rows: list[np.ndarray] = []
        lower: list[float] = []
        upper: list[float] = []

        def add(row: np.ndarray, lo: float, hi: float) -> None:
            rows.append(row)
            lower.append(lo)
            upper.append(hi)

        for v in needed:
            if v in index:
                row = np.zeros(2 * n)
                row[index[v]] = row[n + index[v]] = 1
                add(row, 1, np.inf)
        for v in self.ops:
            for u in v.all_input_nodes:
                if u in index:  # recompute_v - save_u - recompute_u <= 0
                    row = np.zeros(2 * n)
                    row[n + index[v]] = 1
                    row[index[u]] -= 1
                    row[n + index[u]] -= 1
                    add(row, -np.inf, 0)
        if cap is not None:
            add(self.on_save(self.weights), -np.inf, float(cap))
        return LinearConstraint(np.array(rows), lower, upper)

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
            options={"time_limit": self.time_limit, "disp": False, "mip_rel_gap": 0.0},
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


def _budget_bounds(ops: list[fx.Node], pinned: set[fx.Node]) -> Bounds:
    n = len(ops)
    upper = np.ones(2 * n)
    for i, v in enumerate(ops):
        fixed = v.op == "placeholder" or never_recomputed(v) or v in pinned
        if fixed:  # never recompute a random op, a collective, or one reading a mutated input
            upper[n + i] = 0
        if not is_tensor_node(v) or (is_view_node(v) and not fixed):
            upper[i] = 0  # never save a tuple (its getitems are saved), nor a replayable view
    return Bounds(np.zeros(2 * n), upper)
