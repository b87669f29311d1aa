"""Saved bytes and recompute FLOPs: aotgrad's partitioners against PyTorch's, in one run.

PyTorch's numbers come from its own ``aot_module`` with ``default_partition``,
``min_cut_rematerialization_partition`` and ``activation_memory_budget``;
a backward graph's saved values are its non-cotangent placeholders (unique
storages), its recomputed ops the nodes that do not depend on a cotangent.
Both sides' FLOPs use aotgrad's per-op cost table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from functorch.compile import aot_module, default_partition, min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

import aotgrad
from aotgrad.optable import flops

BUDGETS = (0.7, 0.5, 0.3)


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
    found: list[tuple[int, int]] = []

    def bw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        found.append(backward_stats(gm))
        return gm

    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_module(
            copy.deepcopy(model),
            fw_compiler=aotgrad.nop,
            bw_compiler=bw_compiler,
            partition_fn=partition,
        )
        out = compiled(*args)
        (out[0] if isinstance(out, tuple) else out).backward()
    return found[-1]


def aotgrad_stats(model: torch.nn.Module, args: tuple[Any, ...], partition: Any) -> tuple[int, int]:
    partitioned = aotgrad.trace(model, *args, partition=partition).partitioned
    return partitioned.saved_bytes, partitioned.recompute_flops


def compare(model: torch.nn.Module, args: tuple[Any, ...]) -> dict[str, tuple[int, int]]:
    """Every partitioner's (saved bytes, recompute FLOPs) on one model."""
    rows = {
        "pytorch default_partition": pytorch_stats(model, args, default_partition),
        "pytorch min_cut": pytorch_stats(model, args, min_cut_rematerialization_partition),
        "aotgrad save_all": aotgrad_stats(model, args, "save_all"),
        "aotgrad mincut": aotgrad_stats(model, args, "mincut"),
    }
    for b in BUDGETS:
        rows[f"pytorch budget {b}"] = pytorch_stats(
            model, args, min_cut_rematerialization_partition, b
        )
        rows[f"aotgrad budget {b}"] = aotgrad_stats(model, args, aotgrad.budget(b))
    return rows


def plot(points: dict[str, list[tuple[float, int, int]]], path: str) -> None:
    """Saved bytes vs recompute FLOPs per budget, one line per solver (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in points.items():
        rows = sorted(rows)
        ax.plot([r[2] for r in rows], [r[1] / 1e6 for r in rows], marker="o", label=label)
        for budget, saved, cost in rows:
            ax.annotate(f"{budget:g}", (cost, saved / 1e6), fontsize=7)
    ax.set_xlabel("recompute FLOPs")
    ax.set_ylabel("saved MB")
    ax.set_title("memory budget: saved bytes vs recompute FLOPs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
