"""Which user outputs alias inputs or each other, decided on the traced outputs.

Note [Aliased outputs]
~~~~~~~~~~~~~~~~~~~~~~
An ``autograd.Function`` cannot return one tensor twice, nor two views of one
storage, and keep eager semantics: the second output steals the first's
``grad_fn`` and gradients through the first are lost (the seed notebook's
``fn_4`` had to clone outputs to get them back). So the runtime returns from
its ``autograd.Function`` only *fresh* outputs (each owning its storage), and
rebuilds every alias outside it, with ordinary autograd ops, from the tensor
it aliases. Worked example::

    def f(x, w):
        a = x @ w
        return a, a, a.t(), x.view(-1), a.view(-1)[:2]

    output[0] a               fresh: returned by the Function
    output[1] a               Alias(source=OUTPUT, index=0, view=None): the same object
    output[2] a.t()           Alias(OUTPUT, 0, view=size/stride/offset of a.t())
    output[3] x.view(-1)      Alias(GRAPH_INPUT, 0, view=...): a real view of the user's x
    output[4] a.view(-1)[:2]  Alias(OUTPUT, 0, view=...)

When every output of a storage is a view (``return a.t(), a.view(-1)`` with
``a`` not returned, or a lone ``return a.view(-1)``), the storage's base
``a`` becomes an extra forward output (an ``OutputBase``) and the views are
rebuilt from it, so that their ``._base`` is an intermediate as in eager. Gradients flow from each
rebuilt view into its source through autograd, so cotangents are needed only
for the Function's own outputs. Views that change dtype or the lazy
conjugate/negative bit (``view(dtype)``, ``conj()``) cannot be rebuilt with
``as_strided`` and are returned fresh (a copy): see
``docs/known-limitations.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad.errors import UnsupportedOutputError, format_error
from aotgrad.signature.storage import storage_key


class AliasSource(enum.Enum):
    INPUT = "input"  # index is a user input position (the output *is* that tensor)
    GRAPH_INPUT = "graph input"  # index is a forward-graph input position
    OUTPUT = "output"  # index is the position of an earlier tensor output
    BASE = "base"  # index is a position among the OutputBase values


@dataclass(frozen=True)
class ViewMeta:
    """Where a view sits in its storage: rebuilt with ``base.as_strided(size, stride, offset)``."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def extent(self) -> int:
        """Elements of storage the view reaches: offset + 1 + the farthest stride step."""
        if 0 in self.size:
            return self.storage_offset
        return (
            self.storage_offset
            + 1
            + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        )

    @staticmethod
    def of(t: torch.Tensor) -> ViewMeta:
        values = (*t.shape, *t.stride(), t.storage_offset())
        if any(isinstance(v, torch.SymInt) for v in values):
            raise UnsupportedOutputError(
                format_error(
                    "with dynamic shapes, an output that is a view of an input or of another"
                    " output, or a metadata mutation of an input, has a symbolic layout;"
                    " aotgrad cannot replay it yet",
                    None,
                    "Return a copy (y.clone()) or trace without dynamic=True.",
                )
            )
        return ViewMeta(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


@dataclass(frozen=True)
class Alias:
    """How the runtime rebuilds an output from the tensor it aliases."""

    source: AliasSource
    index: int
    # None: the output *is* that tensor (same Python object); else a view of it.
    view: ViewMeta | None
    # Whether the rebuilt output requires grad (a detached alias does not).
    requires_grad: bool


@dataclass(frozen=True)
class TensorOutput:
    """A tensor leaf of the user's result."""

    # Position among the tensor outputs of the forward graph.
    index: int
    # None when the output is fresh: produced by the forward graph and returned as is.
    alias: Alias | None
    requires_grad: bool


@dataclass(frozen=True)
class ConstantOutput:
    """A non-tensor leaf (None, a number, ...) or a tensor the function did not compute."""

    value: Any


OutputLeaf = TensorOutput | ConstantOutput


def storage_of(t: torch.Tensor) -> Any:
    return storage_key(t)


@dataclass(frozen=True)
class OutputAliasing:
    """The result of :func:`analyze_aliasing`: how to produce every tensor output."""

    # Per tensor output, in order.
    outputs: tuple[TensorOutput, ...]
    # For each OutputBase: the tensor outputs rebuilt from it.
    base_members: tuple[tuple[int, ...], ...]


def analyze_aliasing(
    tensors: Sequence[torch.Tensor],
    primals: Sequence[torch.Tensor],
    graph_primals: Sequence[torch.Tensor],
) -> tuple[OutputAliasing, list[torch.Tensor]]:
    """Classify traced tensor outputs; return the analysis and the base tensors to output.

    ``primals`` are the user's inputs, ``graph_primals`` the graph's (they
    differ when inputs share memory, Note [Aliased inputs]).
    """
    input_ids: dict[int, int] = {}
    for i, p in enumerate(primals):
        input_ids.setdefault(id(p), i)
    input_storages: dict[Any, int] = {}
    for i, p in enumerate(graph_primals):
        input_storages.setdefault(storage_of(p), i)
    aliases: list[Alias | None] = [None] * len(tensors)
    first_index: dict[int, int] = {}
    groups: dict[Any, list[int]] = {}
    for k, t in enumerate(tensors):
        storage = storage_of(t)
        if id(t) in input_ids:
            aliases[k] = Alias(AliasSource.INPUT, input_ids[id(t)], None, t.requires_grad)
        elif storage in input_storages and _rebuildable(t, graph_primals[input_storages[storage]]):
            source = input_storages[storage]
            aliases[k] = Alias(AliasSource.GRAPH_INPUT, source, ViewMeta.of(t), t.requires_grad)
        elif id(t) in first_index:
            aliases[k] = Alias(AliasSource.OUTPUT, first_index[id(t)], None, t.requires_grad)
        else:
            first_index[id(t)] = k
            groups.setdefault(storage, []).append(k)
    bases: list[torch.Tensor] = []
    members: list[tuple[int, ...]] = []
    for group in groups.values():
        if len(group) > 1 or tensors[group[0]]._base is not None:
            _alias_group(group, tensors, aliases, bases, members)
    outputs = tuple(
        TensorOutput(k, alias, t.requires_grad)
        for k, (t, alias) in enumerate(zip(tensors, aliases, strict=True))
    )
    return OutputAliasing(outputs, tuple(members)), bases


def _alias_group(
    group: list[int],
    tensors: Sequence[torch.Tensor],
    aliases: list[Alias | None],
    bases: list[torch.Tensor],
    members: list[tuple[int, ...]],
) -> None:
    """Rebuild every output of one storage from one fresh tensor (Note [Aliased outputs])."""
    owners = [k for k in group if tensors[k]._base is None]
    base: torch.Tensor | None
    if owners:
        source, base, index = AliasSource.OUTPUT, tensors[owners[0]], owners[0]
    else:
        source, base, index = AliasSource.BASE, tensors[group[0]]._base, len(bases)
    rebuilt = []
    for k in group:
        t = tensors[k]
        if k == index and source is AliasSource.OUTPUT:
            continue
        if not _rebuildable(t, base):
            continue
        aliases[k] = Alias(source, index, ViewMeta.of(t), t.requires_grad)
        rebuilt.append(k)
    if source is AliasSource.BASE and rebuilt:
        assert base is not None
        bases.append(base)
        members.append(tuple(rebuilt))


def _rebuildable(view: torch.Tensor, base: torch.Tensor | None) -> bool:
    """``as_strided`` keeps dtype and the lazy conj/neg bits: it rebuilds only views that do too."""
    return (
        base is not None
        and view.dtype == base.dtype
        and view.is_conj() == base.is_conj()
        and view.is_neg() == base.is_neg()
    )
