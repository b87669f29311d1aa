"""Per-op knowledge, keyed by ``OpOverload``, read from the op's schema.

Passes ask these functions instead of branching on op names in their loops.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def is_free_view(op: object) -> bool:
    """A view op with one tensor result: recomputing it costs nothing and allocates nothing.

    >>> is_free_view(torch.ops.aten.t.default), is_free_view(torch.ops.aten.mm.default)
    (True, False)
    """
    if not isinstance(op, torch._ops.OpOverload):
        return False
    returns = op._schema.returns
    return bool(op.is_view) and len(returns) == 1 and str(returns[0].type) == "Tensor"


def op_name(target: object) -> str:
    """``aten.mm.default`` for an OpOverload; the plain name for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


@functools.cache
def is_random(op: object) -> bool:
    """Draws from the RNG: never recomputed, or the backward would see other numbers.

    >>> is_random(torch.ops.aten.bernoulli.p), is_random(torch.ops.aten.sin.default)
    (True, False)
    """
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
