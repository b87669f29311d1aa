"""The ``save_all`` partition: the backward gets every forward value it reads.

Note [Free views are recomputed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A view costs no memory of its own, so saving ``t = aten.t(w)`` or ``w``
holds the same bytes. ``save_all`` saves the view's source instead and
replays the view in the backward::

    joint:     t = aten.t(w);  mm = aten.mm(x, t)  ...  mm_1 = aten.mm(cot, t)
    forward:   t = aten.t(w);  mm = aten.mm(x, t)        saves w
    backward:  t = aten.t(w)   # recompute (free view)
               mm_1 = aten.mm(cot, t)

This keeps the saved list to values that own storage, which is what a
memory report should count, and leaves nothing else recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from aotgrad.capture import JointGraph, Phase, phase_of
from aotgrad.optable import is_free_view


def choose_saved(joint: JointGraph) -> tuple[list[fx.Node], set[fx.Node], dict[fx.Node, str]]:
    """Which forward nodes the backward receives, which it recomputes, and why each is saved."""
    grads = joint.grad_results()
    wanted: dict[fx.Node, str] = {}
    for node in joint.backward_nodes():
        for source in node.all_input_nodes:
            if phase_of(source) is Phase.FORWARD:
                wanted.setdefault(source, f"read by backward op {node.name}")
    for grad in grads:
        if grad is not None and phase_of(grad) is Phase.FORWARD:
            wanted.setdefault(grad, "is a gradient")
    recompute: set[fx.Node] = set()
    saved: dict[fx.Node, str] = {}
    for node, reason in wanted.items():
        _save_or_replay(node, reason, saved, recompute)
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    return sorted(saved, key=order.__getitem__), recompute, saved


def _save_or_replay(
    node: fx.Node, reason: str, saved: dict[fx.Node, str], recompute: set[fx.Node]
) -> None:
    """Save ``node``, or, if it is a free view or a constant, recompute it in the backward."""
    if node.op == "get_attr":  # a constant the graph holds: the backward reads it directly
        recompute.add(node)
    elif node.op == "call_function" and is_free_view(node.target):
        recompute.add(node)
        for source in node.all_input_nodes:
            _save_or_replay(source, f"source of view {node.name}, {reason}", saved, recompute)
    else:
        saved.setdefault(node, reason)


def users_in(node: fx.Node, nodes: Iterable[fx.Node]) -> list[str]:
    members = set(nodes)
    return [u.name for u in node.users if u in members]
