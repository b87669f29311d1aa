"""Ops ``G`` runs another way than the first-order graphs hold them.

Some ops have no derivative of their own, one has a wrong one; capturing the differentiable
backward (Note [Differentiable backward] in ``runtime/higher_order.py``) runs them through
the rules here (Note [Backward ops without a derivative]): ``WITHOUT_DERIVATIVE`` where
PyTorch's own decomposition will not do, ``REPLACED`` always.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import decomposition
from aotgrad.errors import DoubleBackwardError
from aotgrad.ops.rules import OpRules

# Note [Backward ops without a derivative]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some ops the first-order backward graph holds have no derivative of their own:
# eager never differentiates them, because under ``create_graph=True`` its
# formulas pick another, differentiable form (SiLU's backward is
# ``silu_backward`` with grad mode off, a product of sigmoids with it on), and
# the functional ``copy`` only exists in functionalized graphs. Capturing ``G``
# through such an op fails with "derivative for aten::silu_backward is not
# implemented"; the capture then runs that op through its decomposition into
# ops that have derivatives, and tries again, once per op:
#
#     G's graph                      captured as
#     silu_backward(g, x)      ->    g * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
#     copy(self, src)          ->    src cast to self's dtype, expanded to its shape,
#                                    in self's layout (functional_copy below)
#
# An op with neither a derivative nor a decomposition (CPU flash attention's
# backward, which eager cannot differentiate either) raises DoubleBackwardError.
#
# One op has a derivative that is wrong: ``as_strided_scatter``'s gradient with
# respect to the tensor written into keeps the positions the write replaced
# (for ``as_strided_scatter(a, s, [2], [1], 3)`` on a 1-D ``a``, d out / d a[3]
# should be 0; torch 2.13 gives 1). Functionalized graphs write every change to
# a base through it, so ``G`` always runs it as an ``index_put`` at the storage
# positions the strided view covers (as_strided_scatter below):
#
#     as_strided_scatter(a, s, [2], [1], 3)   ->   a.index_put(([3, 4],), s)

NO_DERIVATIVE = re.compile(r"derivative for (?:aten::)?([\w.]+) is not implemented")


def op_without_derivative(error: Exception, graph: fx.GraphModule) -> Any:
    """The op of ``graph`` the error says has no derivative, or None."""
    found = NO_DERIVATIVE.search(str(error))
    if found is None:
        return None
    return next((n.target for n in graph.graph.nodes if is_op_named(n, found.group(1))), None)


def is_op_named(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "_opname", None) == name


# Ops without a derivative whose rule here replaces PyTorch's decomposition (``copy`` has
# none: it only exists in functionalized graphs).
WITHOUT_DERIVATIVE: OpRules[Callable[..., Any]] = OpRules("differentiable form")
# Ops replaced in every capture of ``G``: PyTorch's derivative of ``as_strided_scatter`` with
# respect to ``self`` does not zero the positions the write covers (torch 2.13: gradcheck fails
# even for a 1-D ``self``), so differentiating a graph through it would be silently wrong.
REPLACED: OpRules[Callable[..., Any]] = OpRules("replacement in G")


def decomposition_of(op: Any) -> Callable[..., Any] | None:
    """How ``G`` runs ``op``, which has no derivative: a rule here, or PyTorch's decomposition."""
    return WITHOUT_DERIVATIVE.get(op) or decomposition(op)


@WITHOUT_DERIVATIVE.register(torch.ops.aten.copy.default)
def functional_copy(
    self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """``aten.copy`` from differentiable ops (Note [Backward ops without a derivative]).

    The result has ``self``'s strides when they are a permutation of a contiguous layout (a
    transpose): the value is laid out contiguously in that permuted order and permuted back.
    """
    value = src.to(dtype=self.dtype, device=self.device).expand(self.shape)
    strides = self.stride()
    order = sorted(range(self.dim()), key=lambda d: (-strides[d], d))
    if self.is_contiguous() or not _dense(self):
        return value.clone(memory_format=torch.contiguous_format)
    back = sorted(range(self.dim()), key=order.__getitem__)
    laid_out = value.permute(order).clone(memory_format=torch.contiguous_format)
    return laid_out.permute(back)


@REPLACED.register(torch.ops.aten.as_strided_scatter.default)
def as_strided_scatter(
    self: torch.Tensor,
    src: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> torch.Tensor:
    """``aten.as_strided_scatter`` from ops whose derivatives are right (Note [Backward ops
    without a derivative]): the value laid out in storage order, ``src`` put at the positions
    the strided view covers, laid back out in ``self``'s strides."""
    if not _dense(self):
        raise DoubleBackwardError(
            "create_graph=True: the backward of a compiled function writes through an"
            f" as_strided view of a tensor whose layout (size {tuple(self.shape)}, stride"
            f" {self.stride()}) has gaps or overlaps; aotgrad cannot differentiate that write"
            " again.\nCompute this derivative without create_graph=True."
        )
    strides = self.stride()
    order = sorted(range(self.dim()), key=lambda d: (-strides[d], d))
    back = sorted(range(self.dim()), key=order.__getitem__)
    storage = self.permute(order).reshape(-1)
    positions = torch.full((), storage_offset or 0, dtype=torch.long, device=self.device)
    for d, (n, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[d] = n
        steps = torch.arange(n, dtype=torch.long, device=self.device) * step
        positions = positions + steps.reshape(shape)
    values = src.to(self.dtype).expand(tuple(size)).reshape(-1)
    written = storage.index_put((positions.reshape(-1),), values)
    return written.reshape([self.shape[d] for d in order]).permute(back)


def _dense(t: torch.Tensor) -> bool:
    """Does ``t``'s layout cover its elements once each, in some order of its dimensions?"""
    expected = 1
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True))
    for stride, size in dims:
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


__all__ = [
    "NO_DERIVATIVE",
    "REPLACED",
    "WITHOUT_DERIVATIVE",
    "as_strided_scatter",
    "decomposition_of",
    "functional_copy",
    "is_op_named",
    "op_without_derivative",
]
