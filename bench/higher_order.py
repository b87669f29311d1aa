"""Higher-order gradients: a WGAN-GP critic step (gradient penalty), aotgrad + Inductor vs eager
and vs ``torch.compile`` (docs/higher-order.md)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import aotgrad

Step = Callable[[], torch.Tensor]


def critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.LeakyReLU(0.2),
        nn.Linear(256, 256),
        nn.LeakyReLU(0.2),
        nn.Linear(256, 1),
    )


def wgan_gp_step(
    model: Callable[[torch.Tensor], torch.Tensor], params: Any, batch: tuple[torch.Tensor, ...]
) -> Step:
    """One critic step: Wasserstein loss plus 10 x the gradient penalty, then SGD."""
    real, fake, alpha = batch
    opt = torch.optim.SGD(params, lr=1e-4)

    def step() -> torch.Tensor:
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(model(mixed).sum(), mixed, create_graph=True)
        penalty = (grad.norm(2, dim=1) - 1).pow(2).mean()
        loss = model(fake).mean() - model(real).mean() + 10 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _seconds(step: Step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(warmup: int = 3, steps: int = 15) -> dict[str, Any]:
    """Median seconds per step per tool; a tool that refuses double backward gives its error."""
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(64, 64, generator=g),
        torch.randn(64, 64, generator=g),
        torch.rand(64, 1, generator=g),
    )
    eager = critic()
    models = {
        "eager": eager,
        "aotgrad_inductor": aotgrad.aot_module(
            copy.deepcopy(eager), aotgrad.compilers.inductor, aotgrad.compilers.inductor
        ),
        "torch_compile": torch.compile(copy.deepcopy(eager)),
    }
    tools: dict[str, Step] = {}
    found: dict[str, Any] = {}
    for name, model in models.items():
        step = wgan_gp_step(model, model.parameters(), batch)
        try:
            for _ in range(warmup):
                step()
        except Exception as error:  # PyTorch's compile may refuse double backward
            found[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        tools[name] = step
    times: dict[str, list[float]] = {name: [] for name in tools}
    for _ in range(steps):
        for name, step in tools.items():
            times[name].append(_seconds(step))
    found.update({name: sorted(t)[len(t) // 2] for name, t in times.items()})
    return found


if __name__ == "__main__":
    print(measure())
