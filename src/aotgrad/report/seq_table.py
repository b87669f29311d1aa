"""The sequence-number table: which forward op every node belongs to.

>>> import torch, aotgrad
>>> traced = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(3, requires_grad=True))
>>> print(traced.seq_table())
SeqNr|OrigAten|SrcFn
0|aten.sin.default|<lambda>
1|aten.sum.default|<lambda>
1|aten.expand.default|<lambda>
0|aten.cos.default|<lambda>
0|aten.mul.Tensor|<lambda>
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from aotgrad.capture import Kind, node_info
from aotgrad.capture.analyses.collectives import op_text


@dataclass(frozen=True)
class SeqRow:
    """One op of the joint graph and the forward op it belongs to."""

    seq_nr: int | None
    op: str  # "aten.mm.default"; a collective with its group (Note [Collectives])
    module: str  # "blocks.3.attn.qkv", or the traced function's name
    phase: str  # forward | backward | recompute
    kind: str  # op | accumulate | recompute
    source: str | None  # "model.py:12 in forward: y = self.fc(x)"
    node: str  # node name in the joint graph

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class SeqTable(tuple[SeqRow, ...]):
    """Rows in graph order; prints as ``SeqNr|OrigAten|SrcFn``."""

    def __str__(self) -> str:
        lines = ["SeqNr|OrigAten|SrcFn"]
        for row in self:
            seq = "" if row.seq_nr is None else str(row.seq_nr)
            module = "" if row.kind == Kind.ACCUMULATE.value else row.module
            lines.append(f"{seq}|{row.op}|{module}")
        return "\n".join(lines)


def seq_table(gm: fx.GraphModule) -> SeqTable:
    """The rows of ``gm``: every op node except tuple indexing (``getitem``)."""
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        info = node_info(node)
        rows.append(
            SeqRow(
                seq_nr=info.seq_nr,
                op=op_text(node),
                module=info.module,
                phase=info.phase.value,
                kind=info.kind.value,
                source=None if info.source is None else str(info.source),
                node=node.name,
            )
        )
    return SeqTable(rows)
