"""Saved bytes and recompute FLOPs: aotgrad's partitioners against PyTorch's, in one run.

PyTorch's numbers come from its own ``aot_module`` with ``default_partition``,
``min_cut_rematerialization_partition`` and ``activation_memory_budget``;
a backward graph's saved values are its non-cotangent placeholders (unique
storages), its recomputed ops the nodes that do not depend on a cotangent.
Both sides' FLOPs use aotgrad's per-op cost table.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from functorch.compile import default_partition, min_cut_rematerialization_partition

import aotgrad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import pytorch_stats

BUDGETS = (0.7, 0.5, 0.3)


def aotgrad_stats(model: torch.nn.Module, args: tuple[Any, ...], partition: Any) -> tuple[int, int]:
    partitioned = aotgrad.trace(model, *args, partition=partition).partitioned
    return partitioned.saved_bytes, partitioned.recompute_flops


def compare(model: torch.nn.Module, args: tuple[Any, ...]) -> dict[str, tuple[int, int]]:
    """Every partitioner's (saved bytes, recompute FLOPs) on one model.

    Budgets are compared twice. At the same nominal fraction the two sides
    mean different caps (Note [Budget units] vs PyTorch's fraction of its own
    min-cut's bytes, which its knapsack may under- or over-fill); at the same
    bytes -- aotgrad given, as a byte count, what PyTorch's plan saved -- the
    two solve the same problem and can be compared point by point.
    """
    rows = {
        "pytorch default_partition": pytorch_stats(model, args, default_partition),
        "pytorch min_cut": pytorch_stats(model, args, min_cut_rematerialization_partition),
        "aotgrad save_all": aotgrad_stats(model, args, "save_all"),
        "aotgrad mincut": aotgrad_stats(model, args, "mincut"),
    }
    for b in BUDGETS:
        theirs = pytorch_stats(model, args, min_cut_rematerialization_partition, b)
        rows[f"pytorch budget {b}"] = theirs
        rows[f"aotgrad budget {b}"] = aotgrad_stats(model, args, aotgrad.budget(b))
        rows[f"aotgrad budget at pytorch {b}'s bytes"] = aotgrad_stats(
            model, args, aotgrad.budget(theirs[0])
        )
    return rows


def frontier(
    model: torch.nn.Module, args: tuple[Any, ...], points: int = 12
) -> list[tuple[int, int]]:
    """aotgrad's budget solver at evenly spaced fractions: its saved-bytes / FLOPs frontier."""
    return [aotgrad_stats(model, args, aotgrad.budget(i / points)) for i in range(1, points + 1)]


def plot(
    frontier: list[tuple[int, int]],
    budgets: dict[str, list[tuple[float, int, int]]],
    path: str,
) -> None:
    """Saved MB against recompute FLOPs: aotgrad's frontier and each solver's budget points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    line = sorted(frontier, key=lambda p: p[1])
    ax.plot([p[1] for p in line], [p[0] / 1e6 for p in line], color="0.7", label="aotgrad frontier")
    for (label, rows), marker in zip(budgets.items(), "osx", strict=False):
        ax.scatter([r[2] for r in rows], [r[1] / 1e6 for r in rows], marker=marker, label=label)
        for budget, saved, cost in rows:
            ax.annotate(f"{budget:g}", (cost, saved / 1e6), fontsize=7)
    ax.set_xlabel("recompute FLOPs")
    ax.set_ylabel("saved MB")
    ax.set_title("gpt4: saved bytes vs recompute FLOPs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
