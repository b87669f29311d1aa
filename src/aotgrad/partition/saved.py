"""Saved values: what the backward receives from the forward, and why."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from aotgrad.optable import op_name


@dataclass(frozen=True)
class SavedValue:
    """One value the forward hands to the backward."""

    # Node name in the forward graph (and placeholder name in the backward graph).
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Bytes of the storage behind the value (a view reports its whole storage).
    nbytes: int
    # The op that produced it: "aten.mm.default", or "input" for a forward input.
    producer: str
    # Names of the backward nodes that read it.
    users: tuple[str, ...]
    # Why it is saved rather than recomputed.
    reason: str

    @property
    def is_input(self) -> bool:
        """Saving a forward input costs no memory: the caller holds it anyway."""
        return self.producer == "input"


def describe_saved(node: fx.Node, users: list[str], reason: str) -> SavedValue:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise AssertionError(f"expected a tensor value on saved node {node.name}, got {val!r}")
    producer = "input" if node.op == "placeholder" else op_name(node.target)
    return SavedValue(
        name=node.name,
        shape=tuple(val.shape),
        dtype=val.dtype,
        nbytes=val.untyped_storage().nbytes(),
        producer=producer,
        users=tuple(users),
        reason=reason,
    )
