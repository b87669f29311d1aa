"""The check every backend test runs: a model's flat programs, compiled by a backend, against
eager (docs/backends.md).

``check_backend(model, loss, args, kwargs, backend)`` traces ``loss(model(*args, **kwargs))``,
exports the flat programs, runs one step of them through ``aotgrad.backends.step`` and compares
the loss, every buffer after the step and every parameter's gradient with eager's, at the
tolerances given, and the generator's state after the step: the step starts from the generator
state eager's step started from, so a model with dropout draws eager's masks (Note [Random
draws as inputs]) and leaves the generator where eager leaves it (stated in each test: a backend computes in its own kernels, with its own
summation order and its own transcendental functions).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import aotgrad
from aotgrad.backends import StepResult, step
from aotgrad.export import ExportedGraphs
from aotgrad.signature.descriptors import Buffer, Param


class WithLoss(torch.nn.Module):
    """``loss(model(*args, **kwargs))`` as one module, so the graphs compute the loss."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss(self.model(*args, **kwargs))


def _prefixed(what: str) -> Callable[[str], str]:
    """An ``assert_close`` message naming the value compared before torch's own."""
    return lambda message: f"{what}: {message}"


def check_backend(
    model: torch.nn.Module,
    loss: Callable[[Any], torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    rtol: float,
    atol: float,
    decompositions: str | None = "core_aten",
) -> tuple[ExportedGraphs, StepResult]:
    """Run one step of ``model``'s exported programs in ``backend`` and compare it with eager."""
    wrapped = WithLoss(model, loss)
    eager, traced_model = copy.deepcopy(wrapped), copy.deepcopy(wrapped)
    start = torch.get_rng_state()
    expected = eager(*args, **kwargs)
    expected.backward()
    after_eager = torch.get_rng_state()
    traced = aotgrad.trace(traced_model, *args, decompositions=decompositions, **kwargs)
    programs = traced.export(flat=True)
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [leaves[i] for i in traced.partitioned.joint.inputs.tensor_positions]
    run = step(programs, backend)
    torch.set_rng_state(start)
    result = run(*tensors)
    assert torch.equal(torch.get_rng_state(), after_eager), "the generator moved unlike eager's"

    (loss_value,) = result.outputs
    torch.testing.assert_close(
        loss_value, expected.detach(), rtol=rtol, atol=atol, msg=_prefixed("loss")
    )
    buffers = dict(eager.named_buffers())
    for desc, value in result.mutations.items():
        assert isinstance(desc, Buffer), desc
        torch.testing.assert_close(
            value, buffers[desc.name], rtol=rtol, atol=atol, msg=_prefixed(desc.name)
        )
    expected_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    got = {d.name: g for d, g in result.grads.items() if isinstance(d, Param)}
    assert got.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(
            got[name], grad, rtol=rtol, atol=atol, msg=_prefixed(f"grad of {name}")
        )
    return programs, result
