"""The benchmark models (issue: benchmarks), shared by every benchmark."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeedConvNet(nn.Module):
    """The seq_nr seed document's conv / batchnorm / relu / residual / linear / L1-loss net."""

    def __init__(self, channels: int = 16, size: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=1, padding="same")
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.fc1 = nn.Linear(channels * size * size, 1)
        self.loss_fn = nn.L1Loss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x))) + x
        return self.loss_fn(self.fc1(torch.flatten(y)), target)


class MLP8(nn.Module):
    """8 × (Linear 512 + GELU), mean-square loss."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x.pow(2).mean()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN GPT: d_model 256, 4 heads, tied embedding and head, vocab 1000, cross-entropy."""

    def __init__(
        self,
        blocks: int,
        vocab: int = 1000,
        dim: int = 256,
        heads: int = 4,
        context: int = 128,
        tied: bool = True,
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make(name: str, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """A benchmark model and its example inputs, by name: conv, mlp8, gpt4, gpt12."""
    torch.manual_seed(seed)
    if name == "conv":
        return SeedConvNet(), (torch.randn(1, 16, 32, 32), torch.randn(1))
    if name == "mlp8":
        return MLP8(), (torch.randn(64, 512),)
    if name.startswith("gpt"):
        idx = torch.randint(0, 1000, (4, 128))
        return GPT(int(name[3:])), (idx, torch.randint(0, 1000, (4, 128)))
    raise ValueError(f"unknown benchmark model {name!r}")
