"""The environment variables the user's code reads while a capture runs.

Note [Environment read at capture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A function that reads an environment variable at capture bakes what it read
into the graph, like a Python branch on any other value::

    def f(x):
        if os.environ.get("ACT") == "gelu":
            return F.gelu(x)
        return torch.relu(x)

    ACT=relu: f's graph holds relu. Later calls, or another process, under ACT=gelu
    must not get that graph: eager runs gelu there.

So while a capture runs, reads of the environment through ``os.environ`` (any
reference to it, ``from os import environ`` included), ``os.getenv``,
``environ.get``, ``"X" in environ`` and ``os.environb`` are recorded with the
value each read saw (None: unset). Iterating it, ``len``, ``copy()``, ``items()``,
``dict(os.environ)``, ``==`` or ``repr`` read the whole environment: all of it is
recorded. The methods of ``os._Environ`` (the class of both mappings) are
replaced for the capture and put back after, even on error; every read and
write still goes to the real mapping. Only reads that count are recorded:

- by the capturing thread, or an autograd worker running the capture's
  backward (``in_capture``: Note [Captures and other threads]). Another thread
  reading meanwhile reads as always and records nothing;
- on behalf of the user's code: the first caller outside the Python standard
  library (which ``os.getenv``, ``get``, ``in``, ``os.path.expandvars`` pass
  through) is not torch or aotgrad. torch's own ``TORCH_*`` lookups, and the
  standard library's on torch's behalf (``HOME`` in ``expanduser`` for
  ``torch.hub.get_dir()``), do not change the graph the user's code asks for;
  ``os.path.expandvars("$ACT")`` in the function does, and a third-party
  library the function calls is the user's code;
- not inside a module import that torch or aotgrad started. A process's first
  capture is where PyTorch's fake tensors import Dynamo (Note [What loads
  Dynamo]), and with it sympy, whose module bodies read ``SYMPY_USE_CACHE`` and
  twenty more: a library's import-time state, read once per process as any
  import is, not the function's. The import's starter decides, the caller of
  the outermost import on the stack::

      f calls x.sin() -> FakeTensorMode() -> import torch._dynamo -> ... -> import sympy
          -> sympy reads SYMPY_USE_CACHE      starter: torch's fake_tensor.py: not counted
      f runs `import mylib` -> mylib reads ACT   starter: f: counted

The capture's :class:`JointGraph` carries the reads (``environ``), and:

- the in-memory entry guards on them: a call where any of them differs misses
  and traces again, and ``cache_info`` says ``environment variable ACT: 'relu'
  != 'gelu'``. Entries that read nothing check nothing (Note [The last entry]
  is kept for them; an entry that read the environment never becomes it);
- such an entry is not written to the disk cache (``disk_skipped``: "the
  function read environment variables ACT at capture"): the disk key is made
  before the trace, which alone finds the reads, so a key cannot hold them. An
  entry the disk serves was traced reading nothing, and no environment can
  change it;
- a :class:`aotgrad.Traced` raises ``CallError`` when called under another
  value (it never traces again), and ``save`` refuses it (``StoreError``): a
  file cannot tell its reader which environment it assumes;
- a scan's body traces again, as an entry does.

Not seen: C code reading ``getenv`` itself (``posix.environ``, a C
extension), and values read before the capture (at import, or by the caller):
those are the caller's state, read as a global the function's key holds or not.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from aotgrad.capture.user_state.closed_over import in_capture


@dataclass(frozen=True)
class EnvironReads:
    """What the user's code read of the environment during one capture (Note [Environment read at capture])."""

    # Each variable read, with the value the first read saw (None: unset), by name.
    values: tuple[tuple[str, str | None], ...]
    # The whole environment, when the code read all of it (iterated, copied); else None.
    whole: tuple[tuple[str, str], ...] | None = None

    @property
    def what(self) -> str:
        """What was read, for messages: ``environment variables ACT, MODE`` or ``the whole
        environment``."""
        if self.whole is not None:
            return "the whole environment"
        return "environment variables " + ", ".join(name for name, _ in self.values)

    def changed(self) -> str | None:
        """How the environment now differs from what was read; None when it does not."""
        now = dict(os.environ)
        read = list(self.values)
        if self.whole is not None:  # every variable, then each one read
            whole = dict(self.whole)
            read = [(name, whole.get(name)) for name in sorted(whole.keys() | now.keys())] + read
        for name, value in read:
            if now.get(name) != value:
                before, after = ("unset" if v is None else repr(v) for v in (value, now.get(name)))
                return f"environment variable {name}: {before} != {after}"
        return None


class _Recording:
    """One capture's reads, while it runs."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.values: dict[str, str | None] = {}
        self.whole: dict[str, str] | None = None

    def reads(self) -> EnvironReads | None:
        if not self.values and self.whole is None:
            return None
        whole = None if self.whole is None else tuple(sorted(self.whole.items()))
        return EnvironReads(values=tuple(sorted(self.values.items())), whole=whole)


_Environ = type(os.environ)
_GETITEM = _Environ.__getitem__
_ITER = _Environ.__iter__
# The methods of ``os.environ`` a recording replaces, as they were.
_ORIGINALS = {
    name: vars(_Environ)[name] for name in ("__getitem__", "__iter__", "__len__", "__repr__")
}
# The recordings of the captures running now, outermost first: captures take turns
# (Note [Capture sessions]), so only nested ones (a scan body, an inner compiled
# function traced through) stack up, in one thread. Replaced whole, never mutated.
_ACTIVE: tuple[_Recording, ...] = ()
_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def recording_environ() -> Iterator[_Recording]:
    """Record the user's code's reads of the environment while inside (Note [Environment
    read at capture]); ``reads()`` of the result gives them. Nested: both record."""
    global _ACTIVE
    recording = _Recording()
    with _INSTALL_LOCK:
        if not _ACTIVE:
            _set(_PATCHED)
        _ACTIVE = (*_ACTIVE, recording)
    try:
        yield recording
    finally:
        with _INSTALL_LOCK:
            _ACTIVE = tuple(r for r in _ACTIVE if r is not recording)
            if not _ACTIVE:
                _set(_ORIGINALS)


def _set(methods: dict[str, Any]) -> None:
    for name, method in methods.items():
        setattr(_Environ, name, method)


def _getitem(self: Any, key: Any) -> Any:
    try:
        value = _GETITEM(self, key)
    except KeyError:
        _note_one(key, None)
        raise
    _note_one(key, value)
    return value


def _reading_whole(original: Any) -> Any:
    """``original`` (``__iter__``, ``__len__``, ``__repr__``), noted as a read of it all."""

    def read(self: Any) -> Any:
        _note_whole()
        return original(self)

    return read


_PATCHED = {
    "__getitem__": _getitem,
    **{name: _reading_whole(_ORIGINALS[name]) for name in ("__iter__", "__len__", "__repr__")},
}


def _note_one(key: Any, value: Any) -> None:
    recordings = _recordings(sys._getframe(2))
    if not recordings:
        return
    name = os.fsdecode(key) if isinstance(key, bytes | str) else str(key)
    seen = os.fsdecode(value) if isinstance(value, bytes | str) else None
    for recording in recordings:
        recording.values.setdefault(name, seen)


def _note_whole() -> None:
    recordings = _recordings(sys._getframe(2))
    if not recordings:
        return
    environ = os.environ
    whole = {name: _GETITEM(environ, name) for name in _ITER(environ)}
    for recording in recordings:
        if recording.whole is None:
            recording.whole = whole


def _recordings(caller: FrameType | None) -> tuple[_Recording, ...]:
    """The recordings a read from ``caller`` counts for: none unless this thread captures
    and the caller is the user's code."""
    recordings = _ACTIVE
    if not recordings:
        return ()
    if threading.get_ident() != recordings[0].thread and not in_capture():
        return ()
    while caller is not None and _is_stdlib(caller.f_code.co_filename):
        caller = caller.f_back  # ``os.getenv``, ``Mapping.get``: who called them counts
    if caller is None or _is_torch(caller.f_code.co_filename) or _imported_by_torch(caller):
        return ()
    return recordings


def _imported_by_torch(frame: FrameType | None) -> bool:
    """Does ``frame`` run inside a module import that torch or aotgrad started? The starter
    is the caller of the outermost import on the stack (Note [Environment read at capture])."""
    starter, importing = None, False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen importlib"):
            importing = True
        elif importing and not _is_stdlib(filename):  # ``importlib.import_module``'s caller
            starter, importing = frame, False
        frame = frame.f_back
    return starter is not None and _is_torch(starter.f_code.co_filename)


def _folder(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


@functools.cache
def _folders() -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """torch's and aotgrad's folders, the standard library's, and where packages install
    (found on the first read a capture sees: ``import aotgrad`` stays fast)."""
    import sysconfig

    paths = sysconfig.get_paths()
    ours = (
        _folder(os.path.dirname(torch.__file__)),
        _folder(os.path.dirname(os.path.dirname(__file__))),  # aotgrad
    )
    installed = tuple(_folder(paths[key]) for key in ("purelib", "platlib"))
    installed += tuple(
        _folder(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))
    )
    return ours, _folder(paths["stdlib"]), installed


@functools.lru_cache(maxsize=4096)
def _is_stdlib(filename: str) -> bool:
    """Is code in ``filename`` the Python standard library's (``os``, ``collections.abc``)?"""
    if filename.startswith("<frozen "):  # its frozen modules: ``<frozen os>``
        return True
    _, stdlib, installed = _folders()
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return path.startswith(stdlib) and not path.startswith(installed)


@functools.lru_cache(maxsize=4096)
def _is_torch(filename: str) -> bool:
    """Is code in ``filename`` torch's or aotgrad's?"""
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return path.startswith(_folders()[0])
