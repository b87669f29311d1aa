"""The partition strategies: ``"save_all"``, ``"mincut"``, ``aotgrad.budget(x)``,
``aotgrad.budget(peak=BYTES)`` (its plans: ``partition/peak_budget.py``), or a policy.

Each turns a joint graph into a :class:`RematPlan`; every saved value and
every recomputed op gets a reason (Note [Saved and recomputed]). A policy is
your own strategy: a function answering "save this op's output?" (Note
[Partition policies]).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from aotgrad.capture import JointGraph, Phase, node_info
from aotgrad.errors import ConfigError, PartitionError
from aotgrad.ops.table import is_free_view, op_name
from aotgrad.partition.remat import (
    RematPlan,
    forward_ops,
    is_size_node,
    is_tensor_node,
    is_view_node,
    mincut_saved,
    needed_by_backward,
    never_recomputed,
    reads_mutated_input,
    recompute_closure,
    why_never_recomputed,
)
from aotgrad.partition.sizes import hinted_bytes


@dataclass(frozen=True)
class Budget:
    """A memory budget for the saved values, or for the step's peak: see :func:`budget`."""

    # A fraction (0, 1] of the way from the smallest plan any strategy can make to
    # "save_all", or a byte count (> 1) bounding ``Partitioned.saved_bytes`` itself
    # (Note [Budget units]); None for a peak budget.
    limit: float | None
    # Seconds HiGHS may spend on each solve; past it the best plan found is used, and the
    # plan says so.
    time_limit: float = 10.0
    # Bytes bounding ``Partitioned.peak.allocated``, the step's peak above its inputs
    # (Note [Peak budgets] in ``partition/peak_budget.py``); None for a saved-bytes budget.
    peak: int | None = None

    def __post_init__(self) -> None:
        if (self.limit is None) == (self.peak is None):
            raise TypeError(
                "aotgrad.budget takes exactly one of a saved-bytes limit, budget(x), or a peak,"
                f" budget(peak=BYTES); got limit={self.limit!r}, peak={self.peak!r}"
            )
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(f"a budget must be positive, got {self.limit}")
        if self.peak is not None and (type(self.peak) is not int or self.peak < 0):
            raise ConfigError(
                f"budget(peak=...) takes a whole number of bytes >= 0, got {self.peak!r}"
            )

    def bytes_for(self, joint: JointGraph) -> int:
        """The cap on saved bytes, inputs included (what ``Partitioned.saved_bytes`` reports)."""
        if self.limit is None:
            raise TypeError(f"{self} bounds the peak, not the saved bytes: it has no byte cap")
        if self.limit > 1:
            return int(self.limit)
        saved = save_all(joint).saved
        top = hinted_bytes(saved)  # Note [Budgets at the example sizes]
        inputs = {n for n in saved if n.op == "placeholder"}
        from aotgrad.partition.budget_solver import smallest_saved_bytes  # numpy, SciPy

        floor = smallest_saved_bytes(joint, needed_by_backward(joint), inputs, self.time_limit)
        floor = hinted_bytes(inputs) if floor is None else min(floor, top)
        return floor + int(self.limit * (top - floor))

    def __str__(self) -> str:
        return f"budget(peak={self.peak})" if self.limit is None else f"budget({self.limit:g})"


# Note [Budget units]
# ~~~~~~~~~~~~~~~~~~~
# A budget bounds the number the plan reports, ``Partitioned.saved_bytes``:
# unique storages the backward receives, inputs included (Note [Counting
# bytes] in ``partition/saved.py``). A byte count is
# that cap as given; a fraction x interpolates between the smallest plan
# (x → 0: the inputs ``save_all`` saves, plus what cannot be recomputed)
# and ``save_all`` itself (x = 1), so every fraction has a plan. On a 2-block
# MLP whose ``save_all`` saves 1 MB of weights and 4 MB of activations:
#
#     budget(0.5)        -> saved_bytes <= 1 MB + 0.5 * 4 MB = 3 MB
#     budget(3_000_000)  -> saved_bytes <= 3 MB, the same cap
#     budget(500_000)    -> ValueError: the weights alone take 1 MB
#
# Add a BatchNorm in training mode: it reads the running stats the function
# updates, so it is never recomputed and its 1 MB output is saved by every
# plan. The floor is then 2 MB and budget(0.5) caps at 2 + 0.5 * 3 = 3.5 MB
# (measured against the inputs alone, 3 MB would leave no plan on most
# conv nets).
#
# Inputs are held by the caller anyway, but they count: the solver pays for
# an input only recomputation needs (a bias ``save_all`` never saves), so no
# plan saves more than ``save_all``, and ``budget(p.saved_bytes)`` for any
# plan ``p`` finds one at least as cheap in recompute FLOPs.


def budget(
    limit: float | None = None, time_limit: float = 10.0, *, peak: float | None = None
) -> Budget:
    """Save at most ``limit`` bytes (if > 1), or the fraction ``limit`` of the way from the
    smallest plan to ``save_all`` (Note [Budget units]), recomputing as few FLOPs as possible;
    or, with ``peak=BYTES``, keep the step's predicted peak at most ``BYTES``.

    The plan minimizes recompute FLOPs exactly (a mixed-integer program solved by
    HiGHS), and among equally cheap plans saves the fewest bytes, so a smaller
    budget never saves more. It bounds what the backward keeps, not the step's
    peak: a plan that recomputes and leaves the predicted peak at ``save_all``'s
    says so in its ``note`` (Note [A saved-bytes budget and the peak]).

    ``peak`` counts the bytes a step ``f(*inputs).backward()`` allocates at its
    peak above its inputs (``Partitioned.peak.allocated``, what
    ``aotgrad.testing.measure_peak`` measures; ``.grad`` None before the step).
    The plan is the least-recompute one among a fixed family of candidates
    whose predicted peak fits, so a smaller peak budget never gives a larger
    peak (Note [Peak budgets]); below the smallest peak of the family it raises
    ``ValueError`` with that peak.

    Under dynamic shapes every budget is posed at the example inputs' sizes, and the
    plan serves every size the guards admit (Note [Budgets at the example sizes]).

    >>> import torch, aotgrad
    >>> def f(x, w):
    ...     return (x @ w).relu().sin().sum()
    >>> x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    >>> traced = aotgrad.trace(f, x, w, partition=aotgrad.budget(0.5))
    >>> [s.name for s in traced.saved if not s.is_input]  # save_all keeps relu: 256 bytes
    []
    >>> [r.name for r in traced.partitioned.recomputed]
    ['mm', 'relu']
    >>> traced.partitioned.saved_bytes  # x and w
    512

    A peak budget on two wide layers sharing their weights: ``save_all`` keeps both
    (64, 256) relu outputs for the backward; recomputing the first from ``x`` just
    before its layer's backward keeps the two apart (Note [Recompute just before use]).

    >>> def g(x, w1, w2):
    ...     h = (x @ w1).relu() @ w2
    ...     return ((h @ w1).relu() @ w2).sum()
    >>> x = torch.randn(64, 16)
    >>> w1, w2 = torch.randn(16, 256, requires_grad=True), torch.randn(256, 16, requires_grad=True)
    >>> full = aotgrad.trace(g, x, w1, w2).partitioned
    >>> full.peak.allocated, full.recompute_flops  # bytes above x, w1, w2 at the step's peak
    (282632, 0)
    >>> tight = aotgrad.trace(g, x, w1, w2, partition=aotgrad.budget(peak=250_000)).partitioned
    >>> tight.peak.allocated, tight.recompute_flops, tight.strategy
    (229384, 540672, 'budget(peak=250000)')
    >>> aotgrad.trace(g, x, w1, w2, partition=aotgrad.budget(peak=200_000))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    aotgrad.errors.PartitionError: no plan fits budget(peak=200000): the smallest predicted peak of ... is 229384 bytes...
    """
    return Budget(None if limit is None else float(limit), time_limit, peak=_whole_bytes(peak))


def _whole_bytes(peak: float | None) -> int | None:
    """``peak=`` as an int: ``10**9`` and ``1e9`` alike; a fraction of a byte, or not a number,
    is refused."""
    if peak is None:
        return None
    if isinstance(peak, bool) or not isinstance(peak, numbers.Real):
        raise TypeError(f"budget(peak=...) takes a number of bytes, got {type(peak).__name__}")
    if isinstance(peak, numbers.Integral):
        return int(peak)
    if not float(peak).is_integer():
        raise ConfigError(f"budget(peak=...) takes a whole number of bytes, got {peak!r}")
    return int(peak)


def save_all(joint: JointGraph) -> RematPlan:
    """Save what the backward reads; recompute nothing but free views and constants.

    Views are replayed on their saved source (Note [Saved and recomputed] in ``remat.py``).
    """
    plan = RematPlan(saved=[], recompute=set())
    chosen: dict[fx.Node, str] = {}
    for node, reason in needed_by_backward(joint).items():
        _save_or_replay(node, reason, chosen, plan)
    plan.saved = _in_order(joint, chosen)
    plan.save_reasons = chosen
    return plan


def _save_or_replay(
    node: fx.Node, reason: str, chosen: dict[fx.Node, str], plan: RematPlan
) -> None:
    if node.op == "get_attr":  # a constant the graph holds: the backward reads it directly
        plan.recompute.add(node)
        plan.recompute_reasons[node] = "graph constant"
    elif node.op == "call_function" and is_free_view(node.target):
        plan.recompute.add(node)
        plan.recompute_reasons[node] = "free view: replayed on its saved source"
        for source in node.all_input_nodes:
            _save_or_replay(source, f"source of view {node.name}, {reason}", chosen, plan)
    else:
        chosen.setdefault(node, reason)


def mincut(joint: JointGraph) -> RematPlan:
    """Min-cut rematerialization (Note [Saved and recomputed])."""
    needed = needed_by_backward(joint)
    return from_saved(joint, needed, mincut_saved(joint, needed), "min-cut")


def with_budget(joint: JointGraph, limit: Budget) -> RematPlan:
    needed = needed_by_backward(joint)
    budget_bytes = limit.bytes_for(joint)
    free_inputs = {n for n in save_all(joint).saved if n.op == "placeholder"}
    from aotgrad.partition.budget_solver import budget_saved  # numpy, SciPy: only for a budget

    result = budget_saved(joint, needed, budget_bytes, limit.time_limit, free_inputs)
    label = f"{limit} ({budget_bytes} bytes)"
    plan = (
        save_all(joint) if result.saved is None else from_saved(joint, needed, result.saved, label)
    )
    plan.note = result.note
    return plan


# Note [Partition policies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A policy decides, the library does the rest (as JAX's checkpoint policies).
# It is called once per forward op with the op's node (``node.target``,
# ``node.meta["val"]``) and answers True (save the output) or False
# (recompute it in the backward). The True answers the backward reads are
# saved, the rest of what it reads is recomputed from them (Note [Saved and
# recomputed]). With ``lambda node: node.target is aten.mm.default``:
#
#     forward:  a = mm(x, w); b = relu(a); out = mm(b, w2)
#     the backward reads x, w, w2 and b (relu's gradient reads its output)
#     answers:  a -> True, b -> False, out -> True (no backward op reads out)
#     saved:    x, w, w2 and a; recomputed: b = relu(a)
#
# It is not asked about what no plan recomputes, which is saved: random ops,
# collectives, ops reading an input the function mutates, and what a
# checkpoint region's re-run reads (its inputs, a selective checkpoint's
# ``MUST_SAVE`` values); the region itself is re-run whatever the answers,
# and ``node.meta["recompute"]`` tags apply last (Note [Selective checkpoint
# policies]). Views are replayed on their source; a multi-output op is asked
# once, for all its elements. An answer that is not a bool, or a policy that
# raises (as a ``JointGraph -> Partitioned`` callable, the form before
# policies, does), is a PartitionError naming the op and how to port it.
Policy = Callable[[fx.Node], bool]


def with_policy(joint: JointGraph, policy: Policy) -> RematPlan:
    """Save what ``policy`` answers True for, and what no plan recomputes (Note [Partition
    policies]); recompute the rest of what the backward reads."""
    pinned = reads_mutated_input(joint)
    checkpointed = {s for n in joint.nodes(Phase.RECOMPUTE) for s in n.all_input_nodes}
    answers: dict[fx.Node, bool] = {}  # per op: a multi-output op is asked once
    forced: dict[fx.Node, str] = {}
    saved: set[fx.Node] = set()
    for node in forward_ops(joint):
        op = node.args[0] if node.target is operator.getitem else node
        if is_size_node(node):  # a size the backward reads: an int, not the policy's to weigh
            saved.add(node)
        if not is_tensor_node(node) or not isinstance(op, fx.Node):
            continue
        if (why := why_never_recomputed(op)) is not None:
            forced[node] = why
        elif node in pinned:
            forced[node] = "reads an input the function mutates: never recomputed"
        elif node in checkpointed:
            forced[node] = "a checkpoint region saves it (torch.utils.checkpoint)"
        elif not is_view_node(node):
            answers[op] = answers[op] if op in answers else _answer(policy, op)
            if answers[op]:
                saved.add(node)
    plan = from_saved(joint, needed_by_backward(joint), saved | set(forced), policy_name(policy))
    for node in set(plan.saved) & set(forced):
        plan.save_reasons[node] += f"; {forced[node]}"
    return plan


def policy_name(policy: Policy) -> str:
    return f"policy {getattr(policy, '__qualname__', None) or policy!r}"


def _answer(policy: Policy, op: fx.Node) -> bool:
    try:
        answer = policy(op)
    except Exception as error:
        why = f"raised {type(error).__name__}: {error}\n  asked about"
        raise PartitionError(f"partition {policy_name(policy)} {why} {_about(op)}") from error
    if not isinstance(answer, bool):
        why = f"answered {type(answer).__name__} {answer!r:.80}, not True or False, about"
        raise PartitionError(f"partition {policy_name(policy)} {why} {_about(op)}")
    return answer


def _about(op: fx.Node) -> str:
    source = node_info(op).source
    return (
        f"forward op {op.name} ({op_name(op.target)}){'' if source is None else f' at {source}'}"
        "\nA policy takes one forward op's fx.Node and returns True (save its output) or False"
        " (recompute it), e.g. `lambda node: node.target is torch.ops.aten.mm.default`; a"
        " callable JointGraph -> Partitioned is no longer accepted: return the decision for"
        " one op (Note [Partition policies])"
    )


def from_saved(
    joint: JointGraph, needed: Mapping[fx.Node, str], saved: set[fx.Node], label: str
) -> RematPlan:
    """Recompute everything the backward needs from ``saved``; keep only saved values it uses."""
    recompute, inputs = recompute_closure(needed, saved)
    users = {u for node in recompute for u in node.all_input_nodes}
    kept = {n for n in saved if n in needed or n in users} | inputs
    reasons = {}
    for node in kept:
        why = needed.get(node) or "input of a recomputed op"
        if node in inputs and node.op != "placeholder":
            why += f"; {why_never_recomputed(node)}"
        reasons[node] = why if node.op == "placeholder" else f"{label}: {why}"
    recomputed = f"{label}: recomputed from saved values"
    recompute_reasons = {
        n: "graph constant" if n.op == "get_attr" else recomputed for n in recompute
    }
    return RematPlan(
        saved=_in_order(joint, kept),
        recompute=recompute,
        save_reasons=reasons,
        recompute_reasons=recompute_reasons,
    )


# Note [Selective checkpoint policies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under a selective checkpoint (``create_selective_checkpoint_contexts``),
# PyTorch does not re-run the region itself while a graph is traced: it tags
# each forward op with its policy (``node.meta["recompute"]``) and leaves the
# decision to the partitioner. aotgrad honors the tags after any strategy:
#
#     mm  MUST_SAVE        -> saved
#     sin MUST_RECOMPUTE   -> not saved; re-run in the backward from the saved mm
#
# ``PREFER_RECOMPUTE`` is followed as ``MUST_RECOMPUTE``; random ops are
# saved whatever their tag (the backward must see the forward's draws), and so
# are collectives (Note [Collectives]). ``MUST_SAVE`` binds every strategy, not
# only this last step: the op is never recomputed (``why_never_recomputed``),
# so ``mincut`` cuts above it, a budget counts it in its floor and a policy
# answering False about it is overruled:
#
#     checkpoint(lambda x, w: (x * w).exp()),  exp MUST_SAVE, mul PREFER_RECOMPUTE
#     the backward reads x, w (mul's gradient) and exp (its own)
#     mincut, budget(0.01), lambda node: False:  save x, w and exp, though
#         recomputing exp from x and w would save 256 fewer bytes (8x8 floats)
#
# ``PREFER_SAVE`` is a preference a strategy may override: a budget recomputes
# it when that fits. The tags are read off the graph, and only the full trace
# records them: the direct trace stops at a selective checkpoint (Note
# [Selective checkpoints stop the direct trace]).
_RECOMPUTE_POLICIES = {CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE}


def apply_checkpoint_policy(joint: JointGraph, plan: RematPlan) -> RematPlan:
    """Re-plan so ops a selective checkpoint tags for recompute are recomputed."""
    tagged = {
        n
        for n in joint.nodes(Phase.FORWARD)
        if n.meta.get("recompute") in _RECOMPUTE_POLICIES and not never_recomputed(n)
    }
    if not tagged:
        return plan
    boundary = {u for v in tagged for u in v.all_input_nodes if u not in tagged}
    saved = (set(plan.saved) - tagged) | boundary
    policy_plan = from_saved(joint, needed_by_backward(joint), saved, "selective checkpoint")
    for node in policy_plan.recompute:
        if node in tagged:
            policy_plan.recompute_reasons[node] = (
                f"selective checkpoint policy {node.meta['recompute'].name}"
            )
        elif node in plan.recompute_reasons:
            policy_plan.recompute_reasons[node] = plan.recompute_reasons[node]
    kept = [n for n in policy_plan.saved if n in plan.save_reasons]
    policy_plan.save_reasons.update({n: plan.save_reasons[n] for n in kept})
    policy_plan.note = plan.note
    return policy_plan


def _in_order(joint: JointGraph, nodes: Mapping[fx.Node, object] | set[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    return sorted(nodes, key=order.__getitem__)
