"""aotgrad's errors: each says what went wrong, where in the user's code, and what to do.

Every error aotgrad raises on purpose derives from :class:`AotgradError`, so
callers can catch them all at once. Messages follow one shape::

    <what went wrong>
      at <user file>:<line>: <source line>
    <what to do instead>
"""

from __future__ import annotations

import enum
import functools
import linecache
import os
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType

import torch

_AOTGRAD_DIR = os.path.dirname(__file__)
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__))  # torch, stdlib
_INTERACTIVE = ("<stdin>", "<console>")


class AotgradError(Exception):
    """Base class of every error aotgrad raises on purpose."""


class CaptureError(AotgradError):
    """The function cannot be captured faithfully as a graph."""


class DataDependentError(CaptureError):
    """Python code read a tensor's value (``.item()``, ``bool(t)``, ``if t > 0``)."""


class UnsupportedOpError(CaptureError):
    """The function calls an op aotgrad cannot put in a functional graph."""


class UnsupportedOutputError(CaptureError):
    """The function returned something that is not a tensor, a scalar or a pytree of them."""


class UnsupportedMutationError(CaptureError):
    """The function mutates an input in a way aotgrad does not support yet."""


class UnsupportedClosureError(CaptureError):
    """The function reaches a tensor aotgrad can neither lift as an input nor bake in."""


class UnsupportedSideEffectError(CaptureError):
    """The function stores a traced tensor in the user's objects in a way aotgrad cannot
    store again at every call (Note [Side effects replayed])."""


class UnsupportedSubclassError(CaptureError, TypeError):
    """A tensor subclass aotgrad cannot take apart (Note [Tensor subclasses])."""


class DirectTraceError(CaptureError):
    """``tracer="direct"`` met what only the full trace handles (Note [Choosing a tracer])."""


class OpError(CaptureError, RuntimeError):
    """An op raised while the function was captured (a shape mismatch in ``x @ w``, a bad
    ``view``); the message says "eager raises the same" where that was checked (Note
    [Checking that eager raises the same]). It names the op and the user's line; the
    original exception is the ``__cause__``. Also an instance of the original's type, and
    a ``RuntimeError`` (torch's Python refs raise ``ValueError`` where eager's kernels raise
    ``RuntimeError``)."""


class OpRuntimeError(OpError):
    """:class:`OpError` for a ``RuntimeError``."""


class OpValueError(OpError, ValueError):
    """:class:`OpError` for a ``ValueError``."""


class OpTypeError(OpError, TypeError):
    """:class:`OpError` for a ``TypeError``."""


class OpIndexError(OpError, IndexError):
    """:class:`OpError` for an ``IndexError``."""


class InPlaceOnLeafError(CaptureError, RuntimeError):
    """An in-place op on a leaf that requires grad: eager refuses it, and so does aotgrad."""


class CollectiveGradError(CaptureError, RuntimeError):
    """A gradient flows through a collective torch has no gradient formula for
    (Note [Collectives] in ``capture/analyses/collectives.py``)."""


class CollectiveMismatchError(CaptureError, RuntimeError):
    """The ranks would run different collectives: another op, group, reduction or shape, or
    another order (Note [Collectives] in ``capture/analyses/collectives.py``)."""


class DoubleBackwardError(AotgradError, RuntimeError):
    """A second derivative was asked through a compiled function (``create_graph=True``)."""


class SavedVersionError(AotgradError, RuntimeError):
    """An input the backward reads was changed in place after eager would have saved it, as
    eager's "modified by an inplace operation" (Note [State updated by the backward])."""


class TransformError(AotgradError, RuntimeError):
    """Compiled graphs reached under a ``torch.func`` transform or forward-mode AD, where
    no function is at hand to run instead (Note [Transforms run the function])."""


class AutocastBackwardError(AotgradError, RuntimeError):
    """A backward called under autocast, whose graph holds ops autocast would cast (Note [Autocast])."""


class CallError(AotgradError, TypeError):
    """A compiled function was called with arguments it cannot accept."""


class StoreError(AotgradError, ValueError):
    """A graph file or cache entry aotgrad cannot write or read (Note [Files run no code])."""


class PartitionError(AotgradError, ValueError):
    """A partition cannot be made as asked: an unknown strategy, a budget no plan fits, a
    policy that raised or answered something other than ``True`` (save) or ``False``
    (recompute) (Note [Partition policies])."""


class ConfigError(AotgradError, ValueError):
    """An option holds a value aotgrad does not accept (an ``AOTGRAD_*`` environment
    variable, an argument of ``aotgrad.budget``); the message names it and the values it
    takes."""


class UnsupportedWrapperError(AotgradError, ValueError):
    """A DDP or FSDP2 configuration aotgrad cannot run around its graphs (Note [Wrappers run
    around the graphs]): the message says what to use instead."""


class InvariantError(AotgradError, AssertionError):
    """A stage's artifact breaks an invariant the next stage relies on (Note [Stage checks]):
    an aotgrad bug. ``stage``, ``node`` and ``invariant`` say which, where and what."""

    def __init__(self, stage: str, node: str, invariant: str, expected: str, got: str) -> None:
        self.stage, self.node, self.invariant = stage, node, invariant
        super().__init__(
            f"aotgrad check after {stage}: {node}: {invariant}: expected {expected}, got {got}."
            " This is an aotgrad bug (Note [Stage checks]); please report it with the function"
            " that made it"
        )


class BackendError(AotgradError, RuntimeError):
    """A backend (ONNX Runtime, IREE: ``aotgrad.backends``) could not take or run an exported
    program; the message names the backend, the program and the op it refused."""


class ScanError(AotgradError, ValueError):
    """A scan's body or arguments break its rules: a carry that changes shape, dtype or
    structure, ``xs`` leaves of different lengths, a body that mutates its inputs."""


@dataclass(frozen=True)
class UserFrame:
    """A location in the user's source: file, line and the code on that line."""

    filename: str
    lineno: int
    name: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.name}: {self.line}"


class Origin(enum.Enum):
    """Whose code a frame runs (Note [User frames])."""

    USER = "user"
    AOTGRAD = "aotgrad"
    LIBRARY = "library"  # torch, the standard library, generated code


# Note [User frames]
# ~~~~~~~~~~~~~~~~~~
# Errors point at the user's line, and provenance records it for every op:
# both walk the stack to the innermost frame that is neither torch's, nor the
# standard library's, nor aotgrad's. One rule decides, by file name: code under
# torch's directory (a prefix: ``torchvision`` counts too) or the standard
# library's is a library's; so is code without a file (``<string>``, fx's
# ``<eval_with_key>.3``, ``<frozen runpy>``), except what the user typed at a
# prompt::
#
#     /home/me/model.py                         user
#     <stdin>                                   user
#     .../site-packages/torch/nn/functional.py  library
#     .../lib/python3.11/contextlib.py          library
#     <eval_with_key>.3                         library
#     .../aotgrad/capture/tracing/joint.py      aotgrad
#
# Walks differ only in what they do on aotgrad's frames: an error skips them,
# provenance stops there (aotgrad itself issued the op; ``capture/tracing/recorder.py``).


@functools.cache
def frame_origin(filename: str) -> Origin:
    """Whose code the file ``filename`` is (Note [User frames]).

    >>> [frame_origin(f).value for f in ("/home/me/model.py", os.__file__, "<string>", "<stdin>")]
    ['user', 'library', 'library', 'user']
    >>> frame_origin(__file__).value
    'aotgrad'
    """
    if filename.startswith("<"):
        return Origin.USER if filename in _INTERACTIVE else Origin.LIBRARY
    path = os.path.abspath(filename)
    if path.startswith(_AOTGRAD_DIR):
        return Origin.AOTGRAD
    return Origin.LIBRARY if path.startswith(_LIBRARY_DIRS) else Origin.USER


def is_user_file(filename: str) -> bool:
    """Is ``filename`` the user's code (Note [User frames])?"""
    return frame_origin(filename) is Origin.USER


def user_frame_from_traceback(tb: TracebackType | None) -> UserFrame | None:
    """The innermost frame of ``tb`` that is the user's code (not torch's, not aotgrad's)."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            line = linecache.getline(filename, lineno).strip()
            found = UserFrame(filename, lineno, frame.f_code.co_name, line)
    return found


def user_frame_from_stack() -> UserFrame | None:
    """The innermost frame of the current call stack that is the user's code."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            line = linecache.getline(filename, frame.f_lineno).strip()
            return UserFrame(filename, frame.f_lineno, frame.f_code.co_name, line)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def user_frame_of_function(fn: object) -> UserFrame | None:
    """Where ``fn`` is defined, when Python can tell."""
    code = getattr(getattr(fn, "forward", fn), "__code__", None)
    if code is None:
        return None
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return UserFrame(code.co_filename, code.co_firstlineno, code.co_name, line)


def format_error(what: str, where: UserFrame | None, todo: str) -> str:
    """The one message shape every aotgrad error uses."""
    location = f"\n  at {where}" if where is not None else ""
    return f"{what}{location}\n{todo}"
