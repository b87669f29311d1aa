"""Per-node provenance, typed: which part of the computation a graph node belongs to.

Every ``call_function`` and ``placeholder`` node of the joint, forward and
backward graphs carries a :class:`NodeInfo` under ``node.meta["aotgrad"]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.fx as fx

META_KEY = "aotgrad"


class Phase(enum.StrEnum):
    """Where a node's value is computed."""

    FORWARD = "forward"  # computed by the forward pass
    BACKWARD = "backward"  # computed by the backward pass
    RECOMPUTE = "recompute"  # a forward value recomputed in the backward


@dataclass(frozen=True)
class NodeInfo:
    """What aotgrad knows about a node."""

    # Which pass computes the node.
    phase: Phase


def node_info(node: fx.Node) -> NodeInfo:
    """The :class:`NodeInfo` of ``node``; every node aotgrad emits has one."""
    info = node.meta.get(META_KEY)
    if not isinstance(info, NodeInfo):
        raise AssertionError(f"expected node {node.name} to carry NodeInfo, got {info!r}")
    return info


def phase_of(node: fx.Node) -> Phase:
    return node_info(node).phase


def set_phase(node: fx.Node, phase: Phase) -> None:
    node.meta[META_KEY] = NodeInfo(phase=phase)
