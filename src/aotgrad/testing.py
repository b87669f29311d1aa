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
>>> report.ok, report.compared_outputs, report.compared_grads, report.compared_inputs
(True, 2, 1, 2)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import is_traceable_wrapper_subclass
from aotgrad.api import aot_function, aot_module
from aotgrad.measure import measure_peak as measure_peak  # re-exported
from aotgrad.signature import Buffer, Input, InputBase, Param, leaf_names, storage_key
from aotgrad.signature.closures import read_environment, roots_of
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
    # Argument tensors compared after the call (a module argument's state included).
    compared_inputs: int = 0
    # Tensors reached besides the arguments (a module's state, globals', closures') compared
    # after the call (Note [What verify compares]).
    compared_reached: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        head = (
            f"{self.compared_outputs} outputs, {self.compared_grads} gradients,"
            f" {self.compared_inputs} inputs and {self.compared_reached} reached tensors"
            f" compared, max abs diff {self.max_abs_diff:.3g}"
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
    cotangents on every differentiable output, and compared for every tensor
    eager gives one: the arguments, and the parameters, buffers and tensors the
    function reaches through modules, globals, closures, defaults and bound
    ``self`` (Note [What verify compares]). ``compile_fn`` replaces aotgrad
    with another compiler of functions (to check PyTorch's own, say). With
    ``create_graph=True`` the gradients are taken with ``create_graph=True``
    and differentiated again: the second-order gradients of a random weighted
    sum of them, with respect to every input, parameter and cotangent, are
    compared too (docs/higher-order.md). Raises :class:`VerificationError`
    listing every mismatch unless ``check=False``.

    >>> verify(lambda x: x.sin() * x, torch.randn(3, requires_grad=True), create_graph=True).ok
    True
    >>> lin = torch.nn.Linear(3, 2)
    >>> print(verify(lambda x: lin(x).square().mean(), torch.randn(4, 3)))  # doctest: +ELLIPSIS
    match: 1 outputs, 2 gradients, 1 inputs and 2 reached tensors compared, ...
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
    reached = _Reached(eager_fn, compiled_source)
    eager.grad_holders.update(reached.holders(0))
    compiled.grad_holders.update(reached.holders(1))
    rng = torch.random.get_rng_state()  # both runs draw the same random numbers
    eager_run = _run(eager_fn, eager, None, create_graph)
    reached.between_runs()
    torch.random.set_rng_state(rng)
    try:
        compiled_run = _run(compiled_fn, compiled, eager_run, create_graph)
    finally:
        after = reached.after_runs()
    checker = _Checker(report, rtol, atol)
    if (eager_run.error is None) != (compiled_run.error is None):
        checker.mismatch(f"the backward raised {compiled_run.error!r} != eager {eager_run.error!r}")
    checker.outputs(eager_run.out, compiled_run.out, eager, compiled)
    checker.inputs_after_call(eager, compiled)
    for name, e, c in after:
        report.compared_reached += 1
        checker.tensor(f"{name} after the call", e, c)
    checker.grads(eager_run, compiled_run)
    if check and not report.ok:
        raise VerificationError(str(report))
    return report


# Note [What verify compares]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Everything eager produces that a caller can see: outputs (values, dtype,
# requires_grad, leafness, aliasing), the arguments after the call, and the
# gradient of every tensor eager accumulates one into. The arguments are
# copied for each run; so is a module ``fn`` (its parameters and buffers). A
# tensor the function reaches through a global, a closure, a default or a
# bound ``self`` (the roots of Note [Closed-over tensors]) is one object for
# both runs, so verify runs them one after the other around it:
#
#     lin = nn.Linear(3, 2)
#     verify(lambda x: lin(x).square().mean(), x)
#     eager run: forward + backward; keep lin.weight.grad, lin.bias.grad and the
#                values of lin's tensors; put the values and .grad back as they were
#     compiled run: forward + backward; keep the same
#     compare:   grad of global lin.weight, grad of global lin.bias, lin's
#                tensors after the call (a BatchNorm's running statistics)
#     leave:     lin as the eager run left it
#
# Each run finishes its backward before the next starts (the second-order
# gradients too, with ``create_graph=True``), so putting a value back never
# touches a tensor a pending backward has saved. The report counts what it
# compared; a gradient eager gives and the compiled function does not is a
# mismatch, and so is the reverse.


@dataclass
class _Run:
    """One run of the function: its result and the gradients it gave, by holder name."""

    out: Any
    # Per differentiable eager output (a leaf position): the cotangent it got.
    cotangents: dict[int, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    # With ``create_graph=True``: second-order gradients by name, and the weights used.
    seconds: dict[str, torch.Tensor | None] = field(default_factory=dict)
    weights: list[torch.Tensor | None] = field(default_factory=list)
    # What the backward raised (eager raises for a view taken before its base's
    # ``requires_grad_()``): compared with the other run's, no gradient then.
    error: RuntimeError | None = None


def _run(fn: Callable[..., Any], call: _Call, eager: _Run | None, create_graph: bool) -> _Run:
    """Call ``fn`` on ``call``'s copy, then differentiate it (as eager was, when given)."""
    out = objects_as_nodes(fn(*call.args, **call.kwargs))  # Note [Objects among the outputs]
    leaves = pytree.tree_leaves(out)
    if eager is None:
        cotangents = _cotangents(leaves)
        names = [n for n, t in call.grad_holders.items() if t.requires_grad]
    else:
        cotangents, names = eager.cotangents, list(eager.grads)
    targets = [
        (t, g)
        for k, g in cotangents.items()
        if k < len(leaves) and isinstance(t := leaves[k], torch.Tensor) and t.requires_grad
    ]
    wrt = [call.grad_holders[n] for n in names]
    run = _Run(
        out, cotangents, dict.fromkeys(names), weights=[] if eager is None else eager.weights
    )
    if not targets or not names:
        return run
    try:
        _differentiate(run, [t for t, _ in targets], [g for _, g in targets], wrt, create_graph)
    except RuntimeError as e:
        if eager is not None and eager.error is None:
            raise  # the compiled backward's own error (an AotgradError, say)
        run.error = e
        run.grads = dict.fromkeys(names)
    return run


def _differentiate(
    run: _Run,
    outputs: list[torch.Tensor],
    given: list[torch.Tensor],
    wrt: list[torch.Tensor],
    create_graph: bool,
) -> None:
    names = list(run.grads)
    if not create_graph:
        torch.autograd.backward(outputs, given)
        run.grads = {n: h.grad for n, h in zip(names, wrt, strict=True)}
        return
    given = [g.clone().requires_grad_(True) for g in given]
    differentiable = [h for h in wrt if h.requires_grad]  # the compiled run may differ
    computed = iter(
        torch.autograd.grad(outputs, differentiable, given, create_graph=True, allow_unused=True)
    )
    firsts = tuple(next(computed) if h.requires_grad else None for h in wrt)
    run.grads = dict(zip(names, firsts, strict=True))
    run.weights = run.weights or _weights(firsts)
    seconds = _weighted_grads(list(firsts), run.weights, [*wrt, *given])
    wrt_names = [*names, *(f"cotangent {k}" for k in range(len(given)))]
    run.seconds = dict(zip(wrt_names, seconds, strict=True))


class _Reached:
    """The tensors each run's function reaches besides its arguments, paired by name.

    A tensor both runs reach (a global's, a closure's) is one object: it is
    recorded and put back between the runs (Note [What verify compares]).
    """

    def __init__(self, eager_fn: Callable[..., Any], compiled_fn: Callable[..., Any]) -> None:
        sides = (_reached_tensors(eager_fn), _reached_tensors(compiled_fn))
        self.pairs = [(n, e, sides[1][n]) for n, e in sides[0].items() if n in sides[1]]
        self._shared = [(n, e) for n, e, c in self.pairs if e is c]
        self._before = {n: (_state(t), t.grad) for n, t in self._shared}
        for _, t in self._shared:
            t.grad = None
        self._eager: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def holders(self, side: int) -> dict[str, torch.Tensor]:
        """Tensors whose ``.grad`` the run fills (leaves requiring grad), by name."""
        return {name: pair[side] for name, *pair in self.pairs if pair[side].requires_grad}

    def between_runs(self) -> None:
        """Record the eager run's values and gradients; put the shared tensors back as before."""
        for name, t in self._shared:
            self._eager[name] = (_state(t), t.grad)
            _restore(t, self._before[name][0])
            t.grad = None

    def after_runs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Per reached tensor: its value after the eager run and after the compiled run. The
        shared ones are left as the eager run left them (their earlier ``.grad`` accumulated)."""
        after = [(n, e.detach().clone(), c.detach().clone()) for n, e, c in self.pairs]
        eager_values = {n: v for n, (v, _) in self._eager.items()}
        after = [(n, eager_values.get(n, e), c) for n, e, c in after]
        for name, t in self._shared:
            value, grad = self._eager.get(name, self._before[name])
            earlier = self._before[name][1]
            _restore(t, value)
            t.grad = grad if earlier is None or grad is None else earlier + grad
        return after


def _reached_tensors(fn: Callable[..., Any]) -> dict[str, torch.Tensor]:
    """Tensors ``fn`` reaches besides its arguments, named as the signature names them: a module
    ``fn``'s own state (``param fc.weight``), closed-over ones (``global lin.weight``)."""
    found: dict[str, torch.Tensor] = {}
    is_module = isinstance(fn, torch.nn.Module)
    if isinstance(fn, torch.nn.Module):
        found |= {str(Param(name=n)): p for n, p in fn.named_parameters()}
        found |= {str(Buffer(name=n)): b for n, b in fn.named_buffers()}
    environment = read_environment(roots_of(fn, skip_self=is_module))
    for t, descriptor in zip(environment.tensors, environment.descriptors, strict=True):
        found.setdefault(str(descriptor), t)
    return found


def _state(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s value with its strides (what :func:`_restore` puts back)."""
    with torch.no_grad():
        copy_ = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return copy_.copy_(t)


def _restore(t: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        if (t.shape, t.stride()) == (value.shape, value.stride()):
            t.copy_(value)
        else:  # the function changed its metadata (``t_()``): its old layout too
            copy_ = value.clone(memory_format=torch.preserve_format)
            t.set_(copy_.untyped_storage(), copy_.storage_offset(), copy_.shape, copy_.stride())


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


def _copy_wrappers(
    originals: list[torch.Tensor], names: list[str], holders: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """Fresh tensor-subclass wrappers (a ``TwoTensor``, a ``DTensor``): one per distinct
    original, its leafness kept, gradient holders registered by input name."""
    made: dict[int, torch.Tensor] = {}
    for t, name in zip(originals, names, strict=True):
        if id(t) in made:
            continue
        new = t.detach().clone().requires_grad_(t.requires_grad)
        holders[name] = new
        made[id(t)] = new if t.is_leaf else new.clone()
    return [made[id(t)] for t in originals]


def _copy_storage_group(
    originals: list[torch.Tensor], names: list[str], holders: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """Fresh tensors over one fresh storage; gradient holders registered by input name."""
    first = originals[0]
    if first.device.type == "meta":
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in originals]
    if is_traceable_wrapper_subclass(first):  # its storage holds no data: copy each wrapper
        return _copy_wrappers(originals, names, holders)
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
            self.report.compared_inputs += 1
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

    def grads(self, eager: _Run, compiled: _Run) -> None:
        """Every gradient eager gave (and the compiled run's for the same tensors)."""
        for name, e in eager.grads.items():
            c = compiled.grads.get(name)
            self.grad(f"grad of {name}", e, c)
            if e is not None and c is not None:
                self.autograd_meta(f"grad of {name}", e, c)
        for name, e in eager.seconds.items():
            self.grad(f"second-order grad of {name}", e, compiled.seconds.get(name))

    def grad(self, name: str, e: torch.Tensor | None, c: torch.Tensor | None) -> None:
        """Compare one gradient; counted where either run gave one (None and None agree)."""
        if e is not None or c is not None:
            self.report.compared_grads += 1
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


def _cotangents(leaves: list[Any]) -> dict[int, torch.Tensor]:
    """A seeded random cotangent per differentiable output, by leaf position."""
    generator = torch.Generator().manual_seed(0)
    return {
        k: _random_like(t, generator)
        for k, t in enumerate(leaves)
        if isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.is_floating_point() or t.is_complex())
    }


def _random_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Seeded random values of ``t``'s shape; of its subclass and layout for a wrapper (the
    cotangent eager's autograd expects of a ``TwoTensor`` output)."""
    if not is_traceable_wrapper_subclass(t):
        return torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device)
    names, context = t.__tensor_flatten__()
    inner = {n: _random_like(getattr(t, n), generator) for n in names}
    return type(t).__tensor_unflatten__(inner, context, t.shape, t.stride())


def _weights(grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    """Seeded random weights for the second-order gradients of a weighted sum of ``grads``."""
    generator = torch.Generator().manual_seed(1)
    return [
        None if g is None else torch.randn(g.shape, generator=generator, dtype=g.dtype)
        for g in grads
    ]


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
    differentiable = [t for t in wrt if t.requires_grad]
    computed = iter(torch.autograd.grad(total, differentiable, allow_unused=True))
    return [next(computed) if t.requires_grad else None for t in wrt]
