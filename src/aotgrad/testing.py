"""A differential checker: does a compiled function behave exactly like eager?

:func:`verify` runs the function eagerly and through aotgrad on two
independent copies of the same inputs, then compares everything a caller
can observe: output values, shapes, dtypes, ``requires_grad``, leafness,
which outputs alias which inputs or each other, the inputs' values and
metadata after the call, and gradients.

>>> import torch
>>> from aotgrad.testing import verify
>>> def f(x, w):
...     x.mul_(2)
...     return (x @ w).relu(), x.t()
>>> report = verify(f, torch.randn(2, 3), torch.randn(3, 4, requires_grad=True))
>>> report.ok, report.compared_outputs, report.compared_grads
(True, 2, 1)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.api import aot_function, aot_module
from aotgrad.measure import measure_peak as measure_peak  # re-exported
from aotgrad.signature import Input, InputBase, Param, leaf_names, storage_key
from aotgrad.signature.objects import objects_as_nodes


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


@dataclass
class _Call:
    """One independent copy of the user's arguments."""

    # The function called: its parameters name the inputs, as the signature's descriptors do.
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # Tensors whose ``.grad`` holds each input's gradient, by name.
    grad_holders: dict[str, torch.Tensor]

    @property
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the call, a module argument's parameters and buffers included."""
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        names = leaf_names(self.fn, self.args, self.kwargs)
        tensors = []
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, torch.Tensor):
                tensors.append((name, leaf))
            elif isinstance(leaf, torch.nn.Module):
                state = [*leaf.named_parameters(), *leaf.named_buffers()]
                tensors += [(f"{name}.{n}", t) for n, t in state]
        return tensors


def verify(
    fn: Callable[..., Any],
    *args: Any,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    check: bool = True,
    compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    create_graph: bool = False,
    **kwargs: Any,
) -> Report:
    """Run ``fn`` eagerly and through ``aot_function`` (``aot_module`` for modules) and compare.

    Inputs are copied twice, keeping their values, strides, storage sharing,
    ``requires_grad`` and leafness. Gradients are taken for seeded random
    cotangents on every differentiable output. ``compile_fn`` replaces aotgrad
    with another compiler of functions (to check PyTorch's own, say). With
    ``create_graph=True`` the gradients are taken with ``create_graph=True``
    and differentiated again: the second-order gradients of a random weighted
    sum of them, with respect to every input, parameter and cotangent, are
    compared too (docs/higher-order.md). Raises :class:`VerificationError`
    listing every mismatch unless ``check=False``.

    >>> verify(lambda x: x.sin() * x, torch.randn(3, requires_grad=True), create_graph=True).ok
    True
    """
    report = Report()
    # Modules are copied for both runs: gradients must not pile up across calls of verify.
    eager_fn = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    compiled_source = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    if compile_fn is not None:
        compiled_fn = compile_fn(compiled_source)
    elif isinstance(compiled_source, torch.nn.Module):
        compiled_fn = aot_module(compiled_source)
    else:
        compiled_fn = aot_function(compiled_source)
    eager, compiled = _copy_call(args, kwargs, fn), _copy_call(args, kwargs, fn)
    rng = torch.random.get_rng_state()  # both runs draw the same random numbers
    eager_out = eager_fn(*eager.args, **eager.kwargs)
    torch.random.set_rng_state(rng)
    compiled_out = compiled_fn(*compiled.args, **compiled.kwargs)
    # Objects holding tensors (a DynamicCache) are compared, and differentiated, by their
    # tensors (Note [Objects among the outputs]).
    eager_out, compiled_out = objects_as_nodes(eager_out), objects_as_nodes(compiled_out)
    checker = _Checker(report, rtol, atol)
    checker.outputs(eager_out, compiled_out, eager, compiled)
    checker.inputs_after_call(eager, compiled)
    eager.grad_holders.update(_parameters(eager_fn))
    compiled.grad_holders.update(_parameters(compiled_source))
    if create_graph:
        _second_order(
            checker, (eager_out, eager.grad_holders), (compiled_out, compiled.grad_holders)
        )
    else:
        _backward(eager_out, compiled_out)
        for name, holder in eager.grad_holders.items():
            if holder.requires_grad:  # else an input the function did not make require grad
                report.compared_grads += 1
                checker.grad(f"grad of {name}", holder.grad, compiled.grad_holders[name].grad)
    if check and not report.ok:
        raise VerificationError(str(report))
    return report


def _parameters(fn: Any) -> dict[str, torch.Tensor]:
    if not isinstance(fn, torch.nn.Module):
        return {}
    return {str(Param(name=n)): p for n, p in fn.named_parameters() if p.requires_grad}


def _copy_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[..., Any] = lambda *args: None
) -> _Call:
    """Copy the inputs, keeping storage sharing between them (aliasing inputs stay aliased).

    Inputs are named as the signature of a call of ``fn`` names them (``carry['a']``,
    ``model.fc.weight``); the default names them by position (``args[0]``).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    names = leaf_names(fn, args, kwargs)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            key = id(leaf) if leaf.device.type == "meta" else storage_key(leaf)
            groups.setdefault(key, []).append(i)
    copies: list[Any] = list(leaves)
    holders: dict[str, torch.Tensor] = {}
    memo: dict[int, Any] = {}  # a module passed twice stays one module
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.nn.Module):  # its own copy for each run
            copies[i] = module = copy.deepcopy(leaf, memo)
            for n, p in module.named_parameters():
                if p.requires_grad:
                    holders[f"{names[i]}.{n}"] = p
    for members in groups.values():
        originals = [leaves[i] for i in members]
        group_names = [names[i] for i in members]
        for i, new in zip(
            members, _copy_storage_group(originals, group_names, holders), strict=True
        ):
            copies[i] = new
    new_args, new_kwargs = pytree.tree_unflatten(copies, spec)
    return _Call(fn, tuple(new_args), dict(new_kwargs), holders)


def _copy_storage_group(
    originals: list[torch.Tensor], names: list[str], holders: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """Fresh tensors over one fresh storage; gradient holders registered by input name."""
    first = originals[0]
    if first.device.type == "meta":
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in originals]
    if first.layout is not torch.strided:  # sparse: no storage to share, one tensor
        new = first.detach().clone().requires_grad_(first.requires_grad)
        if first.requires_grad:
            holders[names[0]] = new
        return [new] * len(originals)
    buffer = torch.empty(
        first.untyped_storage().nbytes() // first.element_size(),
        dtype=first.dtype,
        device=first.device,
    )
    with torch.no_grad():
        buffer.untyped_storage().copy_(first.untyped_storage())
    distinct = {id(t) for t in originals}
    if len(distinct) == 1:  # one tensor (maybe passed several times): keep its leafness
        t = first
        new = torch.empty((), dtype=t.dtype, device=t.device)
        new.set_(buffer.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        # A leaf that does not require grad holds one too: the function may call
        # requires_grad_() on it.
        holders[names[0]] = new
        if t.requires_grad:
            new.requires_grad_(True)
            if not t.is_leaf:
                new = new.clone(memory_format=torch.preserve_format)
        return [new] * len(originals)
    # Several views of one storage: views of a non-leaf base, its leaf root holds the grad.
    any_grad = any(t.requires_grad for t in originals)
    base = buffer
    if any_grad:
        root = buffer.requires_grad_(True)
        holders[str(InputBase(of=tuple(Input(path=n) for n in names)))] = root
        base = root * 1
    views: dict[int, torch.Tensor] = {}
    for t in originals:
        if id(t) not in views:
            views[id(t)] = base.as_strided(t.shape, t.stride(), t.storage_offset())
    return [views[id(t)] for t in originals]


@dataclass
class _Checker:
    report: Report
    rtol: float
    atol: float

    def mismatch(self, text: str) -> None:
        self.report.mismatches.append(text)

    def outputs(self, eager: Any, compiled: Any, eager_call: _Call, compiled_call: _Call) -> None:
        eager_leaves, eager_spec = pytree.tree_flatten_with_path(eager)
        compiled_leaves, compiled_spec = pytree.tree_flatten(compiled)
        if eager_spec != compiled_spec:
            self.mismatch(f"output structure {compiled_spec} != eager {eager_spec}")
            return
        eager_aliases = _aliases([t for _, t in eager_leaves], eager_call)
        compiled_aliases = _aliases(compiled_leaves, compiled_call)
        for k, ((path, e), c) in enumerate(zip(eager_leaves, compiled_leaves, strict=True)):
            name = f"output{pytree.keystr(path)}"
            if not isinstance(e, torch.Tensor):
                if e != c:
                    self.mismatch(f"{name}: {c!r} != eager {e!r}")
                continue
            self.report.compared_outputs += 1
            if not self.tensor(name, e, c):
                continue
            self.autograd_meta(name, e, c)
            if eager_aliases[k] != compiled_aliases[k]:
                self.mismatch(f"{name}: aliases {compiled_aliases[k]} != eager {eager_aliases[k]}")
            elif eager_aliases[k] is not None and e.stride() != c.stride():
                self.mismatch(f"{name}: stride {c.stride()} != eager {e.stride()}")

    def inputs_after_call(self, eager: _Call, compiled: _Call) -> None:
        for (name, e), (_, c) in zip(eager.tensors, compiled.tensors, strict=True):
            where = f"input {name} after the call"
            if not self.tensor(where, e, c):
                continue
            if e.layout is torch.strided and (e.stride(), e.storage_offset()) != (
                c.stride(),
                c.storage_offset(),
            ):
                self.mismatch(
                    f"{where}: stride/offset {c.stride()}/{c.storage_offset()}"
                    f" != eager {e.stride()}/{e.storage_offset()}"
                )
            self.autograd_meta(where, e, c)

    def autograd_meta(self, name: str, e: torch.Tensor, c: torch.Tensor) -> None:
        if e.requires_grad != c.requires_grad:
            self.mismatch(f"{name}: requires_grad {c.requires_grad} != eager {e.requires_grad}")
        elif e.is_leaf != c.is_leaf:
            self.mismatch(f"{name}: is_leaf {c.is_leaf} != eager {e.is_leaf}")

    def tensor(self, name: str, e: torch.Tensor, c: Any) -> bool:
        """Compare type, shape, dtype and values; False if the rest is not comparable."""
        if not isinstance(c, torch.Tensor):
            self.mismatch(f"{name}: got {type(c).__name__}, eager gave a tensor")
            return False
        if e.shape != c.shape or e.dtype != c.dtype:
            self.mismatch(f"{name}: {c.dtype}{list(c.shape)} != eager {e.dtype}{list(e.shape)}")
            return False
        if e.layout != c.layout:
            self.mismatch(f"{name}: layout {c.layout} != eager {e.layout}")
            return False
        if e.device.type == "meta":
            return True
        e, c = e.detach(), c.detach()
        if e.layout is not torch.strided:
            e, c = e.to_dense(), c.to_dense()
        if e.numel() and not e.is_complex() and e.dtype != torch.bool:
            diff = (e.double() - c.double()).abs().nan_to_num(0.0)
            self.report.max_abs_diff = max(self.report.max_abs_diff, float(diff.max()))
        try:
            torch.testing.assert_close(c, e, rtol=self.rtol, atol=self.atol, equal_nan=True)
        except AssertionError as err:
            lines = [line for line in str(err).strip().splitlines() if line][:3]
            self.mismatch(f"{name}: values differ ({'; '.join(lines)})")
        return True

    def grad(self, name: str, e: torch.Tensor | None, c: torch.Tensor | None) -> None:
        if e is None or c is None:
            if (e is None) != (c is None):
                got, want = ("None" if x is None else "a tensor" for x in (c, e))
                self.mismatch(f"{name}: {got} != eager {want}")
            return
        self.tensor(name, e, c)


def _aliases(outputs: list[Any], call: _Call) -> list[tuple[str, Any, bool] | None]:
    """Per output: the input or earlier output it shares memory with, and whether it *is* it."""
    inputs = call.tensors
    seen: list[tuple[Any, int, torch.Tensor]] = []
    result: list[tuple[str, Any, bool] | None] = []
    for k, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor) or out.device.type == "meta":
            result.append(None)
            continue
        key = storage_key(out)
        alias: tuple[str, Any, bool] | None = None
        for name, t in inputs:
            if t.device.type != "meta" and storage_key(t) == key:
                alias = ("input", name, out is t)
                break
        if alias is None:
            for other_key, j, other in seen:
                if other_key == key:
                    alias = ("output", j, out is other)
                    break
        seen.append((key, k, out))
        result.append(alias)
    return result


def _backward(eager: Any, compiled: Any) -> None:
    pairs = _differentiable_pairs(eager, compiled)
    if not pairs:
        return
    cotangents = _cotangents(pairs)
    torch.autograd.backward([e for e, _ in pairs], cotangents)
    torch.autograd.backward([c for _, c in pairs], cotangents)


def _differentiable_pairs(eager: Any, compiled: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (e, c)
        for e, c in zip(pytree.tree_leaves(eager), pytree.tree_leaves(compiled), strict=False)
        if isinstance(e, torch.Tensor)
        and e.requires_grad
        and (e.is_floating_point() or e.is_complex())
        and isinstance(c, torch.Tensor)
        and c.requires_grad
    ]


def _cotangents(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(e.shape, generator=generator, dtype=e.dtype).to(e.device) for e, _ in pairs]


Run = tuple[Any, dict[str, torch.Tensor]]  # a run's result and its gradient holders by name


def _second_order(checker: _Checker, eager: Run, compiled: Run) -> None:
    """First and second-order gradients of both runs, compared (``create_graph=True``).

    The cotangents require grad, so the second-order gradients with respect to them (the
    Hessian-vector-product trick of ``torch.autograd.functional.hvp``) are compared too.
    """
    pairs = _differentiable_pairs(eager[0], compiled[0])
    names = [n for n, t in eager[1].items() if t.requires_grad]
    if not pairs or not names:
        return
    cotangents = _cotangents(pairs)
    # Per run: its first-order gradients, and what to differentiate them by.
    firsts: list[tuple[list[torch.Tensor | None], list[torch.Tensor]]] = []
    for side, run in enumerate((eager, compiled)):
        wrt = [run[1][n] for n in names]
        given = [c.clone().requires_grad_(True) for c in cotangents]
        outputs = [p[side] for p in pairs]
        grads = torch.autograd.grad(outputs, wrt, given, create_graph=True, allow_unused=True)
        firsts.append((list(grads), [*wrt, *given]))
    for name, e, c in zip(names, firsts[0][0], firsts[1][0], strict=True):
        checker.report.compared_grads += 1
        checker.grad(f"grad of {name}", e, c)
        if e is not None and c is not None:
            checker.autograd_meta(f"grad of {name}", e, c)
    generator = torch.Generator().manual_seed(1)
    weights = [
        None if g is None else torch.randn(g.shape, generator=generator, dtype=g.dtype)
        for g in firsts[0][0]
    ]
    seconds = [_weighted_grads(grads, weights, wrt) for grads, wrt in firsts]
    wrt_names = [*names, *(f"cotangent {k}" for k in range(len(cotangents)))]
    for name, e, c in zip(wrt_names, seconds[0], seconds[1], strict=True):
        checker.report.compared_grads += 1
        checker.grad(f"second-order grad of {name}", e, c)


def _weighted_grads(
    grads: list[torch.Tensor | None], weights: list[torch.Tensor | None], wrt: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    terms = [
        (w.to(g.device) * g).sum()
        for g, w in zip(grads, weights, strict=True)
        if g is not None and w is not None and g.requires_grad
    ]
    if not terms:
        return [None] * len(wrt)
    total = sum(terms[1:], start=terms[0])  # dtypes may differ: no stack
    return list(torch.autograd.grad(total, wrt, allow_unused=True))
