"""Real tensors reaching ops during a trace: swap the lifted ones, refuse the dangerous rest.

Note [Real tensors in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The trace runs on fake tensors, but the function may reach real ones that are
not its arguments: closed-over tensors (Note [Closed-over tensors]). Those the
frontend found are primals of the trace; while the function (and a
checkpoint's recompute in the backward) runs, a torch-function mode replaces
each real primal, wherever it is reached from, by its traced counterpart::

    lin = nn.Linear(3, 2);  f = lambda x: lin(x).sum()
    primals: closure lin.weight, closure lin.bias, x      (real tensors)
    F.linear(x', lin.weight, lin.bias)  ->  F.linear(x', weight', bias')

so its gradient is computed and its in-place updates are input mutations; the
real tensor is never read or written by the trace. A real tensor that is not
a primal (reached some way the frontend does not walk) stays a constant, as
fake tensor mode makes it, unless it requires grad (its gradient would be
dropped) or the op mutates it (the trace would write the user's data): both
raise before the op runs.

Note [Reading .grad in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The traced primals carry no ``.grad``: an optimizer step or a gradient clip
inside the function (``if p.grad is not None: p.sub_(lr * p.grad)``) would read
None at capture and the graph would silently skip it on every call, and a
gradient present on a later call would not re-trace. So reading ``.grad`` of a
primal (an argument, a parameter, a closed-over tensor) while the function runs
is refused at that line; pass the gradient as an argument instead
(``step(p, p.grad)``).

Note [Custom Functions over closed-over tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``autograd.Function.apply`` is not a torch function: a torch-function mode
never sees its arguments, only the ops its ``forward`` runs. Without more, a
real primal handed straight to a custom Function reaches it unswapped::

    forward = lambda self, x: MyFn.apply(x, self.w)       # self.w: a real parameter
    MyFn's node:  edges (x', AccumulateGrad(real self.w))  # the trace's primal w' is not on it
    forward graph: mul(x', w')                           # the ops inside are swapped
    joint graph:   grad of param w = None                # the gradient went to the real w

(``MyFn.apply(x, self.w.t())`` worked: ``t`` is a torch function, swapped.) So
while a ``ClosedOver`` mode is on this thread's stack, ``Function.apply`` swaps
its tensor arguments as ``__torch_function__`` swaps an op's
(:func:`_swapped_apply`): the node's edges are the primals' and the backward
graph computes ``grad of param w`` through ``MyFn.backward``. The patch is
installed while any capture runs (counted, so threads and nested captures
share it); on a thread with no ``ClosedOver`` mode it calls ``apply`` unchanged.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from aotgrad._torch_compat import function_mode_count, function_modes, is_functional_tensor
from aotgrad.capture.analyses.set_storage import assigns_traced_data
from aotgrad.capture.user_state.host_checks import checked_function, is_checked_function
from aotgrad.errors import (
    DataDependentError,
    UnsupportedClosureError,
    UnsupportedMutationError,
    UnsupportedOpError,
    UserFrame,
    format_error,
    is_user_file,
    user_frame_from_stack,
)
from aotgrad.signature.subclasses import Rebuilt, rebuilt_in_trace

_REAL = (torch.Tensor, torch.nn.Parameter)
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in (
        *("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
        *("and", "or", "xor", "lshift", "rshift"),
    )
) | {"__setitem__"}


_DATA_PTR = torch.Tensor.data_ptr
_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # compare with ==
_GRAD_GET = torch.Tensor.grad.__get__  # type: ignore[union-attr]  # a new method-wrapper per access: compare with ==


class ClosedOver(TorchFunctionMode):
    """Replaces real primals by their traced values; refuses other real tensors that matter."""

    def __init__(
        self, real: Sequence[torch.Tensor], traced: Sequence[torch.Tensor], where: UserFrame | None
    ) -> None:
        super().__init__()
        self._traced: dict[int, torch.Tensor] = {}
        for r, t in zip(real, traced, strict=True):
            self._traced.setdefault(id(r), t)
        self._real = list(real)  # keeps the ids valid
        self._traced_ids = {id(t) for t in traced}
        # The types of tensor an op argument may be swapped from: plain tensors and
        # parameters, and the primals' own types (a subclass of ``nn.Parameter``).
        self._kinds: frozenset[type] = frozenset({*_REAL, *(type(r) for r in real)})
        self._where = where
        # In the backward, ops also see autograd's and functionalization's own tensors:
        # swap the primals only (Note [The swap spans the backward]).
        self._swap_only = False

    def __enter__(self) -> ClosedOver:
        _apply_patch.acquire()
        try:
            return super().__enter__()
        except BaseException:
            _apply_patch.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _apply_patch.release()

    def swap_arguments(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with each real primal among them replaced by its traced value
        (a tensor that must not reach the op is refused)."""
        rebuilt = rebuilt_in_trace()  # Note [Real subclass tensors in a trace]
        kinds = self._kinds if rebuilt is None else self._kinds | rebuilt.kinds
        if not (_has_real(args, kinds) or (kwargs and _has_real(kwargs.values(), kinds))):
            return args, kwargs
        flat, spec = pytree.tree_flatten((args, kwargs))
        flat = [
            self._swap(func, i, x, kwargs, rebuilt) if type(x) in kinds else x
            for i, x in enumerate(flat)
        ]
        return pytree.tree_unflatten(flat, spec)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Active around the autograd engine: swaps primals, refuses nothing."""
        self._swap_only = True
        try:
            with self:
                yield
        finally:
            self._swap_only = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__" and func == _GRAD_GET:
            self._check_grad_read(args[0], rebuilt_in_trace())
        elif func is _DATA_PTR and not self._swap_only and type(args[0]) not in _REAL:
            _refuse_data_ptr(sys._getframe(1).f_code.co_filename)  # the caller of data_ptr()
        args, kwargs = self.swap_arguments(func, args, kwargs)
        data_set = getattr(func, "__name__", None) == "__set__" and func == _DATA_SET
        if data_set and assigns_traced_data(*args):  # Note [set_() on an input]: t.data = x
            return None
        if is_checked_function(func):  # Note [Host checks]
            with checked_function(func):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _check_grad_read(self, t: Any, rebuilt: Rebuilt | None) -> None:
        """Refuse ``t.grad`` of a primal while the function runs (Note [Reading .grad in a trace])."""
        if self._swap_only:
            return
        primal = id(t) in self._traced or id(t) in self._traced_ids
        if not primal and (rebuilt is None or not rebuilt.holds(t)):
            return
        raise UnsupportedOpError(
            format_error(
                "the function reads .grad of one of its inputs (an argument, a parameter or a"
                " closed-over tensor): the traced tensors carry no gradient, so the graph would"
                " see None on every call",
                user_frame_from_stack() or self._where,
                "Pass the gradient as an argument (step(p, p.grad)), or read .grad outside"
                " the compiled function.",
            )
        )

    def _swap(
        self,
        func: Any,
        position: int,
        t: torch.Tensor,
        kwargs: dict[str, Any],
        rebuilt: Rebuilt | None,
    ) -> Any:
        traced = self._traced.get(id(t))
        if traced is None and rebuilt is not None:
            traced = rebuilt.traced.get(id(t))
        if traced is not None:
            return traced
        if type(t) not in _REAL or is_functional_tensor(t):
            # A subclass tensor the trace made (a rebuilt one), or functionalization's own
            # inner tensor: not a real one.
            return t
        name = getattr(func, "__name__", str(func))
        where = user_frame_from_stack() or self._where
        if self._swap_only and _mutates(name, position, t, kwargs):
            raise _backward_writes_real(name, where)
        # A property read (``.layout``, ``.shape``) neither loses a gradient nor writes.
        if self._swap_only or name == "__get__":
            return t
        if t.requires_grad:
            raise UnsupportedClosureError(
                format_error(
                    f"{name} reads a tensor that requires grad which is not an argument and"
                    " which aotgrad did not find through the function's closure, globals,"
                    " defaults or bound self (so its gradient would be lost)",
                    where,
                    "Pass the tensor as an argument, or reach it through a closed-over module"
                    " or variable (aotgrad lifts those), or aotgrad.aot_module(model).",
                )
            )
        if _mutates(name, position, t, kwargs):
            raise UnsupportedMutationError(
                format_error(
                    f"{name} mutates a tensor that is not an argument and that aotgrad did not"
                    " find through the function's closure, globals, defaults or bound self;"
                    " the capture would write the real tensor once instead of every call",
                    where,
                    "Pass the tensor as an argument (or close over it directly: aotgrad"
                    " lifts closed-over tensors and replays their mutation on each call).",
                )
            )
        return t


def _backward_writes_real(name: str, where: UserFrame | None) -> UnsupportedMutationError:
    """A real tensor no input stands for, changed while the traced backward runs (Note [State
    updated by the backward] in ``capture/analyses/backward_state.py``)."""
    return UnsupportedMutationError(
        format_error(
            f"{name} in the backward (a custom autograd.Function's backward or a hook) changes"
            " a tensor that is not an argument of the function and that aotgrad did not find"
            " through its closure, globals, defaults or bound self; the capture would write"
            " the real tensor once instead of at every backward",
            where,
            "Pass the tensor to the function as an argument (or keep it on a module compiled"
            " with aotgrad.aot_module): aotgrad then replays the backward's change on it each"
            " time the backward runs.",
        )
    )


class _ApplyPatch:
    """``autograd.Function.apply`` swapping real primals while a capture runs (Note [Custom
    Functions over closed-over tensors]); installed while at least one ``ClosedOver`` is entered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original = torch.autograd.Function.__dict__["apply"]

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                torch.autograd.Function.apply = classmethod(_swapped_apply)  # type: ignore[assignment, method-assign]
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                torch.autograd.Function.apply = self._original  # type: ignore[method-assign]

    def call(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        # A Python classmethod (torch < 2.14) or the C one (2.14+): bound to ``cls`` either way.
        return self._original.__get__(None, cls)(*args, **kwargs)


def _swapped_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    mode = _innermost_closed_over()
    if mode is not None:
        args, kwargs = mode.swap_arguments(_ApplyName(cls), args, kwargs)
    return _apply_patch.call(cls, *args, **kwargs)


class _ApplyName:
    """Stands for ``cls.apply`` where a refusal names the function it was passed to."""

    def __init__(self, cls: Any) -> None:
        self.__name__ = f"{cls.__name__}.apply"


def swapped_arguments(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with real primals swapped for their traced values, as the
    innermost ClosedOver swaps them (for an op a dispatch mode handles itself: ``set_``)."""
    mode = _innermost_closed_over()
    return (args, kwargs) if mode is None else mode.swap_arguments(func, args, kwargs)


def _innermost_closed_over() -> ClosedOver | None:
    if function_mode_count() == 0:
        return None
    modes = [m for m in function_modes() if isinstance(m, ClosedOver)]
    return modes[-1] if modes else None


_apply_patch = _ApplyPatch()


def _refuse_data_ptr(caller: str) -> None:
    """The user's code reads a traced tensor's ``data_ptr()``: the fake tensor's address would
    be baked into the graph as a constant (eager computes with the real tensor's on every
    call). Torch's own code reading it (RNN weight checks) decides nothing the graph keeps."""
    if not is_user_file(caller):
        return
    raise DataDependentError(
        format_error(
            "data_ptr() of a tensor the function computes with reads its memory address during"
            " capture; the graph would keep the traced tensor's address as a constant on every"
            " call, where eager uses the real tensor's",
            user_frame_from_stack(),
            "Read the address outside the compiled function and pass what you need as an"
            " argument, or wrap the code that needs it in a custom op (torch.library).",
        )
    )


def in_capture() -> bool:
    """Does this thread run code a capture traces: the capturing thread inside the function
    or its backward, or an autograd worker running that backward (Note [Captures and other
    threads])? Another thread calling the same code eagerly meanwhile does not."""
    return function_mode_count() > 0 and any(isinstance(m, ClosedOver) for m in function_modes())


def _has_real(values: Any, kinds: frozenset[type]) -> bool:
    """Is a tensor of ``kinds`` among ``values`` or the lists and tuples in them (op arguments)?"""
    return any(
        type(v) in kinds or (type(v) in (list, tuple) and any(type(x) in kinds for x in v))
        for v in values
    )


def _mutates(name: str, position: int, t: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Does an op named ``name`` write its argument at ``position`` (``t``)?"""
    if any(out is t for out in pytree.tree_leaves(kwargs.get("out"))):
        return True
    in_place = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
    return in_place and position == 0
