"""The calling convention of the forward and backward graphs, as data.

Note [Calling convention]
~~~~~~~~~~~~~~~~~~~~~~~~~
``forward(*inputs) -> (*outputs, *bases, *mutated, *saved)`` and
``backward(*saved, *cotangents) -> grads``. For ``fn(x, w) = (x @ w).sin()``
with only ``w`` requiring grad::

    forward(x, w)          -> (sin, mm)      # output[0]; saved: mm
    backward(mm, x, cot_0) -> (None, grad_w) # grads, one per forward input

- ``inputs``: one per tensor leaf of the user's call (Note [Input order]).
- ``outputs``: one per tensor leaf of the user's result, duplicates and views
  included, in pytree order.
- ``bases``: intermediates that several outputs view (Note [Aliased outputs]).
- ``mutated``: new values of inputs the function mutated in place.
- ``saved``: what the backward needs; the backward receives them first.
- ``cotangents``: one per differentiable output the autograd machinery sees.
- ``grads``: one per forward input, ``None`` for those that need no gradient.
``docs/calling-convention.md`` is the user-facing statement of this Note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aotgrad.signature.descriptors import (
    Cotangent,
    Descriptor,
    Grad,
    GraphInputDescriptor,
    MutatedInput,
    Output,
    OutputBase,
    Saved,
)

SIGNATURE_VERSION = 1


@dataclass(frozen=True)
class Signature:
    """Every placeholder and output of the forward and backward graphs, described."""

    # Forward placeholders: lifted module state, then the user's tensors (Note [Input order]);
    # inputs sharing memory may be replaced by one InputBase (Note [Aliased inputs]).
    forward_inputs: tuple[GraphInputDescriptor, ...]
    # Forward outputs, in order: Output..., OutputBase..., MutatedInput..., Saved...
    forward_outputs: tuple[Descriptor, ...]
    # Backward placeholders, in order: Saved..., Cotangent...
    backward_inputs: tuple[Saved | Cotangent, ...]
    # Backward outputs: one per forward input; None where that input needs no gradient.
    backward_outputs: tuple[Grad | None, ...]
    # Version of this convention; bumped whenever its layout changes.
    version: int = field(default=SIGNATURE_VERSION)

    def __post_init__(self) -> None:
        kinds = [_ORDER[type(d)] for d in self.forward_outputs]
        if kinds != sorted(kinds):
            raise AssertionError(f"forward outputs out of order: {self.forward_outputs}")
        if len(self.backward_outputs) != len(self.forward_inputs):
            raise AssertionError(
                f"expected {len(self.forward_inputs)} grads, got {len(self.backward_outputs)}"
            )

    @property
    def outputs(self) -> tuple[Output, ...]:
        return tuple(d for d in self.forward_outputs if isinstance(d, Output))

    @property
    def saved(self) -> tuple[Saved, ...]:
        return tuple(d for d in self.forward_outputs if isinstance(d, Saved))

    @property
    def cotangents(self) -> tuple[Cotangent, ...]:
        return tuple(d for d in self.backward_inputs if isinstance(d, Cotangent))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the layout is versioned by ``version``."""
        return {
            "version": self.version,
            "forward_inputs": [d.to_dict() for d in self.forward_inputs],
            "forward_outputs": [d.to_dict() for d in self.forward_outputs],
            "backward_inputs": [d.to_dict() for d in self.backward_inputs],
            "backward_outputs": [d.to_dict() if d else None for d in self.backward_outputs],
        }

    def __str__(self) -> str:
        def column(title: str, descs: tuple[Descriptor | None, ...]) -> list[str]:
            return [f"  {title}:"] + [f"    {i}: {d}" for i, d in enumerate(descs)]

        lines = [f"Signature v{self.version}"]
        lines += column("forward inputs", self.forward_inputs)
        lines += column("forward outputs", self.forward_outputs)
        lines += column("backward inputs", self.backward_inputs)
        lines += column("backward outputs", self.backward_outputs)
        return "\n".join(lines)


_ORDER = {Output: 0, OutputBase: 1, MutatedInput: 2, Saved: 3}
