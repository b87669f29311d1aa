"""Cotangents that appear mid-trace, lifted to graph inputs afterwards.

Note [Cotangents discovered during the trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which outputs need a cotangent is known only after the function has run:
it depends on what the function returns, which of those require grad, and
which alias each other. Rather than run the function twice (once to learn
the outputs, once to trace), capture runs it once and creates each
cotangent on the spot with the marker op ``aotgrad::mark_cotangent(like, index)``,
which the tracer records like any other op::

    sin = aten.sin(x)
    mark = aotgrad.mark_cotangent(sin, 0)      # recorded mid-trace
    mul = aten.mul(mark, aten.cos(x))          # the backward

:func:`split_at_cotangents` then turns each marker into a placeholder
``cotangent_<i>`` after the primals. The first marker is also the boundary
between the forward and the backward: every node recorded before it is
forward, every node after it is backward (capture syncs all forward values
before it creates cotangents, so no forward op is recorded late).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from aotgrad.capture.provenance import Phase, set_phase

_LIB = torch.library.Library("aotgrad", "FRAGMENT")
_LIB.define("mark_cotangent(Tensor like, int index) -> Tensor")


def _cotangent(like: torch.Tensor, index: int) -> torch.Tensor:
    return torch.empty_like(like, memory_format=torch.contiguous_format)


_LIB.impl("mark_cotangent", _cotangent, "CompositeExplicitAutograd")
torch.library.register_fake("aotgrad::mark_cotangent", _cotangent, lib=_LIB)

COTANGENT_OP = torch.ops.aotgrad.mark_cotangent.default


def make_cotangent(output: torch.Tensor, index: int) -> torch.Tensor:
    """A fresh cotangent shaped like ``output`` (contiguous), recorded as a marker node."""
    with torch.no_grad():
        return COTANGENT_OP(output, index)


def split_at_cotangents(gm: fx.GraphModule) -> None:
    """Mark every node forward or backward, then turn markers into cotangent placeholders."""
    graph = gm.graph
    phase = Phase.FORWARD
    markers = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is COTANGENT_OP:
            phase = Phase.BACKWARD
            markers.append(node)
        if node.op != "output":
            set_phase(node, phase)
    if not markers:
        return
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]  # markers imply primals
    for marker in sorted(markers, key=lambda n: n.args[1]):
        with graph.inserting_after(last):
            last = graph.placeholder(f"cotangent_{marker.args[1]}")
        last.meta.update(marker.meta)
        marker.replace_all_uses_with(last)
        graph.erase_node(marker)
