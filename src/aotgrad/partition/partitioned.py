"""What partitioning produced: :class:`Partitioned`, the forward and backward graphs and
everything aotgrad decided about them, and :class:`RecomputedOp`, one op the backward runs again."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch.fx as fx

from aotgrad.capture import JointGraph
from aotgrad.errors import UserFrame
from aotgrad.partition.memory import PeakEstimate, predict_peak
from aotgrad.partition.saved import SavedValue, record_dict, unique_bytes
from aotgrad.partition.sizes import example_sizes
from aotgrad.partition.workspace import op_peak
from aotgrad.signature import Signature

__all__ = ["Partitioned", "RecomputedOp"]


@dataclass(frozen=True)
class RecomputedOp:
    """A forward op the backward runs again, and why."""

    name: str  # node name in the backward graph
    op: str
    module: str
    source: UserFrame | None
    flops: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self)


@dataclass(frozen=True)
class Partitioned:
    """The forward and backward graphs, what passes between them, and the convention."""

    # What was split.
    joint: JointGraph
    # forward(*primals) -> (*outputs, *bases, *mutated, *saved)
    forward: fx.GraphModule
    # backward(*saved, *cotangents) -> grads; None when nothing needs a gradient.
    backward: fx.GraphModule | None
    # The values the forward hands to the backward, in order.
    saved: tuple[SavedValue, ...]
    # Descriptors of every placeholder and output of both graphs.
    signature: Signature
    # The forward graph copies new values into mutated inputs itself (inference only).
    mutations_in_graph: bool = False
    # Forward ops the backward runs again (checkpoint regions, free views, remat choices).
    recomputed: tuple[RecomputedOp, ...] = ()
    # Which strategy chose, and anything it wants the user to know.
    strategy: str = "save_all"
    note: str | None = None

    def __post_init__(self) -> None:
        if self.backward is None and self.saved:
            raise AssertionError(f"expected no saved values without a backward, got {self.saved}")
        if self.mutations_in_graph and self.backward is not None:
            raise AssertionError("expected mutations in the graph only without a backward")

    @property
    def saved_bytes(self) -> int:
        """Bytes of the storages the backward receives, each counted once (inputs included)."""
        return unique_bytes(self.saved)

    @property
    def saved_bytes_beyond_inputs(self) -> int:
        """Bytes the saved values keep alive that the caller does not hold anyway."""
        return unique_bytes([s for s in self.saved if not s.is_input])

    @property
    def recompute_flops(self) -> int:
        """Estimated FLOPs the backward spends re-running forward ops."""
        return sum(r.flops for r in self.recomputed)

    @cached_property
    def peak(self) -> PeakEstimate:
        """The predicted peak of a step ``f(*inputs).backward()``: how many bytes, where, and
        what is live then (Note [What a step holds] in ``partition/memory.py``)."""
        sizes = example_sizes(self.joint)  # Note [Weights at the example sizes]
        return predict_peak(self.forward, self.backward, self.signature, op_peak, sizes)

    @property
    def peak_bytes(self) -> int:
        """Predicted peak bytes of a step, inputs included (``peak.nbytes``)."""
        return self.peak.nbytes
