"""Descriptors in the printed graph: each placeholder and output carries a comment.

>>> import torch.fx as fx
>>> g = fx.Graph(); x = g.placeholder("x"); _ = g.output((x,))
>>> describe_graph(g, ["carry['a']"], ["output[0]"])
>>> print(fx.GraphModule({}, g).code.strip())  # doctest: +NORMALIZE_WHITESPACE
def forward(
    self,
    x,  # carry['a']
):
    return (
        x,  # output[0]
    )
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from aotgrad._torch_compat import ExpandedCodeGen

DESC_KEY = "desc"  # torch.fx prints node.meta["desc"] as a comment when expanding defs


def describe_graph(graph: fx.Graph, inputs: Sequence[object], outputs: Sequence[object]) -> None:
    """Attach descriptors to ``graph``'s placeholders and outputs, in place.

    A ``GraphModule`` built on (or recompiled after) this prints them.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, desc in zip(placeholders, inputs, strict=True):
        node.meta[DESC_KEY] = str(desc)
        node.meta["aotgrad_desc"] = desc
    output = graph.output_node()
    if len(output.args[0]) != len(outputs):  # type: ignore[arg-type]
        raise AssertionError(f"expected {len(outputs)} outputs, got {len(output.args[0])}")  # type: ignore[arg-type]
    output.meta[DESC_KEY] = [str(d) for d in outputs]
    output.meta["aotgrad_desc"] = list(outputs)
    graph.set_codegen(ExpandedCodeGen())
