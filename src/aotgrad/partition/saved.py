"""Saved values: what the backward receives from the forward, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from aotgrad.capture import node_info
from aotgrad.capture.analyses.collectives import op_text
from aotgrad.errors import UserFrame
from aotgrad.signature.storage import storage_key, storage_nbytes


@dataclass(frozen=True)
class SavedValue:
    """One value the forward hands to the backward."""

    # Node name in the forward graph (and placeholder name in the backward graph).
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Bytes of the storage behind the value: a view reports its whole storage (Note [Counting
    # bytes]).
    nbytes: int
    # Saved values over one storage share this number; count their bytes once (unique_bytes).
    storage: int
    # The op that produced it: "aten.mm.default", or "input" for a forward input.
    producer: str
    # The producing op's forward sequence number, module path and user line.
    seq_nr: int | None
    module: str
    source: UserFrame | None
    # Names of the backward nodes that read it.
    users: tuple[str, ...]
    # Why it is saved rather than recomputed.
    reason: str

    @property
    def is_size(self) -> bool:
        """A symbolic size (dynamic shapes), passed to the backward as a Python int."""
        return self.storage < 0

    @property
    def is_input(self) -> bool:
        """A saved forward input: the caller holds it anyway."""
        return self.producer == "input"

    def to_dict(self) -> dict[str, Any]:
        return record_dict(
            self,
            dtype="size" if self.is_size else str(self.dtype).removeprefix("torch."),
            shape=[d if isinstance(d, int) else str(d) for d in self.shape],
            nbytes=self.nbytes if isinstance(self.nbytes, int) else str(self.nbytes),
        )


def record_dict(record: Any, **changed: Any) -> dict[str, Any]:
    """A record of the partition (``SavedValue``, ``RecomputedOp``, the peak model's) as plain
    data, for JSON: its fields in order, the user's line as text, records within as their
    ``to_dict()``, tuples as lists; ``changed`` replaces fields or adds new ones after them.

    >>> from aotgrad.partition.partitioned import RecomputedOp
    >>> record_dict(RecomputedOp("relu", "aten.relu.default", "fc", None, 8, "cheap"))
    {'name': 'relu', 'op': 'aten.relu.default', 'module': 'fc', 'source': None, 'flops': 8, 'reason': 'cheap'}
    """
    info = {name: _plain(value) for name, value in vars(record).items()}
    info.update(changed)
    return info


def _plain(value: Any) -> Any:
    if isinstance(value, UserFrame):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dict(vars(value))
    return value


# Note [Counting bytes]
# ~~~~~~~~~~~~~~~~~~~~~
# Every byte count aotgrad reports or budgets (``Partitioned.saved_bytes``,
# the saved-activation report, a memory budget's cap, the min-cut's edge
# weights, the peak-memory estimate) counts one way: a value costs the bytes
# of the storage behind it, and a storage counts once, however many values
# reach it. It is what stays alive for the backward: a saved view keeps its
# whole base, and a view saved next to its base adds nothing::
#
#     base = torch.empty(1000)        # a 4000-byte storage
#     x = base[:10]                   # a 40-byte view: costs 4000
#     saved: x and x.t()              # one storage: 4000 in all, not 80 (nor 8000)
#
# Counting elements instead (``numel * element_size`` per value) undercounts
# the view and counts a base and its views twice. The budget's integer program
# cannot deduplicate (its weights are per value), so it weighs each value by
# its own storage and views by nothing (Note [Budget units]); the plan it
# picks is then reported by this count.


def storages(value: fx.Node | torch.Tensor) -> dict[Any, Any]:
    """The storages behind a node's value (a tensor, or the tensors of a multi-output op), each
    with its bytes (Note [Counting bytes]); an int, or a SymInt under dynamic shapes."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else value
    tensors = val if isinstance(val, list | tuple) else [val]
    return {storage_key(t): storage_nbytes(t) for t in tensors if isinstance(t, torch.Tensor)}


def unique_bytes(values: Iterable[SavedValue | fx.Node]) -> int:
    """Bytes of the distinct storages behind ``values`` (Note [Counting bytes]).

    >>> import torch.fx as fx
    >>> g = fx.Graph()
    >>> x, t = g.placeholder("x"), g.placeholder("t")
    >>> base = torch.empty(1000)
    >>> x.meta["val"], t.meta["val"] = base[:10], base[:10].t()
    >>> unique_bytes([x]), unique_bytes([x, t])
    (4000, 4000)
    """
    sizes: dict[Any, Any] = {}
    for value in values:
        if isinstance(value, SavedValue):
            sizes.setdefault(("saved", value.storage), value.nbytes)
        else:
            for key, size in storages(value).items():
                sizes.setdefault(key, size)
    return sum(sizes.values())


def describe_saved(
    nodes: Sequence[fx.Node], users: Sequence[list[str]], reasons: Sequence[str]
) -> tuple[SavedValue, ...]:
    """One :class:`SavedValue` per saved node; views of one storage get one storage number."""
    numbers: dict[Any, int] = {}  # storage key -> storage number
    values: list[SavedValue] = []
    shape: tuple[int, ...]
    for node, readers, reason in zip(nodes, users, reasons, strict=True):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # a symbolic size the backward needs
            shape, dtype, nbytes, storage = (), torch.int64, 0, -1 - len(values)
        elif isinstance(val, torch.Tensor):
            ((key, nbytes),) = storages(val).items()
            shape, dtype = tuple(val.shape), val.dtype
            storage = numbers.setdefault(key, len(numbers))
        else:
            raise AssertionError(
                f"expected a tensor or size on saved node {node.name}, got {val!r}"
            )
        info = node_info(node)
        values.append(
            SavedValue(
                name=node.name,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                storage=storage,
                producer="input" if node.op == "placeholder" else op_text(node),
                seq_nr=info.seq_nr,
                module=info.module,
                source=info.source,
                users=tuple(readers),
                reason=reason,
            )
        )
    return tuple(values)
