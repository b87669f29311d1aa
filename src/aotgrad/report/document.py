"""``aotgrad show --json``: the signature, every node with its provenance, the saved report and
the predicted peak.

The document's layout is versioned by ``schema`` (``docs/provenance.md`` describes it)::

    {"schema": "aotgrad.show/3",
     "signature": {...Signature.to_dict()...},
     "graphs": {"joint": [node...], "forward": [node...], "backward": [node...] | null},
     "saved": [{"name", "shape", "dtype", "nbytes", "storage", "producer", "seq_nr",
                "module", "source", "users", "reason"}...],
     "saved_bytes": int | str,                          # str: a symbolic expression
     "peak": {...PeakEstimate.to_dict()...},   # "sizes": [] or the example sizes
     "tracer": {"name": "direct" | "full", "fallback_reason": str | null}}

    node = {"name", "op", "target", "args", "desc", "phase", "kind", "seq_nr", "module", "source"}
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from aotgrad.capture import NodeInfo
from aotgrad.capture.provenance import META_KEY
from aotgrad.ops.table import op_name
from aotgrad.partition import Partitioned
from aotgrad.report.peak_report import peak_document
from aotgrad.signature.printing import DESC_KEY

SCHEMA = "aotgrad.show/3"  # /3: "peak"


def show_document(partitioned: Partitioned) -> dict[str, Any]:
    backward = partitioned.backward
    return {
        "schema": SCHEMA,
        "signature": partitioned.signature.to_dict(),
        "graphs": {
            "joint": graph_nodes(partitioned.joint.gm),
            "forward": graph_nodes(partitioned.forward),
            "backward": None if backward is None else graph_nodes(backward),
        },
        "saved": [s.to_dict() for s in partitioned.saved],
        "saved_bytes": _plain(partitioned.saved_bytes),  # text where symbolic, as in "saved"
        "peak": peak_document(partitioned),  # Note [A peak of symbolic sizes]
        "tracer": {  # Note [Choosing a tracer]
            "name": partitioned.joint.tracer.name,
            "fallback_reason": partitioned.joint.tracer.fallback_reason,
        },
    }


def _plain(n: Any) -> int | str:
    """An int as is, a SymInt (dynamic shapes) as its expression: JSON has no SymInt."""
    return n if isinstance(n, int) else str(n)


def graph_nodes(gm: fx.GraphModule) -> list[dict[str, Any]]:
    return [_node(n) for n in gm.graph.nodes]


def _node(node: fx.Node) -> dict[str, Any]:
    desc = node.meta.get(DESC_KEY)  # printed: a string, a list of them on the output, or None
    if desc is not None:
        desc = [str(d) for d in desc] if isinstance(desc, list) else str(desc)
    entry: dict[str, Any] = {
        "name": node.name,
        "op": node.op,
        "target": op_name(node.target) if node.op == "call_function" else str(node.target),
        "args": [str(a) for a in node.args] if node.op != "output" else None,
        "desc": desc,
    }
    info = node.meta.get(META_KEY)
    if isinstance(info, NodeInfo):
        entry.update(info.to_dict())
    return entry
