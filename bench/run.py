"""Benchmarks (a first cut; the benchmark issue extends it), each against PyTorch in the same run.

1. Capture: the first call of ``aot_module`` (trace + partition + nop compile
   + one run) for aotgrad and for PyTorch's AOTAutograd; ratio, target <= 0.5x.
2. Rematerialization: saved bytes and recompute FLOPs of aotgrad's partitioners
   and PyTorch's default / min-cut / memory-budget partitions (bench/remat.py).

    make bench
"""

from __future__ import annotations

import copy
import pathlib
import statistics
import sys
import time

import torch
from functorch.compile import aot_module as torch_aot_module

import aotgrad

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import remat

from models import GPT, MLP, DeepMLP


def first_call_seconds(make_compiled, model, args, repeats=5):
    times = []
    for _ in range(repeats):
        compiled = make_compiled(copy.deepcopy(model))
        start = time.perf_counter()
        out = compiled(*args)
        times.append(time.perf_counter() - start)
        assert out is not None
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    cases = {
        "mlp": (MLP(), (torch.randn(8, 16),)),
        "gpt2blk": (GPT(blocks=2), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))),
    }
    print(f"{'model':<10} {'aotgrad s':>10} {'pytorch s':>10} {'ratio':>7}  target")
    for name, (model, args) in cases.items():
        ours = first_call_seconds(lambda m: aotgrad.aot_module(m), model, args)
        if name == "gpt2blk":  # PyTorch's aot_module rejects tied weights: untie for the reference
            reference_model = copy.deepcopy(model)
            reference_model.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())
        else:
            reference_model = model
        theirs = first_call_seconds(
            lambda m: torch_aot_module(m, fw_compiler=aotgrad.nop), reference_model, args
        )
        print(f"{name:<10} {ours:>10.3f} {theirs:>10.3f} {ours / theirs:>6.2f}x  <= 0.50x")
    print()
    remat_table()


def remat_table():
    torch.manual_seed(0)
    models = {
        "mlp8": (DeepMLP(), (torch.randn(64, 256),)),
        "gpt4": (
            GPT(blocks=4, dim=64, heads=4, context=32, tied=False),
            (torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))),
        ),
    }
    print(f"{'model':<6} {'partition':<28} {'saved bytes':>12} {'recompute FLOPs':>16}")
    for name, (model, args) in models.items():
        for label, (saved, flops) in remat.compare(model, args).items():
            print(f"{name:<6} {label:<28} {saved:>12} {flops:>16}")


if __name__ == "__main__":
    main()
