"""Benchmarks (a first cut; the benchmark issue extends it): capture time vs PyTorch.

Measures, in one run, the first call of ``aot_function`` (trace + partition
+ nop compile + one run) for aotgrad and for PyTorch's AOTAutograd on the
same models, and prints the ratio. Lower is better; the target is <= 0.5x.

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
from models import GPT, MLP


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


if __name__ == "__main__":
    main()
