"""One table of per-op rules, each entry registered beside its rule (JAX's ``primitive_jvps``).

>>> import torch
>>> DOUBLED = OpRules("doubled")
>>> @DOUBLED.register(torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
... def _twice(x): return x + x
>>> DOUBLED[torch.ops.aten.mul.Tensor](3)
6
>>> DOUBLED.add(torch.ops.aten.add.Tensor, _twice)
Traceback (most recent call last):
...
AssertionError: expected one doubled rule per op, got a second for aten.add.Tensor
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

Rule = TypeVar("Rule")


class OpRules(dict[Any, Rule]):
    """A dict from ``OpOverload`` to its rule, filled by :meth:`register` beside each rule."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind  # what the rules are, for the duplicate check's message

    def add(self, op: Any, rule: Rule) -> None:
        """``op``'s rule (a rule a factory makes); a second rule for one op is a bug."""
        if op in self:
            raise AssertionError(f"expected one {self.kind} rule per op, got a second for {op}")
        self[op] = rule

    def register(self, *ops: Any) -> Callable[[Rule], Rule]:
        """A decorator adding the function it decorates as the rule of each of ``ops``."""

        def add(rule: Rule) -> Rule:
            for op in ops:
                self.add(op, rule)
            return rule

        return add
