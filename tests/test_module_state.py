"""A module's parameters and buffers as lifted inputs (Note [Module state in a trace])."""

from __future__ import annotations

import torch
import torch.nn as nn

import aotgrad
from aotgrad.testing import verify


class Block(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared  # registered here and on the parent: two names, one attribute
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.shared(x))


class SharedSubmodule(nn.Module):
    """timm's CoaT shape: one positional-encoding module handed to every block."""

    def __init__(self) -> None:
        super().__init__()
        self.cpe = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.blocks = nn.ModuleList([Block(self.cpe), Block(self.cpe)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_submodule_registered_twice_gets_its_grads() -> None:
    # The capture's swap visited the shared attribute once per name and restored a fake
    # tensor into the real module: cpe's parameters got no gradient (silently).
    torch.manual_seed(0)
    verify(SharedSubmodule(), torch.randn(3, 4))


def test_submodule_registered_twice_keeps_its_real_tensors() -> None:
    model = SharedSubmodule()
    real = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    aotgrad.aot_module(model)(torch.randn(3, 4)).sum().backward()
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(after[n] is t for n, t in real.items())
    assert all(type(t) in (nn.Parameter, torch.Tensor) for t in after.values())
    assert model.cpe[0].weight.grad is not None


def test_tied_and_shared_together() -> None:
    torch.manual_seed(0)
    model = SharedSubmodule()
    model.blocks[1].fc.weight = model.blocks[0].fc.weight  # tied across two modules
    verify(model, torch.randn(3, 4))


class _Scaled(nn.Parameter):
    """A parameter subclass of the kind libraries tag their parameters with."""


class ReadsItsParameters(nn.Module):
    """Code that looks at its parameters as Python objects, not only through ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.fc.weight  # tied
        self.scale = _Scaled(torch.full((4,), 0.5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each branch is Python: the trace records the one it takes.
        y = self.fc(x) * self.scale if isinstance(self.scale, _Scaled) else self.fc(x)
        if self.head.weight is self.fc.weight:
            y = y + self.head(y)
        self.calls.add_(1)
        return y + torch.nn.functional.linear(y, self.fc.weight.data)


def test_parameters_are_the_users_own_objects_during_the_capture() -> None:
    # The capture put fake primals in the module's attributes: ``isinstance(self.scale,
    # _Scaled)`` was False in the trace, and the graph silently dropped the scale.
    torch.manual_seed(0)
    verify(ReadsItsParameters(), torch.randn(3, 4))
    model = ReadsItsParameters()
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(m.scale))
    aotgrad.aot_module(model)(torch.randn(3, 4))
    assert seen == [model.scale]  # the real parameter, also inside the capture
