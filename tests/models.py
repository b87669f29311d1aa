"""Small models the tests and benchmarks share."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, sizes=(16, 32, 32, 8)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


class ConvBN(nn.Module):
    """The seed's conv / batchnorm / linear / L1-loss shape, small."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu1 = nn.ReLU()
        self.fc1 = nn.Linear(4 * 6 * 6, 10)
        self.loss_fn = nn.L1Loss()

    def forward(self, x, target):
        x = self.relu1(self.bn1(self.conv1(x)))
        x = x + x
        x = torch.flatten(x, 1)
        return self.loss_fn(self.fc1(x), target)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT with its token embedding tied to the output head."""

    def __init__(self, vocab=64, dim=32, heads=4, blocks=2, context=16, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class DeepMLP(nn.Module):
    """An 8-layer MLP with a loss: the rematerialization benchmarks' first model."""

    def __init__(self, width=256, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


class State(NamedTuple):
    h: torch.Tensor
    c: torch.Tensor


class SeedNet(nn.Module):
    """The conv / batchnorm / relu / residual / linear / L1-loss net of the seq_nr seed document.

    Its structure is read off the seed's expected table: a residual add after relu, a flatten
    to one dimension, and a linear layer on that vector (hence t / unsqueeze / mm / squeeze).
    """

    def __init__(self, channels=4, size=4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=1, padding="same")
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.fc1 = nn.Linear(channels * size * size, 1)
        self.loss_fn = nn.L1Loss()

    def forward(self, x, target):
        residual = x
        x = self.relu1(self.bn1(self.conv1(x)))
        x = x + residual
        x = torch.flatten(x)
        return (self.loss_fn(self.fc1(x), target),)


def partition_suite(seed: int = 0) -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """The model suite as partition comparisons take it: each model returns a tensor to
    differentiate, and its weights are untied (PyTorch's ``aot_module`` refuses tied ones)."""
    torch.manual_seed(seed)
    idx = torch.randint(0, 64, (2, 16))
    return {
        "mlp": (MLP(), (torch.randn(4, 16),)),
        "convbn": (ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))),
        "gpt": (GPT(tied=False), (idx, torch.randint(0, 64, (2, 16)))),
        "deepmlp": (DeepMLP(width=32, depth=4), (torch.randn(8, 32),)),
        "seednet": (SeedNet(), (torch.randn(1, 4, 4, 4), torch.randn(1))),
    }
