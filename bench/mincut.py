"""Issue 42: the bytes ``partition="mincut"`` saves against PyTorch's min-cut partitioner.

Per model: aotgrad's ``Partitioned.saved_bytes`` and the bytes PyTorch's
``min_cut_rematerialization_partition`` hands its backward (``aot_function`` over
``functional_call``: unique storages of the backward's non-cotangent inputs, parameters and
inputs included on both sides, ``tests/reference.py``), on ``loss(model(*inputs))``. The
bytes are counts, not timings: one run of each is exact.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import library_models  # before anything imports torchvision: its shim
from models import partition_suite
from reference import WithLoss, mincut_saved_bytes

LIBRARY = ("gpt2", "bert", "t5", "llama", "vit", "convnext", "resnet18", "mobilenet_v3")


def _suite_loss(name: str) -> Any:
    return (lambda out: out[0]) if name == "seednet" else (lambda out: out.sum())


def measure() -> dict[str, tuple[int, int]]:
    """``{model: (aotgrad mincut saved bytes, PyTorch min-cut saved bytes)}``: the test suite's
    models, then small library models (``tests/library_models.py``)."""
    found = {}
    for name, (model, args) in partition_suite().items():
        found[name] = mincut_saved_bytes(WithLoss(model, _suite_loss(name)), args)
    for name in LIBRARY:
        case = library_models.build(name)
        model = WithLoss(case.model, case.loss)
        found[name] = mincut_saved_bytes(model, case.args, case.kwargs)
    return found


if __name__ == "__main__":
    torch.set_num_threads(1)
    results = measure()
    for name, (ours, theirs) in results.items():
        print(f"{name:14s} aotgrad {ours:10d} B  pytorch {theirs:10d} B  ratio {ours / theirs:.3f}")
    worst = max(results, key=lambda n: results[n][0] / results[n][1])
    print(f"worst: {worst} {results[worst][0] / results[worst][1]:.3f}")
