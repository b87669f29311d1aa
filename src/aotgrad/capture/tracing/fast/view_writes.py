"""Writes through views in the direct trace: the bookkeeping functionalization keeps, in small.

Note [Writes through views, directly]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An in-place op on a view changes its base and every other view of that base.
A functional graph has no shared memory, so the write becomes two steps: the
view's new value (the op's functional variant), then the base's new value, the
new view *scattered* into the old base; every other view of the base then reads
from the new base, its view ops replayed on it. The direct trace keeps, per base
that was written through a view (a :class:`Storage`), the pending writes and a
generation, and, per tensor over that base (a :class:`StorageView`), the view ops
that lead to it from the base (its ``chain``) and the generation it last read::

    user code:   h = x * 2; v = h[1]; v.add_(1); return h.sin()
    recorded:    mul = mul(x, 2); select = select(mul, 0, 1)
                 add = add(select, 1)                        # v now reads add
                 select_scatter = select_scatter(mul, add, 0, 1)   # at h's next use
                 sin = sin(select_scatter)

As functionalization does, the scatter is recorded lazily, when a tensor over
the base that has not seen the write is next used (an op's argument, a forward
value, a gradient): its chain replays on the new base. A chain of several views
scatters through each: for ``h.t()[1].add_(1)`` the write replays ``t`` on the
old base, scatters into it, and inverts ``t``::

    t_1 = t(mul); select_scatter = select_scatter(t_1, add, 0, 1); t_2 = t(select_scatter)

Each view op needs its inverse (``VIEWS``: ``select`` -> ``select_scatter``,
``slice`` -> ``slice_scatter``, ``as_strided`` -> ``as_strided_scatter``,
``diagonal`` -> ``diagonal_scatter``, ``t``/``transpose``/``permute``/``view``/
``unsqueeze``/``squeeze.dim``/``alias`` -> the view that undoes it); a write
through any other view (``expand``, ``split``, ``unfold``, ``view_as_real`` ...)
stops the direct trace (Note [Choosing a tracer]), as does a replayed view
whose layout differs from the tensor the function holds. The graphs are
functionalization's, node for node, for the cases ``tests/test_direct_trace.py``
compares; where functionalization records extra views it then drops (the
backward of ``as_strided``, which writes into a view of a fresh buffer), node
names may differ while the ops kept are the same.

This is what kept timm's convnext on the full trace: ``adaptive_avg_pool2d``
restrides its result in place (``as_strided_``) on channels-last inputs, and the
backward of that, ``as_strided_backward``, copies the gradient into a view of a
zero buffer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import OpOverload

aten = torch.ops.aten


@dataclass(frozen=True)
class ViewStep:
    """One view op of a chain: ``op(previous, *args)``, then item ``index`` of a list result."""

    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    # The node that first made this view: a replay carries its provenance, as
    # functionalization's regenerated views do.
    node: fx.Node | None = field(default=None, compare=False)

    def replay(self, base: torch.Tensor) -> torch.Tensor:
        """This view of ``base`` (run under the recording mode, it is recorded)."""
        out = self.op(base, *self.args, **self.kwargs)
        return out if self.index is None else out[self.index]


@dataclass
class Storage:
    """One base written through a view: its current value and the writes not yet scattered."""

    # A tensor holding the base's current value (its node is the value's).
    base: torch.Tensor
    # id of the base tensor itself (an input's: the write mutates that input).
    root: int
    # How many tensors of the trace are over this base (views made otherwise: a stop).
    members: int
    generation: int = 0
    # (new value of a view, that view's chain), in the order they were written.
    pending: list[tuple[torch.Tensor, tuple[ViewStep, ...]]] = field(default_factory=list)


@dataclass
class StorageView:
    """A tensor over a written base: the view ops from the base to it, and what it last read."""

    storage: Storage
    chain: tuple[ViewStep, ...]
    generation: int = 0

    @property
    def stale(self) -> bool:
        return self.generation != self.storage.generation


def chain_of(node: fx.Node) -> tuple[fx.Node, tuple[ViewStep, ...]] | None:
    """The node a tensor's view ops start from, and those ops; None for a view it cannot read.

    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> v = g.call_function(aten.select.int, (g.call_function(aten.t.default, (x,)), 0, 1))
    >>> root, chain = chain_of(v)
    >>> root is x, [str(s.op) for s in chain], chain[1].args
    (True, ['aten.t.default', 'aten.select.int'], (0, 1))
    """
    steps: list[ViewStep] = []
    while node.op == "call_function":
        index: int | None = None
        if node.target is operator.getitem:  # an item of split's or unbind's list
            parent, item = node.args[0], node.args[1]
            assert isinstance(parent, fx.Node) and isinstance(item, int)
            if not _is_view(parent.target):
                break
            index, node = item, parent
        if not _is_view(node.target):
            break
        op = node.target
        assert isinstance(op, OpOverload)
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        steps.append(ViewStep(op, tuple(node.args[1:]), dict(node.kwargs), index, node))
        node = node.args[0]
    return node, tuple(reversed(steps))


def _is_view(target: object) -> bool:
    return isinstance(target, OpOverload) and target.is_view


def invertible(chain: Sequence[ViewStep]) -> str | None:
    """Why a write through ``chain`` cannot be scattered back (None: it can)."""
    for step in chain:
        rule = VIEWS.get(step.op)
        no_scatter = rule is None or rule.inverse is None or step.index is not None
        if no_scatter or (step.kwargs and step.op is not aten.slice.Tensor):
            return f"a write through a view made by {step.op} (no scatter for it)"
    return None


def scatter(base: torch.Tensor, new: torch.Tensor, chain: Sequence[ViewStep]) -> torch.Tensor:
    """``base`` with the view ``chain`` leads to replaced by ``new`` (run under the recording mode).

    The intermediate views replay on ``base``; the inverses then run from the last view back.
    """
    bases = [base]
    for step in chain[:-1]:
        bases.append(step.replay(bases[-1]))
    value = new
    for step, under in zip(reversed(chain), reversed(bases), strict=True):
        inverse = VIEWS[step.op].inverse
        assert inverse is not None  # invertible(chain) was checked
        value = inverse(under, value, step)
    return value


Inverse = Callable[[torch.Tensor, torch.Tensor, ViewStep], torch.Tensor]


@dataclass(frozen=True)
class ViewRule:
    """What the fast path knows of one view op."""

    # ``(base, new view value, step) -> new base``, the write's scatter; None: a write through
    # the view stops the direct trace.
    inverse: Inverse | None
    # The fast fake mode lays it out on the meta device (Note [Eager strides for views]).
    meta_layout: bool = True


def _permute_back(base: torch.Tensor, new: torch.Tensor, step: ViewStep) -> torch.Tensor:
    dims = [d % base.dim() for d in step.args[0]]
    return aten.permute.default(new, sorted(range(len(dims)), key=dims.__getitem__))


def _unsqueeze_back(base: torch.Tensor, new: torch.Tensor, step: ViewStep) -> torch.Tensor:
    dim = step.args[0] % max(base.dim(), 1)
    return aten.unsqueeze.default(new, dim) if base.shape[dim] == 1 else new


def _scatter(op: OpOverload) -> Inverse:
    """``op(base, new, *view args)``: ``select`` -> ``select_scatter`` ..."""
    return lambda b, n, s: op(b, n, *s.args, **s.kwargs)


# The one table of view rules.
VIEWS: dict[OpOverload, ViewRule] = {
    aten.select.int: ViewRule(_scatter(aten.select_scatter.default)),
    aten.slice.Tensor: ViewRule(_scatter(aten.slice_scatter.default)),
    aten.t.default: ViewRule(lambda b, n, s: aten.t.default(n)),
    aten.transpose.int: ViewRule(lambda b, n, s: aten.transpose.int(n, *s.args)),
    aten.permute.default: ViewRule(_permute_back),
    aten.view.default: ViewRule(lambda b, n, s: aten.view.default(n, list(b.shape))),
    aten.unsqueeze.default: ViewRule(lambda b, n, s: aten.squeeze.dim(n, *s.args)),
    aten.squeeze.dim: ViewRule(_unsqueeze_back),
    aten.expand.default: ViewRule(None),
    aten.as_strided.default: ViewRule(_scatter(aten.as_strided_scatter.default), False),
    aten.diagonal.default: ViewRule(_scatter(aten.diagonal_scatter.default), False),
    aten.alias.default: ViewRule(lambda b, n, s: aten.alias.default(n), False),
}


__all__ = [
    "VIEWS",
    "Storage",
    "StorageView",
    "ViewRule",
    "ViewStep",
    "chain_of",
    "invertible",
    "scatter",
]
