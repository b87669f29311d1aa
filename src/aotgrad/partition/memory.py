"""Estimated peak memory of forward + backward: a liveness simulation over both graphs."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from aotgrad.partition.saved import storages


def peak_bytes(forward: fx.GraphModule, backward: fx.GraphModule | None) -> int:
    """Peak bytes of live storages running ``forward`` then ``backward`` in graph order.

    Inputs stay live throughout; the forward's outputs (user outputs and saved
    values) stay live into the backward; everything else is freed after its
    last use. Views share their base's storage and add nothing.
    """
    live: dict[Any, int] = {}
    peak = _run(forward, live, keep_outputs=True)
    if backward is not None:
        peak = max(peak, _run(backward, live, keep_outputs=False))
    return peak


def _run(gm: fx.GraphModule, live: dict[Any, int], keep_outputs: bool) -> int:
    nodes = list(gm.graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for source in node.all_input_nodes:
            last_use[source] = i
    outputs = set(gm.graph.output_node().all_input_nodes)
    peak = sum(live.values())
    for i, node in enumerate(nodes):
        for storage, size in storages(node).items():  # Note [Counting bytes]
            live.setdefault(storage, size)
        peak = max(peak, sum(live.values()))
        for source in node.all_input_nodes:
            dead = last_use.get(source) == i and source.op != "placeholder"
            if dead and not (keep_outputs and source in outputs):
                for storage in storages(source):
                    live.pop(storage, None)
    return peak
