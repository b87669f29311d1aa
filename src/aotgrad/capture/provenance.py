"""Per-node provenance, typed: which forward op a node belongs to, where it came from.

Every node of the joint, forward and backward graphs carries a
:class:`NodeInfo` under ``node.meta["aotgrad"]``.

Note [Sequence numbers]
~~~~~~~~~~~~~~~~~~~~~~~
Autograd numbers every node it creates from a thread-global counter. During
the trace, each forward op records the number of the last autograd node
created (ops that create none, like a buffer update under ``no_grad``,
share the previous op's number), and each backward op records the number of
the autograd node whose backward is running (set by a pre-hook on every
node, reset by a post-hook). The raw numbers depend on every autograd node
the process made before; each is replaced by its rank among the forward ops'
numbers, in order of first appearance, so they start at 0, leave no gaps and
repeat exactly across runs and processes (a backward op takes the rank of
its node's number; Note [In-place ops' numbers] in ``capture/tracing/recorder.py`` covers a
node no forward op recorded)::

    seq  op                          phase     kind
    0    aten.convolution            forward   op
    0    aten.add.Tensor             forward   op       # num_batches_tracked += 1
    1    aten._native_batch_norm...  forward   op
    ...
    1    aten.native_batch_norm_bw   backward  op       # same number: its derivative
    0    aten.convolution_backward   backward  op

Backward ops that no autograd node runs — the engine summing two gradients
of a tensor used twice — have kind ``accumulate`` and no number (they take
the module and line of the backward op they feed). Forward ops
that a checkpointed region re-runs inside the backward have kind
``recompute`` and phase ``recompute``.

Note [Module paths and source lines]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
While the user's function runs, global module forward hooks keep the path
of the ``nn.Module`` being run (``blocks.3.attn.qkv``; the function's name
outside any module). The path is the name the signature gives the module's
tensors, however the function reaches it (Note [Module paths as the signature
names them] in ``signature/closures.py``): ``net.0`` for a global ``net``,
``self.model.0`` for a trainer's bound method, ``0`` inside ``trace(net)``; a
lifted tensor's placeholder belongs to the module holding it. The tracer's dispatch mode (the direct tracer, or
functionalization in the full trace: Note [Direct tracing]) notes, for every aten
op, the innermost user frame (Note [User frames] in ``errors.py``): the user's
file, line and function. Backward ops inherit both from the forward op with their
sequence number, so a fused backward kernel points at the user's line.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch.fx as fx

from aotgrad.errors import UserFrame

META_KEY = "aotgrad"


class Phase(enum.StrEnum):
    """Where a node's value is computed."""

    FORWARD = "forward"  # computed by the forward pass
    BACKWARD = "backward"  # computed by the backward pass
    RECOMPUTE = "recompute"  # a forward value recomputed in the backward


class Kind(enum.StrEnum):
    """What a node is, beyond its phase."""

    INPUT = "input"  # a placeholder: primal or cotangent
    OP = "op"  # a forward op, or part of the derivative of one
    ACCUMULATE = "accumulate"  # sums gradients of a tensor used more than once
    RECOMPUTE = "recompute"  # a forward op re-run in the backward (checkpoint, remat)


@dataclass(frozen=True)
class NodeInfo:
    """What aotgrad knows about a node (Note [Sequence numbers], Note [Module paths and source lines])."""

    # Which pass computes the node.
    phase: Phase
    kind: Kind = Kind.OP
    # The forward op this node is, or differentiates; None for inputs and accumulations.
    seq_nr: int | None = None
    # nn.Module path as the signature names it ("blocks.3.attn.qkv", "net.0" for a global
    # net), or the traced function's name.
    module: str = ""
    # The user's line that produced the (forward) op.
    source: UserFrame | None = None
    # Which derivative the node's graph computes: 1 for a function and its gradient, 2 for
    # the differentiable backward create_graph=True captures, and so on (Note
    # [Differentiable backward] in ``runtime/higher_order.py``).
    order: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "kind": self.kind.value,
            "seq_nr": self.seq_nr,
            "module": self.module,
            "order": self.order,
            "source": None
            if self.source is None
            else {
                "file": self.source.filename,
                "line": self.source.lineno,
                "function": self.source.name,
                "code": self.source.line,
            },
        }


def node_info(node: fx.Node) -> NodeInfo:
    """The :class:`NodeInfo` of ``node``; every node aotgrad emits has one."""
    info = node.meta.get(META_KEY)
    if not isinstance(info, NodeInfo):
        raise AssertionError(f"expected node {node.name} to carry NodeInfo, got {info!r}")
    return info


def phase_of(node: fx.Node) -> Phase:
    return node_info(node).phase


def set_info(node: fx.Node, info: NodeInfo) -> None:
    node.meta[META_KEY] = info


def set_phase(node: fx.Node, phase: Phase) -> None:
    """Change a node's phase, keeping the rest of its provenance."""
    info = node.meta.get(META_KEY)
    node.meta[META_KEY] = (
        replace(info, phase=phase) if isinstance(info, NodeInfo) else NodeInfo(phase)
    )
