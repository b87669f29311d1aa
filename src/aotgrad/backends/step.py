"""One step (forward, then backward) of the flat exported programs in a backend.

A backend is a function from an ``ExportedProgram`` to a callable over tensors; the step
feeds the forward its lifted tensors and the user's inputs, hands the backward the saved
values the forward returned and the cotangents, and names every result by its descriptor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from aotgrad.errors import CallError, ConfigError
from aotgrad.export import ExportedGraphs
from aotgrad.signature.descriptors import (
    Cotangent,
    Descriptor,
    Input,
    InputBase,
    MutatedInput,
    Output,
    OutputBase,
    Saved,
)

__all__ = ["BACKENDS", "BackendStep", "StepResult", "step"]

# A program compiled by a backend: called with the program's user inputs in order, it returns
# its user outputs in order, as CPU tensors.
Program = Callable[..., Sequence[torch.Tensor]]
Compile = Callable[[ExportedProgram], Program]

# The backends ``step`` knows, by name: the module whose ``compile_program`` builds a Program.
BACKENDS: Mapping[str, str] = {
    "onnxruntime": "aotgrad.backends.onnxruntime",
    "iree": "aotgrad.backends.iree",
}


@dataclass(frozen=True)
class StepResult:
    """What one step of the programs computed, named by aotgrad's descriptors."""

    # The function's outputs (``Output`` and ``OutputBase`` descriptors), in order.
    outputs: tuple[torch.Tensor, ...]
    # The new value of each input the function mutated (``MutatedInput.of``), in order.
    mutations: dict[Descriptor, torch.Tensor]
    # The gradient of each input that has one (``Grad.of``: a ``Param``, an ``Input``, ...).
    grads: dict[Descriptor, torch.Tensor]


class BackendStep:
    """The flat programs of ``programs``, compiled by ``compile``; call it with the user's
    inputs (and the cotangents) to run one step."""

    def __init__(self, programs: ExportedGraphs, compile: Compile) -> None:
        if not programs.flat:
            raise CallError(
                "a backend step takes the flat programs, every input and output the user's:"
                " export with traced.export(flat=True)"
            )
        self.programs = programs
        self.forward = compile(programs.forward)
        self.backward = None if programs.backward is None else compile(programs.backward)

    def __call__(
        self, *inputs: torch.Tensor, cotangents: Sequence[torch.Tensor] | None = None
    ) -> StepResult:
        """Run the forward on ``inputs`` (the user's tensors, ``forward_inputs`` after the
        lifted ones) and the draws torch's generator makes for it, then the backward on the saved values and ``cotangents`` (one per
        ``Cotangent`` of ``backward_inputs``; default: ones, the gradient of a sum)."""
        programs = self.programs
        users = [d for d in programs.forward_inputs if isinstance(d, Input | InputBase)]
        if len(inputs) != len(users):
            raise CallError(
                f"expected {len(users)} input tensor(s) ({', '.join(map(str, users))}),"
                f" got {len(inputs)}"
            )
        # Note [Random draws as inputs]: drawn by torch, now, as eager's step draws them
        results = self.forward(*programs.lifted, *inputs, *programs.draw())
        named = dict(zip(programs.forward_outputs, results, strict=True))
        outputs = tuple(
            named[d] for d in programs.forward_outputs if isinstance(d, Output | OutputBase)
        )
        mutations: dict[Descriptor, torch.Tensor] = {
            d.of: named[d] for d in programs.forward_outputs if isinstance(d, MutatedInput)
        }
        grads: dict[Descriptor, torch.Tensor] = {}
        if self.backward is not None:
            arguments = self._backward_arguments(named, cotangents)
            values = self.backward(*arguments)
            grads = {g.of: v for g, v in zip(programs.backward_outputs, values, strict=True)}
        return StepResult(outputs=outputs, mutations=mutations, grads=grads)

    def _backward_arguments(
        self,
        named: Mapping[Descriptor, torch.Tensor],
        cotangents: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        wanted = [d for d in self.programs.backward_inputs if isinstance(d, Cotangent)]
        if cotangents is not None and len(cotangents) != len(wanted):
            raise CallError(
                f"expected {len(wanted)} cotangent(s) ({', '.join(map(str, wanted))}),"
                f" got {len(cotangents)}"
            )
        given = iter(cotangents if cotangents is not None else ())
        arguments = []
        for desc in self.programs.backward_inputs:
            if isinstance(desc, Saved):
                arguments.append(named[desc])
            elif cotangents is not None:
                arguments.append(next(given))
            else:
                arguments.append(torch.ones_like(named[desc.of]))
        return arguments


def step(programs: ExportedGraphs, backend: str | Compile) -> BackendStep:
    """``programs`` (from ``export(flat=True)``) compiled by ``backend``: a name of
    ``BACKENDS`` or a function from an ``ExportedProgram`` to a callable over tensors.

    >>> import torch, aotgrad
    >>> from aotgrad.backends import step
    >>> lin = torch.nn.Linear(3, 2)
    >>> programs = aotgrad.trace(lambda x: lin(x).sum(), torch.ones(4, 3)).export(flat=True)
    >>> eager = step(programs, lambda program: program.module())  # torch itself, as a backend
    >>> result = eager(torch.ones(4, 3))
    >>> [str(d) for d in result.grads]
    ['global lin.weight', 'global lin.bias']
    """
    if callable(backend):
        return BackendStep(programs, backend)
    if backend not in BACKENDS:
        raise ConfigError(
            f"backend={backend!r} is not a backend aotgrad runs programs in: pass one of"
            f" {sorted(BACKENDS)} or a function from an ExportedProgram to a callable"
        )
    module = importlib.import_module(BACKENDS[backend])
    return BackendStep(programs, module.compile_program)
