"""Saved values: what the backward receives from the forward, and why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from aotgrad.capture import node_info
from aotgrad.errors import UserFrame
from aotgrad.optable import op_name
from aotgrad.signature.storage import storage_key, storage_nbytes


@dataclass(frozen=True)
class SavedValue:
    """One value the forward hands to the backward."""

    # Node name in the forward graph (and placeholder name in the backward graph).
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Bytes of the storage behind the value (a view reports its whole storage).
    nbytes: int
    # Saved values over one storage share this number; count their bytes once.
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
        info = {k: v for k, v in vars(self).items() if k not in ("dtype", "source")}
        info["dtype"] = "size" if self.is_size else str(self.dtype).removeprefix("torch.")
        info["source"] = None if self.source is None else str(self.source)
        info["users"] = list(self.users)
        info["shape"] = [d if isinstance(d, int) else str(d) for d in self.shape]
        info["nbytes"] = self.nbytes if isinstance(self.nbytes, int) else str(self.nbytes)
        return info


def describe_saved(
    nodes: Sequence[fx.Node], users: Sequence[list[str]], reasons: Sequence[str]
) -> tuple[SavedValue, ...]:
    """One :class:`SavedValue` per saved node; views of one storage get one storage number."""
    storages: dict[Any, int] = {}
    values: list[SavedValue] = []
    shape: tuple[int, ...]
    for node, readers, reason in zip(nodes, users, reasons, strict=True):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # a symbolic size the backward needs
            shape, dtype, nbytes, storage = (), torch.int64, 0, -1 - len(values)
        elif isinstance(val, torch.Tensor):
            shape, dtype, nbytes = tuple(val.shape), val.dtype, storage_nbytes(val)
            storage = storages.setdefault(storage_key(val), len(storages))
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
                producer="input" if node.op == "placeholder" else op_name(node.target),
                seq_nr=info.seq_nr,
                module=info.module,
                source=info.source,
                users=tuple(readers),
                reason=reason,
            )
        )
    return tuple(values)


def unique_bytes(saved: Sequence[SavedValue]) -> int:
    """Bytes of the distinct storages behind ``saved``."""
    return sum({s.storage: s.nbytes for s in saved}.values())
