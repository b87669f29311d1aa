"""PyTorch's AOTAutograd partitioners, measured the way aotgrad reports its own plans.

Shared by the tests and ``bench/remat.py``. A backward graph's saved values are
its non-cotangent placeholders (unique storages, inputs included, like
``Partitioned.saved_bytes``); its recomputed ops are the nodes that do not
depend on a cotangent, costed with aotgrad's per-op FLOP table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from functorch.compile import aot_module, make_boxed_func
from torch.multiprocessing.reductions import StorageWeakRef

from aotgrad.ops.table import flops


def backward_stats(gm: fx.GraphModule) -> tuple[int, int]:
    """(saved bytes over unique storages, recompute FLOPs) of a PyTorch backward graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = {n for n in placeholders if n.name.startswith("tangents")}
    storages: dict[Any, int] = {}
    for node in placeholders:
        val = node.meta.get("val")
        if node not in tangents and isinstance(val, torch.Tensor):
            storages[StorageWeakRef(val.untyped_storage())] = val.untyped_storage().nbytes()
    downstream = set(tangents)
    recompute = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
            continue
        args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
        recompute += flops(node.target, args, node.meta.get("val"))
    return sum(storages.values()), recompute


def pytorch_stats(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    partition: Callable[..., Any],
    budget: float = 1.0,
) -> tuple[int, int]:
    """(saved bytes, recompute FLOPs) of PyTorch's ``aot_module`` with ``partition`` at ``budget``."""
    found: list[tuple[int, int]] = []

    def bw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        found.append(backward_stats(gm))
        return make_boxed_func(gm)

    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_module(
            copy.deepcopy(model),
            fw_compiler=lambda gm, example_inputs: make_boxed_func(gm),
            bw_compiler=bw_compiler,
            partition_fn=partition,
        )
        out = compiled(*args)
        (out[0] if isinstance(out, tuple) else out).backward()
    return found[-1]
