"""Capture cost on models nobody here wrote (issue 17): aotgrad / PyTorch per model.

Each model is a small random config (``tests/library_models.py``: transformers GPT-2, Llama,
BERT; timm convnext, efficientnet; torchvision resnet18, mobilenet_v3) plus ``gpt_explicit``,
a GPT whose attention is written out (matmul, masked_fill, softmax) instead of
``scaled_dot_product_attention``. Capture is what ``bench/capture.py`` measures: wrap, then
the first forward+backward with nop compilers; PyTorch's side is ``aot_function`` over
``torch.func.functional_call``. Every measurement runs in a fresh process, tools taking
turns. As a script it measures one model in this process:
``python bench/library_capture.py resnet18 aotgrad`` (or ``all`` for the whole suite).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOLS = ("aotgrad", "pytorch")
MODELS = (
    "gpt2",
    "llama",
    "bert",
    "resnet18",
    "mobilenet_v3",
    "efficientnet",
    "convnext",
    "gpt_explicit",
)


class ExplicitAttention(nn.Module):
    """Causal self-attention with the softmax written out (no scaled_dot_product_attention)."""

    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(context, context)).bool())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ExplicitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ExplicitAttention(dim, heads, context)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ExplicitGPT(nn.Module):
    """nanoGPT-style: untied head, explicit attention, cross-entropy on the logits."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(16, dim)
        self.blocks = nn.ModuleList(ExplicitBlock(dim, heads, 16) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make(name: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    """Model, args, kwargs and loss-of-output for ``name``."""
    torch.manual_seed(0)
    if name == "gpt_explicit":
        idx = torch.randint(0, 64, (2, 16))
        return ExplicitGPT(), (idx, torch.randint(0, 64, (2, 16))), {}, lambda out: out
    import library_models

    case = library_models.build(name)
    return case.model, case.args, case.kwargs, case.loss


def capture_aotgrad(name: str) -> float:
    import aotgrad

    model, args, kwargs, loss = make(name)
    start = time.perf_counter()
    loss(aotgrad.aot_module(model)(*args, **kwargs)).backward()
    return time.perf_counter() - start


def capture_pytorch(name: str) -> float:
    from functorch.compile import aot_function, default_partition

    import aotgrad
    from aotgrad.capture.tracing.joint import compiling

    model, args, kwargs, loss = make(name)
    start = time.perf_counter()
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def fn(state: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        return torch.func.functional_call(model, state, args, kwargs)

    compiled = aot_function(fn, fw_compiler=aotgrad.nop, partition_fn=default_partition)
    # transformers' mask code takes its traceable branch only when it is told it is being
    # compiled, as aotgrad's capture does (Note [Capture is compiling]).
    with compiling():
        loss(compiled(state, args, kwargs)).backward()
    return time.perf_counter() - start


RUN = {"aotgrad": capture_aotgrad, "pytorch": capture_pytorch}


def measure(name: str, tool: str) -> float:
    """Seconds to capture ``name`` with ``tool`` in this process (imports done beforehand)."""
    torch.set_num_threads(1)
    make(name)  # imports the model's library outside the timed region
    # Dynamo too: PyTorch's side loads it with functorch.compile, aotgrad's first capture
    # through PyTorch's fake tensors (Note [What loads Dynamo]). These rows time capture; the
    # imports are bench/first_gradient.py's rows.
    importlib.import_module("torch._dynamo")
    return RUN[tool](name)


def measure_in_fresh_processes(
    names: tuple[str, ...] = MODELS, repeats: int = 3
) -> dict[str, dict[str, float]]:
    """Per model and tool, the median seconds over ``repeats`` fresh processes."""
    # Imported here: bench/capture.py imports functorch.compile, and with it Dynamo, which
    # bench/first_gradient.py's processes (they build models with ``make``) must not pay.
    from capture import run_fresh  # fresh processes, the disk cache off

    runs: dict[str, dict[str, list[float]]] = {n: {t: [] for t in TOOLS} for n in names}
    for _ in range(repeats):
        for name in names:
            for tool in TOOLS:
                runs[name][tool].append(run_fresh(__file__, name, tool))
    return {
        name: {tool: sorted(ts)[len(ts) // 2] for tool, ts in per_tool.items()}
        for name, per_tool in runs.items()
    }


def _print_suite(repeats: int) -> None:
    found = measure_in_fresh_processes(MODELS, repeats)
    for name, t in found.items():
        print(
            f"{name:14s} aotgrad {t['aotgrad']:.3f} s  pytorch {t['pytorch']:.3f} s"
            f"  ratio {t['aotgrad'] / t['pytorch']:.2f}x"
        )
    worst = max(found, key=lambda n: found[n]["aotgrad"] / found[n]["pytorch"])
    print(f"worst: {worst} {found[worst]['aotgrad'] / found[worst]['pytorch']:.2f}x")


if __name__ == "__main__":
    if sys.argv[1] == "all":
        _print_suite(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    else:
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
