"""A differential checker: does a compiled function behave exactly like eager?

>>> import torch
>>> from aotgrad.testing import verify
>>> report = verify(lambda x, w: (x @ w).relu(), torch.randn(2, 3), torch.randn(3, 4, requires_grad=True))
>>> report.ok
True
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.api import aot_function, aot_module


class VerificationError(AssertionError):
    """The compiled function differs from eager; the message lists every difference."""


@dataclass
class Report:
    """What :func:`verify` compared, and every mismatch it found."""

    mismatches: list[str] = field(default_factory=list)
    # Largest absolute difference seen over outputs, gradients and inputs.
    max_abs_diff: float = 0.0
    compared_outputs: int = 0
    compared_grads: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        head = (
            f"{self.compared_outputs} outputs and {self.compared_grads} gradients compared,"
            f" max abs diff {self.max_abs_diff:.3g}"
        )
        if self.ok:
            return f"match: {head}"
        return "\n".join([f"{len(self.mismatches)} mismatch(es): {head}", *self.mismatches])


def verify(
    fn: Callable[..., Any],
    *args: Any,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    check: bool = True,
    **kwargs: Any,
) -> Report:
    """Run ``fn`` eagerly and through ``aot_function`` (``aot_module`` for modules) and compare.

    Compares output values, shapes, dtypes and ``requires_grad``, input values
    after the call, and gradients of every input (and parameter) for random
    cotangents on every differentiable output. Raises
    :class:`VerificationError` listing every mismatch unless ``check=False``.
    """
    report = Report()
    eager_fn = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    compiled_fn = aot_module(fn) if isinstance(fn, torch.nn.Module) else aot_function(fn)
    eager_args, eager_kwargs = _clone_tree((args, kwargs))
    compiled_args, compiled_kwargs = _clone_tree((args, kwargs))
    eager_out = eager_fn(*eager_args, **eager_kwargs)
    compiled_out = compiled_fn(*compiled_args, **compiled_kwargs)
    _compare_trees("output", eager_out, compiled_out, report, rtol, atol, check_grad=True)
    _compare_trees(
        "input after the call",
        (eager_args, eager_kwargs),
        (compiled_args, compiled_kwargs),
        report,
        rtol,
        atol,
    )
    _backward(eager_out, compiled_out)
    eager_leaves = [*_grad_holders(eager_fn), *pytree.tree_leaves((eager_args, eager_kwargs))]
    compiled_leaves = [*_grad_holders(fn), *pytree.tree_leaves((compiled_args, compiled_kwargs))]
    for i, (e, c) in enumerate(zip(eager_leaves, compiled_leaves, strict=True)):
        if isinstance(e, torch.Tensor) and e.requires_grad:
            report.compared_grads += 1
            _compare_grad(f"grad of input {i}", e.grad, c.grad, report, rtol, atol)
    if check and not report.ok:
        raise VerificationError(str(report))
    return report


def _clone_tree(tree: Any) -> Any:
    def clone(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
        with torch.no_grad():
            out.copy_(leaf)
        return out.requires_grad_(leaf.requires_grad)

    return pytree.tree_map(clone, tree)


def _grad_holders(fn: Any) -> list[torch.Tensor]:
    return list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []


def _compare_trees(
    what: str,
    eager: Any,
    compiled: Any,
    report: Report,
    rtol: float,
    atol: float,
    check_grad: bool = False,
) -> None:
    eager_leaves, eager_spec = pytree.tree_flatten_with_path(eager)
    compiled_leaves, compiled_spec = pytree.tree_flatten(compiled)
    if eager_spec != compiled_spec:
        report.mismatches.append(f"{what}: structure {compiled_spec} != eager {eager_spec}")
        return
    for (path, e), c in zip(eager_leaves, compiled_leaves, strict=True):
        name = f"{what}{pytree.keystr(path)}"
        if not isinstance(e, torch.Tensor):
            if e != c:
                report.mismatches.append(f"{name}: {c!r} != eager {e!r}")
            continue
        report.compared_outputs += what == "output"
        _compare_tensor(name, e, c, report, rtol, atol)
        if check_grad and e.requires_grad != c.requires_grad:
            report.mismatches.append(
                f"{name}: requires_grad {c.requires_grad} != eager {e.requires_grad}"
            )


def _compare_tensor(
    name: str, e: torch.Tensor, c: Any, report: Report, rtol: float, atol: float
) -> None:
    if not isinstance(c, torch.Tensor):
        report.mismatches.append(f"{name}: got {type(c).__name__}, eager gave a tensor")
        return
    if e.shape != c.shape or e.dtype != c.dtype:
        report.mismatches.append(
            f"{name}: {c.dtype}{list(c.shape)} != eager {e.dtype}{list(e.shape)}"
        )
        return
    if e.device.type == "meta":
        return
    diff = (e.detach().double() - c.detach().double()).abs().nan_to_num(0.0)
    if diff.numel():
        report.max_abs_diff = max(report.max_abs_diff, float(diff.max()))
    try:
        torch.testing.assert_close(c.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as err:
        first = str(err).strip().splitlines()
        report.mismatches.append(f"{name}: values differ ({'; '.join(first[:3])})")


def _compare_grad(
    name: str,
    e: torch.Tensor | None,
    c: torch.Tensor | None,
    report: Report,
    rtol: float,
    atol: float,
) -> None:
    if e is None or c is None:
        if (e is None) != (c is None):
            report.mismatches.append(
                f"{name}: {'None' if c is None else 'a tensor'} != eager {'None' if e is None else 'a tensor'}"
            )
        return
    _compare_tensor(name, e, c, report, rtol, atol)


def _backward(eager: Any, compiled: Any) -> None:
    pairs = [
        (e, c)
        for e, c in zip(pytree.tree_leaves(eager), pytree.tree_leaves(compiled), strict=False)
        if isinstance(e, torch.Tensor)
        and e.requires_grad
        and e.is_floating_point()
        and isinstance(c, torch.Tensor)
        and c.requires_grad
    ]
    if not pairs:
        return
    generator = torch.Generator().manual_seed(0)
    cotangents = [
        torch.randn(e.shape, generator=generator, dtype=e.dtype).to(e.device) for e, _ in pairs
    ]
    torch.autograd.backward([e for e, _ in pairs], cotangents)
    torch.autograd.backward([c for _, c in pairs], cotangents)
