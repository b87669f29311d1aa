"""Tie each op a checkpoint re-runs in the backward to the forward op it repeats.

Note [Recomputed random ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.utils.checkpoint`` re-runs its region in the backward, restoring the
RNG state first so that dropout draws the same mask. That restore is a
Python side effect; a graph cannot replay it. So after the trace, each
recomputed node is matched with the forward node that computes the same op
on the same (matched) inputs::

    forward:    e = empty_like(x); b = bernoulli(e, 0.5); d = div(b, 0.5); y = mul(x, d)
    recompute:  e' = empty_like(x); b' = bernoulli(e', 0.5); d' = div(b', 0.5); ...
    matched:    e' ~ e, b' ~ b, d' ~ d

A matched random node is replaced by its forward twin, so the backward reads
the forward's mask (saved) instead of drawing a new one; the deterministic
ones stay recomputed. Every matched node takes its twin's ``seq_nr``.

Random nodes are matched by where they draw in the generator's stream, not by
their arguments: ``bernoulli(empty([2, 8, 16]), 0.9)`` reads the same in every
layer of a transformer, and the recompute of layer 1 must take layer 1's
mask. During the trace each random op is stamped with the generator's state
and steps it (``Recorder.note_random``); the checkpoint saves and restores
that state around the recompute, as in eager, so a recomputed draw carries the
position of the forward draw it repeats::

    forward:    layer 0 bernoulli @ p0, layer 1 bernoulli @ p1
    recompute:  layer 1 bernoulli @ p1 (state restored to p1)  ->  twin: layer 1's
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from aotgrad.capture.provenance import Phase, node_info, set_info
from aotgrad.capture.tracing.recorder import RNG_POSITION_KEY
from aotgrad.errors import UnsupportedOpError, format_error
from aotgrad.ops.table import draws_random, is_collective, remove_dead_code


def link_recompute(gm: fx.GraphModule) -> None:
    """Match recomputed nodes with forward twins; random ones and collectives reuse the twin's
    value."""
    if not any(_may_repeat(n) for n in gm.graph.nodes):
        return  # no checkpointed region: nothing to match (and no pass over the graph)
    forward: dict[Any, fx.Node] = {}
    drawn: dict[int, fx.Node] = {}  # forward random nodes by position in the stream
    twins: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        phase = node_info(node).phase
        position = node.meta.pop(RNG_POSITION_KEY, None)
        if phase is Phase.FORWARD:
            forward.setdefault(_key(node, lambda n: n), node)
            if position is not None:
                drawn.setdefault(position, node)
        elif _may_repeat(node):
            if position is not None:
                twin = _same_draw(node, drawn.get(position))
            else:
                twin = forward.get(_key(node, lambda n: twins.get(n, n)))
            if twin is not None:
                twins[node] = twin
    for node, twin in twins.items():
        set_info(node, replace(node_info(node), seq_nr=node_info(twin).seq_nr))
        if draws_random(node.target, node.args, node.kwargs) or is_collective(node.target):
            node.replace_all_uses_with(twin)  # Note [Collectives], rule 1
            gm.graph.erase_node(node)  # DCE keeps random ops: they look side-effecting
    remove_dead_code(gm.graph)
    _no_collective_rerun(gm)


def _may_repeat(node: fx.Node) -> bool:
    """A node that may repeat a forward op: a recomputed one, or a collective in the backward.

    A checkpoint re-runs a collective inside torch's autograd kernel of the op,
    where grad mode is off, so the recorder sees a backward op, not a
    recomputed one; it repeats a forward collective when its inputs are that
    collective's (through their own twins). A gradient's collective reads a
    cotangent and has no twin. (Note [Collectives], rule 1.)
    """
    if node.op != "call_function":
        return False
    phase = node_info(node).phase
    return phase is Phase.RECOMPUTE or (phase is Phase.BACKWARD and is_collective(node.target))


def _no_collective_rerun(gm: fx.GraphModule) -> None:
    """A collective a checkpoint re-runs must have been linked to its forward twin (rule 1 of
    Note [Collectives]): aotgrad never runs a collective again in the backward."""
    for node in gm.graph.nodes:
        info = node_info(node) if node.op == "call_function" else None
        if info is not None and info.phase is Phase.RECOMPUTE and is_collective(node.target):
            raise UnsupportedOpError(
                format_error(
                    f"a checkpointed region re-runs the collective {node.target} in the backward"
                    " on other inputs than the forward's call, and aotgrad never re-runs a"
                    " collective (Note [Collectives])",
                    info.source,
                    "Move the collective out of the checkpointed region, or make the region"
                    " compute the same inputs when it is re-run.",
                )
            )


def _same_draw(node: fx.Node, twin: fx.Node | None) -> fx.Node | None:
    """``twin`` if it draws what ``node`` draws: same op, same result shape and dtype."""
    if twin is None or twin.target is not node.target:
        return None
    mine, theirs = node.meta.get("val"), twin.meta.get("val")
    if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)):
        return None
    return twin if (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype) else None


def _key(node: fx.Node, resolve: Callable[[fx.Node], fx.Node]) -> Any:
    args = fx.node.map_arg(node.args, resolve)
    kwargs = fx.node.map_arg(node.kwargs, resolve)
    return (node.target, _hashable(args), _hashable(kwargs))


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
