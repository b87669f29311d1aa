"""Checks that read a tensor's value on the host, kept as asserts in the graph.

Note [Host checks]
~~~~~~~~~~~~~~~~~~
Capture never reads data (Note [Capture is compiling]): Python that branches on a
tensor's value is refused (``DataDependentError``). A few reads are not branches of
the computation but validity checks, whose only other outcome is an error:

- ``torch._is_all_true(valid)`` read as a bool: ``torch.distributions``' argument
  validation (``validate_args``, on by default) and ``torch._check_tensor_all``::

      valid = constraint.check(value)              # a bool tensor
      if not torch._is_all_true(valid):            # read on the host
          raise ValueError("Expected parameter scale ... to satisfy the constraint ...")

- ``aten.equal`` inside the torch functions listed in ``_CHECKS_INSIDE``
  (``torch.istft``'s window check: ``TORCH_CHECK(!equal(lowest < 1e-11, true))``).

Capture answers such a read with the value that lets the check pass (``True``;
``False`` for istft's ``equal``) and records, where the read happened, an assert
on the real value (``aten._assert_async.msg``)::

    ge = aten.gt.Scalar(scale, 0.0);  valid = aten._is_all_true(ge)
    aten._assert_async.msg(valid, "aotgrad: a check failed ... at vae.py:12 ...")

The value is copied to the CPU first when it lives on a device (eager's read syncs
there too; an assert failing on a CUDA tensor would be a device-side assert, which
leaves the CUDA context unusable). So every call checks what eager checks, and a
call with invalid values raises a
``RuntimeError`` naming the check and the user's line, from the forward graph,
before any input is written back (eager raises ``ValueError`` for distributions,
after the writes the function made before the check). Validation is never skipped.
Only these reads are answered so: a value read anywhere else (``if x.all():``)
might choose between two computations, and stays refused.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad.errors import user_frame_from_stack

aten = torch.ops.aten

ASSERT = aten._assert_async.msg


@dataclass(frozen=True)
class _CheckInside:
    """A host read inside a torch function that is a check: its passing answer."""

    op: Any  # the op whose Python value is read (``aten.equal.default``)
    passes: bool  # the answer with which the check passes
    what: str  # what eager raises when it fails


# Torch functions whose C++ body reads a value only to check it (Note [Host checks]).
_CHECKS_INSIDE: dict[Any, _CheckInside] = {
    fn: _CheckInside(
        aten.equal.default,
        passes=False,
        what="istft's window check: eager raises RuntimeError 'window overlap add min'"
        " (the squared window, overlap-added at hop_length, is zero somewhere)",
    )
    for fn in (torch.istft, torch.Tensor.istft)
}


class _Running(threading.local):
    """The checked torch functions running now in this thread, innermost last."""

    def __init__(self) -> None:
        self.stack: list[_CheckInside] = []


_running = _Running()


def is_checked_function(func: Any) -> bool:
    """Is ``func`` one of ``_CHECKS_INSIDE`` (a dict lookup per torch function call)?"""
    return func in _CHECKS_INSIDE


@contextlib.contextmanager
def checked_function(func: Any) -> Iterator[None]:
    """Around a call of a function of ``_CHECKS_INSIDE`` during capture."""
    _running.stack.append(_CHECKS_INSIDE[func])
    try:
        yield
    finally:
        _running.stack.pop()


# Runs an op as the tracer records it (through the mode's own dispatch).
Run = Callable[..., Any]


class HostChecks:
    """Per trace: the results of ``_is_all_true``, and the answers to checks read on the host."""

    def __init__(self) -> None:
        self._all_true: dict[int, weakref.ref[torch.Tensor]] = {}

    def note(self, func: Any, out: Any) -> None:
        """Remember ``_is_all_true``'s result: a bool read of it is a check."""
        if func is aten._is_all_true.default and isinstance(out, torch.Tensor):
            self._all_true[id(out)] = weakref.ref(out)

    def _is_all_true_result(self, t: Any) -> bool:
        ref = self._all_true.get(id(t))
        return ref is not None and ref() is t

    def answer(self, func: Any, args: tuple[Any, ...], run: Run) -> bool | None:
        """The passing answer to a host read that is a check, its assert recorded with
        ``run``; None when ``func`` is no such read (Note [Host checks])."""
        if func is aten._local_scalar_dense.default and args and self._is_all_true_result(args[0]):
            what = (
                "torch._is_all_true(...) was False: a value check (torch.distributions'"
                " validate_args: a parameter or value outside the distribution's"
                " constraint or support; or torch._check_tensor_all) where eager raises"
            )
            _assert_on_host(run, args[0], _message(what))
            return True
        inside = _running.stack
        if inside and func is inside[-1].op:
            check = inside[-1]
            a, b = args[0], args[1]
            if a.shape != b.shape or a.dtype != b.dtype:
                return False  # equal() is False for these shapes on every call
            same = run(aten.all.default, run(aten.eq.Tensor, a, b))
            passed = same if check.passes else run(aten.logical_not.default, same)
            _assert_on_host(run, passed, _message(check.what))
            return check.passes
        return None


def _assert_on_host(run: Run, valid: torch.Tensor, message: str) -> None:
    """Record the check's assert, on the host as eager reads it: a device's bool is copied
    to the CPU first (Note [Host checks]: a failed assert on a CUDA tensor is a device-side
    assert, which leaves the process's CUDA context unusable; eager raises and goes on)."""
    if valid.device.type != "cpu":
        valid = run(aten._to_copy.default, valid, device=torch.device("cpu"))
    run(ASSERT, valid, message)


def _message(what: str) -> str:
    """The assert's message: what failed, the line that read it, the user's line."""
    reader = _reading_frame()
    where = user_frame_from_stack()
    same = where is not None and reader == f"{where.filename}:{where.lineno}"
    at = f" at {reader}" if reader and not same else ""
    user = f", called from {where}" if where is not None else ""
    return (
        f"aotgrad: a check failed on this call's values: {what}{at}{user}. The compiled"
        " graph checks it at every call, as eager does (Note [Host checks])."
    )


_SKIPPED = tuple(
    os.path.join(os.path.dirname(torch.__file__), d)
    for d in ("_subclasses", "utils", "fx", "_ops.py", "_tensor.py", "overrides.py", "_compile.py")
)
_AOTGRAD = os.path.dirname(os.path.dirname(__file__))


def _reading_frame() -> str | None:
    """``file:line`` of the Python code that read the value (torch's or the user's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_AOTGRAD, *_SKIPPED)) and "_dynamo" not in name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None
