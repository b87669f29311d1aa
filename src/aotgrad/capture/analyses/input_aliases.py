"""Inputs that share memory, traced as views of one synthetic base.

Note [Aliased inputs]
~~~~~~~~~~~~~~~~~~~~~
Capture wraps each input in its own functional tensor, so a mutation through
one input is invisible to another input over the same memory. That is
harmless until the function mutates one of them::

    def f(x, v):        # called as f(x, x.view(2, 2))
        v.add_(1)       # eager: x changes too
        return x * 2    # eager: uses the new x

When, after a first trace, an input that shares its storage with another
input turns out to be mutated, capture traces again with a *synthetic
base*: one graph input covering the storage up to the farthest member's end
(``x.as_strided((4,), (1,), 0)`` built from the inputs' common ``._base``),
from which every member is re-derived inside the graph::

    forward(base_of_x_v):
        x = as_strided(base_of_x_v, (4,), (1,), 0)
        v = as_strided(base_of_x_v, (2, 2), (2, 1), 0)
        add = v + 1          # functionalization writes it back into the base
        ...
    -> (mul, new value of base of x, v, ...)

The members' placeholders disappear; the base takes the first member's
place and gets one gradient, which autograd routes to the members through
the runtime's real ``as_strided`` view. Duplicates (the same tensor passed
twice) need no base: they share one functional wrapper. Two distinct inputs
that are equal views (``f(b[1:], b[1:])``) stay two views of the base: the
function may return either, and the caller tells them apart.

Inputs that share memory without a common ``._base`` need no base when
they are disjoint, and get one cut from the storage when none requires grad
(Note [Inputs sharing memory without a common base]); otherwise mutating one
of them raises ``UnsupportedMutationError``.

Only data mutations need a base: ``a.t_()`` changes no value another input
sees. When a member's metadata changes too (``a.t_(); b.add_(1)``), the
base carries the data and the member's new size and strides are read off
its view, then replayed on the caller's ``a`` (``member_mutations``)::

    epilogue:  base.copy_(new value of base)                   # b's add_, seen by a
               a.as_strided_((2, 2), (1, 4), 0)                 # a's t_()

If that member requires grad, autograd would re-derive it from the mutated
base by replaying the view ops that made it, without its ``t_()``, and the
gradient would come back transposed: capture refuses that case loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad._torch_compat import is_traceable_wrapper_subclass
from aotgrad.capture.analyses.aliasing import ViewMeta
from aotgrad.signature.storage import storage_key


@dataclass(frozen=True)
class SyntheticBase:
    """One graph input standing for several user inputs over one storage."""

    # User primal positions of the distinct tensors sharing the storage, ascending.
    members: tuple[int, ...]
    # The member whose ``._base`` (or itself, if it has none) the base is cut from.
    anchor: int
    # Elements of the storage up to the end of the farthest member: the base is
    # ``source.as_strided((numel,), (1,), 0)``. Not the whole storage, whose size is in no
    # key: a later call's storage may be shorter (or longer) around the same members.
    numel: int
    # Where each member sits in the storage.
    views: tuple[ViewMeta, ...]

    def build(self, primals: Sequence[torch.Tensor]) -> torch.Tensor:
        """The base over the callers' real storage (a view, so autograd reaches the members)."""
        anchor = primals[self.anchor]
        source = anchor._base if anchor._base is not None else anchor
        return source.as_strided((self.numel,), (1,), 0)


def overlapping_groups(primals: Sequence[torch.Tensor]) -> list[list[int]]:
    """Groups of distinct inputs over one storage (each group has two or more members)."""
    groups: dict[Any, list[int]] = {}
    seen: set[int] = set()
    for i, p in enumerate(primals):
        if id(p) in seen:
            continue
        seen.add(id(p))
        groups.setdefault(storage_key(p), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def synthetic_base(primals: Sequence[torch.Tensor], members: Sequence[int]) -> SyntheticBase | None:
    """A base for ``members`` if they share a common ``._base`` (or are it), or if none of them
    requires grad (Note [Inputs sharing memory without a common base]); else None."""
    roots = {id(primals[i]._base if primals[i]._base is not None else primals[i]) for i in members}
    if len(roots) != 1 and any(primals[i].requires_grad for i in members):
        return None
    views = tuple(ViewMeta.of(primals[i]) for i in members)
    return SyntheticBase(
        members=tuple(members),
        anchor=members[0],
        numel=max(view.extent for view in views),
        views=views,
    )


# Note [Inputs sharing memory without a common base]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inputs over one storage need not be views of one tensor: ``b.detach()[1:]``
# beside ``b[:2]``, or the inner tensors of two subclass inputs built from
# rows of one plain tensor (each subclass input is its own tensor; its inner
# tensors are what share memory)::
#
#     b1 = torch.arange(12.).view(4, 3)
#     x = TwoTensor(b1[0:2], ...); y = TwoTensor(b1[1:3], ...)
#     def f(x, y): x.mul_(2); return x * y     # eager: y's row 0 is x's row 1, doubled
#
# Two cases need no common base:
#
# - members whose elements are disjoint (``b1[0:2]`` and ``b1.detach()[2:4]``,
#   or columns ``[:, 0]`` and ``[:, 1]``) and whose layouts the function
#   leaves alone: a mutation of one is never seen by another, so they stay
#   separate graph inputs (``separate``);
# - overlapping members of which none requires grad: the synthetic base is cut
#   from any member's storage (``as_strided`` counts offsets from the
#   storage's start), and autograd need not reach any of them through it.
#
# Overlapping members without a common base of which one requires grad are
# refused: one base's gradient would be the sum of theirs over the shared
# elements, where eager gives each its own.


def separate(primals: Sequence[torch.Tensor], members: Sequence[int]) -> bool:
    """Are ``members`` (over one storage) without a common ``._base`` and disjoint (Note
    [Inputs sharing memory without a common base])? Members with a common base keep theirs
    (the case is well trodden); a member whose layout the function changes may reach the
    others afterwards (the caller checks that)."""
    roots = {id(primals[i]._base if primals[i]._base is not None else primals[i]) for i in members}
    return len(roots) > 1 and disjoint(primals, members)


def disjoint(primals: Sequence[torch.Tensor], members: Sequence[int]) -> bool:
    """Do ``members`` (over one storage) reach no storage element in common? Element by
    element; members of different dtypes are taken to overlap."""
    tensors = [primals[i] for i in members]
    if len({t.dtype for t in tensors}) != 1:
        return False
    views = [ViewMeta.of(t) for t in tensors]
    taken = torch.zeros(max(v.extent for v in views), dtype=torch.bool)
    for v in views:
        if 0 in v.size:
            continue
        where = torch.arange(taken.numel()).as_strided(v.size, v.stride, v.storage_offset)
        if taken[where].any():
            return False
        taken[where] = True
    return True


def input_sources(
    primals: Sequence[torch.Tensor], bases: Sequence[SyntheticBase]
) -> list[tuple[int, ViewMeta | None]]:
    """Per user input: the graph input it comes from, and its view of it (None: it *is* it)."""
    base_of: dict[int, tuple[int, ViewMeta]] = {}  # id(member) -> (base number, view)
    for b, base in enumerate(bases):
        for i, view in zip(base.members, base.views, strict=True):
            base_of[id(primals[i])] = (b, view)
    positions: dict[object, int] = {}  # user input k, or ("base", b) -> graph input index
    sources: list[tuple[int, ViewMeta | None]] = []
    for k, p in enumerate(primals):
        number, member_view = base_of.get(id(p), (None, None))
        key = k if number is None else ("base", number)
        sources.append((positions.setdefault(key, len(positions)), member_view))
    return sources


def graph_inputs(
    primals: Sequence[torch.Tensor], bases: Sequence[SyntheticBase]
) -> list[torch.Tensor]:
    """The forward graph's inputs: each base replaces its members, at the first one's place.

    A tensor passed twice stays two graph inputs when it belongs to no base
    (the second placeholder is unused; see ``PrimalInfo.duplicate_of``).
    """
    if not bases:
        return list(primals)
    built = [b.build(primals) for b in bases]
    member = {id(primals[i]): b for b, base in enumerate(bases) for i in base.members}
    inputs: dict[object, torch.Tensor] = {}  # user input k, or ("base", b) -> graph input
    for k, p in enumerate(primals):
        b = member.get(id(p))
        inputs.setdefault(k if b is None else ("base", b), p if b is None else built[b])
    return list(inputs.values())


def memory_sharing(primals: Sequence[Any]) -> tuple[Any, ...]:
    """Which inputs are one tensor or share a storage, and where each sharing one sits in it.

    A graph is captured for one such structure (Note [Aliased inputs]): a synthetic base
    re-derives its members from their captured places, and a tensor passed twice is read
    through its first placeholder. A ``Traced``, which does not re-trace, compares this
    for every call (Note [Inputs that share memory]).

    >>> x = torch.arange(10.0)
    >>> memory_sharing([x[0:4], x[4:8]]) == memory_sharing([x[0:4], x[2:6]])
    False
    >>> memory_sharing([x, torch.ones(2)]), memory_sharing([x, x])
    ((), (((0, 1), ((0, 0, (10,), (1,), 0), (1, 0, (10,), (1,), 0))),))
    """
    groups: dict[Any, list[tuple[Any, torch.Tensor]]] = {}
    for place, p in _plain_places(primals):
        groups.setdefault(storage_key(p), []).append((place, p))
    shared = []
    for group in groups.values():
        if len(group) < 2:
            continue
        first: dict[int, Any] = {}  # id -> the first place holding that tensor
        members = []
        for place, p in group:
            same = first.setdefault(id(p), place)
            members.append((place, same, tuple(p.shape), tuple(p.stride()), p.storage_offset()))
        shared.append((tuple(place for place, _ in group), tuple(members)))
    return tuple(shared)


def _plain_places(primals: Sequence[Any]) -> list[tuple[Any, torch.Tensor]]:
    """Each plain tensor among ``primals`` by its place: ``i``, or ``(i, k)`` for the ``k``-th
    inner tensor of a subclass (Note [Inputs sharing memory without a common base])."""
    out: list[tuple[Any, torch.Tensor]] = []
    for i, p in enumerate(primals):
        if not isinstance(p, torch.Tensor):
            continue
        if not is_traceable_wrapper_subclass(p):
            out.append((i, p))
            continue
        out += [((i, k), t) for k, (_, t) in enumerate(_plain_places(_inner_of(p)))]
    return out


def _inner_of(t: torch.Tensor) -> list[torch.Tensor]:
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [v for a in attrs if isinstance(v := getattr(t, a), torch.Tensor)]
