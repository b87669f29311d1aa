"""Stage 3: partition. Decide what the backward saves, and split the joint graph in two.

Entry point: :func:`partition`. Strategies: ``"save_all"``, ``"mincut"``,
``aotgrad.budget(x)``, ``aotgrad.budget(peak=BYTES)`` (Note [Peak budgets]), or a policy
``fx.Node -> bool`` (Note [Partition policies]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Literal

import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, node_info
from aotgrad.capture.analyses.collectives import check_order
from aotgrad.capture.graph import lazy_module
from aotgrad.errors import PartitionError
from aotgrad.ops.table import op_name
from aotgrad.partition.memory import LiveValue, PeakEstimate
from aotgrad.partition.partitioned import Partitioned, RecomputedOp
from aotgrad.partition.peak_budget import with_peak_budget, with_peak_note
from aotgrad.partition.remat import RematPlan, node_flops
from aotgrad.partition.saved import SavedValue, describe_saved
from aotgrad.partition.sizes import example_sizes, sizes_text
from aotgrad.partition.split import apply_mutations_in_graph, build_backward, build_forward
from aotgrad.partition.strategies import (
    Budget,
    Policy,
    apply_checkpoint_policy,
    budget,
    mincut,
    policy_name,
    save_all,
    with_budget,
    with_policy,
)
from aotgrad.signature import (
    Descriptor,
    MutatedInput,
    Saved,
    Signature,
    describe_graph,
)

__all__ = [
    "Budget",
    "LiveValue",
    "Partitioned",
    "PeakEstimate",
    "Policy",
    "RecomputedOp",
    "SavedValue",
    "budget",
    "partition",
    "split_plan",
]

Strategy = Literal["save_all", "mincut"] | Budget | Policy


def partition(
    joint: JointGraph,
    strategy: Strategy = "save_all",
    *,
    keep_input_mutations: bool = False,
) -> Partitioned:
    """Split ``joint`` into forward and backward graphs.

    With ``keep_input_mutations`` and no backward, the forward graph itself
    writes the new values into its inputs (``aten.copy_``) instead of
    returning them (Note [Mutations kept in the graph]).

    >>> import torch, aotgrad
    >>> traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
    >>> [s.name for s in traced.saved]
    ['x']
    """
    if not joint.has_backward:
        return _forward_only(joint, keep_input_mutations)
    if isinstance(strategy, Budget):  # under dynamic shapes: Note [Budgets at the example sizes]
        return _at_example_sizes(joint, _budget(joint, strategy))
    plan = apply_checkpoint_policy(joint, _plan(joint, strategy))
    return _split(joint, plan, policy_name(strategy) if callable(strategy) else str(strategy))


def _budget(joint: JointGraph, strategy: Budget) -> Partitioned:
    if strategy.peak is not None:
        return with_peak_budget(joint, strategy, partial(_split, joint))
    plan = apply_checkpoint_policy(joint, _plan(joint, strategy))
    partitioned = _split(joint, plan, str(strategy))
    everything = apply_checkpoint_policy(joint, save_all(joint))
    # Note [A saved-bytes budget and the peak]
    return with_peak_note(partitioned, _split(joint, everything, "save_all"))


def _at_example_sizes(joint: JointGraph, partitioned: Partitioned) -> Partitioned:
    """A budget's plan, its note naming the sizes its bytes were weighed at (dynamic shapes)."""
    sizes = example_sizes(joint)
    if not sizes:
        return partitioned
    note = (
        f"{partitioned.strategy} weighed its bytes at the example sizes {sizes_text(sizes)};"
        " the plan serves every size the guards admit, its bytes growing with the sizes"
        " (Note [Budgets at the example sizes])"
    )
    return replace(partitioned, note="; ".join(n for n in (partitioned.note, note) if n))


def _plan(joint: JointGraph, strategy: Strategy) -> RematPlan:
    if callable(strategy):
        return with_policy(joint, strategy)
    if isinstance(strategy, Budget):
        return with_budget(joint, strategy)
    named = {"save_all": save_all, "mincut": mincut}
    if strategy in named:
        return named[strategy](joint)
    raise PartitionError(
        f"unknown partition strategy {strategy!r}; expected 'save_all', 'mincut',"
        " aotgrad.budget(x) or a policy (Note [Partition policies])"
    )


def split_plan(joint: JointGraph, plan: RematPlan, strategy: str) -> Partitioned:
    """``joint`` split as ``plan`` says, named ``strategy``: how a peak budget's candidates are
    split, for a planner that weighs them itself (a scan's: Note [A scan's step peak])."""
    return _split(joint, plan, strategy)


def _split(joint: JointGraph, plan: RematPlan, strategy: str) -> Partitioned:
    backward, placeholders = build_backward(
        joint, plan.saved, plan.recompute, recompute_late=plan.recompute_late
    )
    saved = describe_saved(
        plan.saved,
        [[u.name for u in p.users if u.op != "output"] for p in placeholders],  # backward reads
        [plan.save_reasons[n] for n in plan.saved],
    )
    signature = joint.signature.with_saved(tuple(Saved(name=s.name) for s in saved))
    forward = _module(
        joint, build_forward(joint, plan.saved), signature.forward_inputs, signature.forward_outputs
    )
    backward_gm = _module(joint, backward, signature.backward_inputs, signature.backward_outputs)
    check_order(joint.gm.graph, [forward.graph, backward_gm.graph])  # Note [Collectives]
    return Partitioned(
        joint=joint,
        forward=forward,
        backward=backward_gm,
        saved=saved,
        signature=signature,
        recomputed=_recomputed(joint, plan, backward_gm),
        strategy=strategy,
        note=plan.note,
    )


def _recomputed(
    joint: JointGraph, plan: RematPlan, backward: fx.GraphModule
) -> tuple[RecomputedOp, ...]:
    names = {n.name for n in backward.graph.nodes}
    ops = []
    for node in joint.gm.graph.nodes:
        if node.op != "call_function" or node.name not in names:
            continue
        info = node_info(node)
        if node in plan.recompute:
            reason = plan.recompute_reasons.get(node, "recomputed")
        elif info.phase is Phase.RECOMPUTE:
            reason = "checkpoint region (torch.utils.checkpoint)"
        else:
            continue
        ops.append(
            RecomputedOp(
                name=node.name,
                op=op_name(node.target),
                module=info.module,
                source=info.source,
                flops=node_flops(node),
                reason=reason,
            )
        )
    return tuple(ops)


def _forward_only(joint: JointGraph, keep_input_mutations: bool) -> Partitioned:
    graph = build_forward(joint, [])
    signature = joint.signature
    in_graph = keep_input_mutations and any(m.written_in_graph for m in joint.mutations)
    if in_graph:
        apply_mutations_in_graph(joint, graph)
        signature = _without_written(joint)
    forward = _module(joint, graph, signature.forward_inputs, signature.forward_outputs)
    return Partitioned(
        joint=joint,
        forward=forward,
        backward=None,
        saved=(),
        signature=signature,
        mutations_in_graph=in_graph,
    )


def _without_written(joint: JointGraph) -> Signature:
    """No new values among the forward outputs but those of inputs restrided too (Note
    [Mutations kept in the graph])."""
    signature = joint.signature
    data = iter([m for m in joint.mutations if m.data])
    kept = [
        d
        for d in signature.forward_outputs
        if not (isinstance(d, MutatedInput) and next(data).written_in_graph)
    ]
    return replace(signature, forward_outputs=tuple(kept))


def _module(
    joint: JointGraph,
    graph: fx.Graph,
    inputs: Sequence[Descriptor],
    outputs: Sequence[Descriptor | None],
) -> fx.GraphModule:
    """Describe ``graph``; a module sharing the joint's constants (Note [Code on demand])."""
    describe_graph(graph, inputs, outputs)
    return lazy_module(joint.gm, graph)
