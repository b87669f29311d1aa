"""Dynamic shapes: symbolic sizes in the graphs, and the guards that say which sizes they serve.

Note [Dynamic shapes]
~~~~~~~~~~~~~~~~~~~~~
With ``dynamic=True`` (every dimension of the user's tensors but those of
size 0 or 1) or ``aotgrad.dynamic(x, dim=0)`` (chosen dimensions), capture
gives the fake inputs symbolic sizes from a ``ShapeEnv``; the graphs compute
with ``sym_size`` nodes instead of constants, and sizes the backward needs
are saved like tensors (``saved: sym_size_int``). Tracing records guards on
the symbols (``s0 >= 2``, say); one compiled entry serves every call whose
sizes satisfy them::

    forward(x: f32[s0, 16], w) -> (out, sym_size_int, relu)   # s0: the batch
    guards: 2 <= s0

Parameters and buffers stay static. Outputs or mutations whose layout
depends on a symbol (views of inputs, ``t_()``) are refused with a clear
error for now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

_ATTRIBUTE = "_aotgrad_dynamic_dims"
_MARKED = [False]  # has any tensor ever been marked? (keeps unmarked calls cheap)


def dynamic(x: torch.Tensor, dim: int | Sequence[int] = 0) -> torch.Tensor:
    """Mark ``x``'s dimension(s) ``dim`` dynamic for aotgrad's traces; returns ``x``.

    >>> import torch, aotgrad
    >>> x = aotgrad.dynamic(torch.ones(8, 4), dim=0)
    >>> aotgrad.capture.dynamic.marked_dims(x)
    (0,)
    """
    dims = [dim] if isinstance(dim, int) else list(dim)
    marked = set(getattr(x, _ATTRIBUTE, ()))
    marked.update(d % x.dim() for d in dims)
    setattr(x, _ATTRIBUTE, frozenset(marked))
    _MARKED[0] = True
    return x


def has_marks() -> bool:
    """Has any live tensor been marked with :func:`dynamic`? (Cheap: checked on every call.)"""
    return _MARKED[0]


def marked_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted(getattr(x, _ATTRIBUTE, ())))


def all_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every dimension that can vary: sizes 0 and 1 stay static (they change broadcasting)."""
    return tuple(d for d, n in enumerate(x.shape) if n > 1)


def symbolic_context(x: torch.Tensor, dims: Sequence[int]) -> StatelessSymbolicContext:
    sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(x.dim())]
    return StatelessSymbolicContext(dynamic_sizes=sizes)


def new_shape_env() -> ShapeEnv:
    return ShapeEnv()


@dataclass
class ShapeGuards:
    """The conditions on symbolic sizes under which a traced graph is valid."""

    shape_env: ShapeEnv
    # The fake graph inputs, in graph order.
    placeholders: Sequence[Any]
    _code: Any = field(default=None, repr=False)

    def expression(self) -> str | None:
        return self.shape_env.produce_guards_expression(self.placeholders)

    def check(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Do real ``inputs`` (graph order) satisfy the guards?"""
        if self._code is None:
            text = self.expression()
            self._code = compile(text, "<aotgrad guards>", "eval") if text else False
        if self._code is False:
            return True
        names = {f"t{i}": value for i, value in enumerate(inputs)}
        return bool(eval(self._code, SYMPY_INTERP, {"L": names}))


def is_symbolic(values: Sequence[Any]) -> bool:
    return any(isinstance(v, torch.SymInt) for v in values)
