"""What a random op's draw depends on: the tables behind Note [Random draws as inputs].

A draw can leave the graph, as an input the host draws with torch, when its numbers depend on
nothing the graph computes. Two facts per op decide it:

- :data:`METADATA_ONLY`: the arguments whose values an op never reads, only their size,
  strides, dtype and device. ``bernoulli.p(empty_like(h), 0.9)`` draws the same mask whatever
  ``h`` holds, so the host can draw it on an empty tensor laid out like ``h``; ``bernoulli(h)``
  reads ``h`` as probabilities, and cannot.
- :data:`SPLIT_DRAWS`: ops that draw and compute at once, written as a draw that reads no value
  and the computation on it (``native_dropout``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from aotgrad.ops.rules import OpRules

__all__ = ["METADATA_ONLY", "SPLIT_DRAWS", "metadata_only"]

aten = torch.ops.aten


def _every_overload(*packets: Any) -> list[Any]:
    return [getattr(p, name) for p in packets for name in p.overloads()]


# Ops whose first argument is read for its layout alone (size, strides, dtype, device): the
# factories shaped like a tensor, and the random fills, whose draws depend on the generator and
# the layout only. Keyed by op; the value: the positions read for layout alone.
METADATA_ONLY: dict[Any, frozenset[int]] = {
    op: frozenset({0})
    for op in [
        *_every_overload(
            aten.empty_like,
            aten.zeros_like,
            aten.ones_like,
            aten.full_like,
            aten.new_empty,
            aten.new_empty_strided,
            aten.new_zeros,
            aten.new_ones,
            aten.new_full,
            aten.rand_like,
            aten.randn_like,
            aten.uniform,
            aten.normal_functional,
            aten.exponential,
            aten.cauchy,
            aten.log_normal,
            aten.geometric,
            aten.random,
        ),
        aten.bernoulli.p,  # bernoulli.default and .Tensor read self (or p) as probabilities
        # randint_like's .Tensor overloads read their ``high`` tensor; the overloads a torch
        # release has are read from it (newer ones take a generator)
        *(
            getattr(aten.randint_like, n)
            for n in aten.randint_like.overloads()
            if "Tensor" not in n
        ),
    ]
}


def metadata_only(op: object) -> frozenset[int]:
    """The positions of ``op``'s arguments whose values it never reads.

    >>> sorted(metadata_only(torch.ops.aten.bernoulli.p)), sorted(metadata_only(torch.ops.aten.bernoulli.default))
    ([0], [])
    """
    return METADATA_ONLY.get(op, frozenset())


# Note [Dropout split into its draw]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``native_dropout(x, p, True)`` returns ``(x * mask * scale, mask)``; its mask is drawn on a
# buffer laid out like ``x`` (``empty_like(x).bernoulli_(1 - p)`` on CPU, philox by position
# on CUDA), never from ``x``'s values. So it is written as the same op on an empty tensor,
# whose mask is the draw, and the product, in the graph::
#
#     out, mask = native_dropout(x, 0.1, True)
#  -> mask = native_dropout(empty_like(x), 0.1, True)[1]      # a draw: reads x's layout only
#     out = mul(mul(x, mask), 1 / 0.9)                         # eager's x.mul(mask).mul_(scale)
#
# The product is eager's to the bit: each element is ``x * 1 * scale`` or ``x * 0 * scale``.
SPLIT_DRAWS: OpRules[Callable[[fx.Node], None]] = OpRules("split draw")


@SPLIT_DRAWS.register(aten.native_dropout.default)
def _split_native_dropout(node: fx.Node) -> None:
    x, p = node.args[0], node.args[1]
    graph = node.graph
    keep = 1.0 - float(p)  # type: ignore[arg-type]
    scale = 0.0 if keep == 0 else 1.0 / keep
    with graph.inserting_before(node):
        empty = graph.call_function(aten.empty_like.default, (x,))
        empty.meta = {**node.meta, "val": node.meta["val"][0]}
        drawn = graph.call_function(aten.native_dropout.default, (empty, *node.args[1:]))
        drawn.meta = dict(node.meta)
        mask = graph.call_function(operator.getitem, (drawn, 1))
        mask.meta = {**node.meta, "val": node.meta["val"][1]}
        kept = graph.call_function(aten.mul.Tensor, (x, mask))
        kept.meta = {**node.meta, "val": node.meta["val"][0]}
        out = graph.call_function(aten.mul.Tensor, (kept, scale))
        out.meta = {**node.meta, "val": node.meta["val"][0]}
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(out if user.args[1] == 0 else mask)
            graph.erase_node(user)
    graph.erase_node(node)
