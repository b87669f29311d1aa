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

Parameters, buffers and unmarked dimensions stay static. Every size the
trace specialized is a guard too (Note [Specializations are guards]); a call
failing the guards traces again, next to the old entry. Outputs or mutations
whose layout depends on a symbol (views, ``t_()``) are rebuilt at each call
from the real sizes (Note [Symbolic layouts] in ``aliasing.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

from aotgrad._torch_compat import local_source

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


# Note [Specializations are guards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Tracing may turn a symbolic size into a constant: ``int(y.shape[1])``, or an
# op whose meta function branches on a size (``F.pad`` then ``reshape(-1)``),
# records ``Eq(s1, 4)`` and replaces ``s1`` by 4 in everything after. The graph
# is then only valid at width 4. ``produce_guards`` skips such sizes by default
# (``ignore_static``: Dynamo checks static sizes elsewhere), and the call key
# leaves dynamic dimensions out, so nothing would check them. aotgrad asks for
# every guard, static values included, of every input with a symbolic size::
#
#     f = aot_function(lambda y: y * int(y.shape[1]), dynamic=True)
#     f(ones(2, 4))   guards: y.size()[1] == 4 and y.stride()[0] == 4 and 2 <= y.size()[0]
#     f(ones(2, 6))   fails y.size()[1] == 4: traced again (cache_info names the guard)
#
# Inputs without symbols (parameters, buffers, static tensors) are left out:
# the call key already holds their exact metadata.


@dataclass
class ShapeGuards:
    """The conditions on symbolic sizes under which a traced graph is valid."""

    shape_env: ShapeEnv
    # The fake graph inputs, in graph order.
    placeholders: Sequence[Any]
    # The user's name for each graph input, for messages ("x", "param fc1.weight").
    names: Sequence[str] = ()
    _terms: list[str] | None = field(default=None, repr=False)
    _code: Any = field(default=None, repr=False)

    def terms(self) -> list[str]:
        """Every guard, as Python over ``L['t<i>']`` (graph input ``i``)."""
        if self._terms is None:
            symbolic = [i for i, p in enumerate(self.placeholders) if _has_symbols(p)]
            self._terms = self.shape_env.produce_guards(
                [self.placeholders[i] for i in symbolic],
                [local_source(f"t{i}") for i in symbolic],
                ignore_static=False,  # Note [Specializations are guards]
            )
        return self._terms

    def expression(self) -> str | None:
        return " and ".join(self.terms()) or None

    def check(self, inputs: Sequence[Any]) -> bool:
        """Do real ``inputs`` (graph order) satisfy the guards?"""
        if self._code is None:
            text = self.expression()
            self._code = compile(text, "<aotgrad guards>", "eval") if text else False
        if self._code is False:
            return True
        return bool(eval(self._code, SYMPY_INTERP, {"L": _locals(inputs)}))

    def failed(self, inputs: Sequence[Any]) -> str | None:
        """The first guard ``inputs`` fail, in the user's names; None when all pass."""
        scope = {"L": _locals(inputs)}
        for term in self.terms():
            if not eval(term, SYMPY_INTERP, scope):
                return self.describe(term)
        return None

    def value_of(self, inputs: Sequence[Any]) -> Callable[[Any], int]:
        """Evaluates a ``SymInt`` of the trace at real ``inputs`` (graph order); ints pass."""
        bindings = self.shape_env.bind_symbols(self.placeholders, inputs)
        shape_env = self.shape_env

        def value_of(value: Any) -> int:
            if not isinstance(value, torch.SymInt):
                return int(value)
            return int(shape_env.replace(value.node.expr).xreplace(bindings))

        return value_of

    def describe(self, term: str) -> str:
        """``L['t0'].size()[1] == 4`` → ``y.size()[1] == 4``."""
        names = self.names
        return _INPUT.sub(lambda m: names[int(m[1])] if int(m[1]) < len(names) else m[0], term)


_INPUT = re.compile(r"L\['t(\d+)'\]")


def _locals(inputs: Sequence[Any]) -> dict[str, Any]:
    return {f"t{i}": value for i, value in enumerate(inputs)}


def _has_symbols(value: Any) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if not isinstance(value, torch.Tensor):
        return False
    sizes = [*value.shape, *value.stride(), value.storage_offset()]
    return any(isinstance(n, torch.SymInt) for n in sizes)


def is_symbolic(values: Sequence[Any]) -> bool:
    return any(isinstance(v, torch.SymInt) for v in values)
