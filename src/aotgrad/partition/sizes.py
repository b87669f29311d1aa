"""Symbolic sizes (dynamic shapes) at the example inputs' values: what every strategy weighs,
and what every byte count aotgrad predicts or reports is computed at (Note [Weights at the
example sizes]).

Reading a ``SymInt``'s example value (its hint) adds no guard; ``int()``, ``float()`` or a
comparison would, and would narrow the sizes the capture serves. Nothing in ``partition/`` or
``report/`` does arithmetic on a size's value but through :func:`hint`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad._torch_compat import size_hint, symbol_hints
from aotgrad.capture import JointGraph

__all__ = [
    "ExampleSize",
    "example_sizes",
    "hint",
    "hinted_bytes",
    "is_static",
    "sizes_text",
    "symbols_of",
]


def is_static(val: torch.Tensor) -> bool:
    """Whether ``val``'s sizes, strides and offset are plain ints (not traced as symbols).

    >>> is_static(torch.ones(2, 3))
    True
    """
    return all(isinstance(n, int) for n in (*val.shape, *val.stride(), val.storage_offset()))


# Note [Weights at the example sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under ``dynamic=True`` (or ``aotgrad.dynamic(x, dim)``) a tensor's bytes are
# a ``SymInt`` (``4*s0*s1``). Every strategy weighs bytes and FLOPs and compares
# them; comparing ``SymInt``s would add guards to the capture (or fail), so
# they are weighed at the sizes of the example inputs (their hints: the call
# that traced), as PyTorch's partitioner does. A plan is a choice of values
# to save; every other value the backward reads is recomputed from them, so a
# plan computes the same gradients at every size the guards admit. It is
# chosen as the best for the example's sizes; at other sizes it is still right,
# only maybe not the cheapest. With ``x: (s0, 8)`` and ``s0 = 16`` at capture::
#
#     a = x @ w    4*s0*8 bytes -> 512     b = a.relu()    4*s0*8 -> 512
#     the cut compares 512 with 512, never s0 with s0
#
# The byte budgets are caps at those sizes too (Note [Budgets at the example
# sizes] in ``partition/peak_budget.py``), and so are the numbers the plan
# reports (``Partitioned.peak``, ``recompute_flops``), each saying at which sizes
# (``s0 = 16 (x.size()[0])``). ``SavedValue.nbytes`` and ``saved_bytes`` stay
# symbolic (``512*s0``): they are exact at every size, and the reports print them
# at the example sizes beside the expression.


def hint(value: int | torch.SymInt) -> int:
    """``value`` at the example inputs' sizes; an int is its own. Adds no guard.

    >>> hint(12)
    12
    """
    found = size_hint(value)
    if found is None:
        raise AssertionError(f"expected a size with an example value, got {value}")
    return found


def hinted_bytes(values: Iterable[Any]) -> int:
    """:func:`aotgrad.partition.saved.unique_bytes` at the example sizes (Note [Weights at the
    example sizes])."""
    from aotgrad.partition.saved import unique_bytes  # saved.py imports this module

    return hint(unique_bytes(values))


@dataclass(frozen=True)
class ExampleSize:
    """One symbol of a dynamic capture, the input dimension it came from, and its example value."""

    symbol: str  # "s0", as the graphs' shapes print it
    source: str  # "x.size()[0]": the user's name for it ("" when no input has it as a size)
    value: int

    def __str__(self) -> str:
        return f"{self.symbol} = {self.value}" + (f" ({self.source})" if self.source else "")


def example_sizes(joint: JointGraph) -> tuple[ExampleSize, ...]:
    """The symbols of ``joint``'s inputs at their example values, in input order; ``()`` for a
    static capture.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin(), torch.ones(8, 3, requires_grad=True), dynamic=True)
    >>> [(s.source, s.value) for s in example_sizes(t.partitioned.joint)]
    [('x.size()[0]', 8), ('x.size()[1]', 3)]
    """
    guards = joint.guards
    if guards is None:
        return ()
    found: dict[str, ExampleSize] = {}
    for i, value in enumerate(guards.placeholders):
        name = guards.names[i] if i < len(guards.names) else f"input {i}"
        for where, size in _sizes(name, value):
            expr = size.node.expr
            if getattr(expr, "is_Symbol", False):
                found.setdefault(str(expr), ExampleSize(str(expr), where, hint(size)))
    return tuple(found.values())


def _sizes(name: str, value: Any) -> list[tuple[str, torch.SymInt]]:
    if isinstance(value, torch.SymInt):
        return [(name, value)]
    if not isinstance(value, torch.Tensor):
        return []
    sizes: list[Any] = list(value.shape)  # ints, or SymInts under dynamic shapes
    return [(f"{name}.size()[{d}]", n) for d, n in enumerate(sizes) if isinstance(n, torch.SymInt)]


def symbols_of(values: Iterable[Any]) -> tuple[ExampleSize, ...]:
    """The symbols in ``values`` (ints and SymInts) at their example values, by name.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin(), torch.ones(8, 3, requires_grad=True), dynamic=True)
    >>> sorted(s.value for s in symbols_of([t.saved[0].nbytes]))  # 4*s0*s1 bytes
    [3, 8]
    """
    found: dict[str, ExampleSize] = {}
    for value in values:
        if not isinstance(value, torch.SymInt):
            continue
        for symbol, example in symbol_hints(value).items():  # reading them adds no guard
            found.setdefault(symbol, ExampleSize(symbol, "", example))
    return tuple(found[k] for k in sorted(found, key=lambda k: (len(k), k)))


def sizes_text(sizes: Iterable[ExampleSize]) -> str:
    """``'s0 = 8 (x.size()[0]), s1 = 3 (x.size()[1])'``."""
    return ", ".join(str(s) for s in sizes)
