"""The benchmark models (issue: benchmarks), shared by every benchmark.

The GPT and the seed's conv net are the test suite's (``tests/models.py``), at benchmark sizes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import GPT, SeedNet


class MLP8(nn.Module):
    """8 × (Linear 512 + GELU), mean-square loss."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x.pow(2).mean()


def make(name: str, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """A benchmark model and its example inputs, by name: conv, mlp8, gpt4, gpt12.

    GPTs are pre-LN, d_model 256, 4 heads, sequence 128, batch 4, vocab 1000, tied
    embedding and head, cross-entropy.
    """
    torch.manual_seed(seed)
    if name == "conv":
        return SeedNet(channels=16, size=32), (torch.randn(1, 16, 32, 32), torch.randn(1))
    if name == "mlp8":
        return MLP8(), (torch.randn(64, 512),)
    if name.startswith("gpt"):
        model = GPT(vocab=1000, dim=256, heads=4, blocks=int(name[3:]), context=128)
        idx = torch.randint(0, 1000, (4, 128))
        return model, (idx, torch.randint(0, 1000, (4, 128)))
    raise ValueError(f"unknown benchmark model {name!r}")
