"""``aotgrad show FILE:FUNCTION``: print a function's graphs, descriptors, saved values and peak.

The file must define ``example_inputs()`` (or the name given by ``--inputs``)
returning ``(args, kwargs)`` for the function.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import select
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from aotgrad.api import Traced, trace
from aotgrad.errors import AotgradError, user_frame_from_traceback
from aotgrad.report import memory_report, peak_report, show_document
from aotgrad.testing import verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aotgrad", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "show", help="print forward/backward graphs, saved values and the predicted peak"
    )
    show.add_argument("target", help="FILE.py:FUNCTION")
    show.add_argument(
        "--inputs", default="example_inputs", help="function returning (args, kwargs)"
    )
    for flag, about in {
        "--no-check": "skip the comparison with eager",
        "--json": "print one JSON document (schema aotgrad.show/3)",
        "--no-fast": "capture with PyTorch's stock fake mode, full trace only (AOTGRAD_FAST=0)",
        "--check": "check each stage's graphs (Note [Stage checks]; AOTGRAD_CHECKS=1)",
    }.items():
        show.add_argument(flag, action="store_true", help=about)
    show.add_argument(
        "--html", metavar="OUT.html", help="write one self-contained HTML report to this file"
    )
    show.add_argument(
        "--tracer",
        choices=["auto", "direct", "full"],
        default="auto",
        help="how to capture (Note [Choosing a tracer]); default: auto",
    )
    options = parser.parse_args(argv)
    try:
        with _argv_of_a_script(options.target.rpartition(":")[0]):
            return _run(options)
    except _StdoutClosed:  # Note [A closed stdout]
        with contextlib.suppress(OSError, ValueError):  # stdout may be no real file (a test's)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return _SIGPIPE_EXIT


def _run(options: argparse.Namespace) -> int:
    try:
        fn, args, kwargs = _load(options.target, options.inputs)
    except LoadError as e:
        print(f"aotgrad: {e}", file=sys.stderr)
        return 2
    fast, check = (False if options.no_fast else None), (True if options.check else None)
    try:
        traced = trace(fn, *args, tracer=options.tracer, fast=fast, check=check, **kwargs)
        if options.json:
            _emit(json.dumps(show_document(traced.partitioned), indent=1))
        elif options.html:
            _write_html(traced, options.html)
            _emit(f"wrote {options.html}")
        else:
            return _show(traced, fn, args, kwargs, check=not options.no_check)
        return 0
    except AotgradError as e:  # the function cannot be captured: aotgrad's message says why
        print(f"aotgrad: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except _OutputFailed as e:  # aotgrad's own write failed (Note [A closed stdout])
        print(f"aotgrad: cannot write {e.where}: {e.__cause__}", file=sys.stderr)
        return 1
    except (Exception, SystemExit) as e:  # the user's function raised: its line, not a traceback
        if isinstance(e, BrokenPipeError) and _reader_gone():  # its print into a closed pipe
            raise _StdoutClosed from e
        where = user_frame_from_traceback(e.__traceback__)
        location = f" at {where}" if where is not None else ""
        print(f"aotgrad: {options.target} raised {_one_line(e)}{location}", file=sys.stderr)
        return 1


# Note [A closed stdout]
# ~~~~~~~~~~~~~~~~~~~~~~
# ``aotgrad show f.py:fn --json | head`` closes the pipe after ten lines; the next write
# raises BrokenPipeError. That is the reader's choice, not the user's function failing:
# like ``cat`` and as Python's docs on SIGPIPE recommend, aotgrad stops quietly, points
# stdout at /dev/null so the interpreter's final flush cannot raise again, and exits with
# 141 (128 + SIGPIPE), what a shell reports for a writer killed by a closed pipe. Any
# other failure of aotgrad's own writes (a full disk, ``--html`` into a missing folder)
# names what could not be written, never the user's function::
#
#     aotgrad show f.py:fn > /dev/full        aotgrad: cannot write stdout: [Errno 28] ...
#     aotgrad show f.py:fn --html no/a.html   aotgrad: cannot write no/a.html: [Errno 2] ...
#
# Only aotgrad's own writes are treated so (``_emit``, ``_write_html``), and the user's
# function printing into the closed pipe (a BrokenPipeError while stdout's reader is gone,
# which ``poll`` tells); any other OSError the function raises is reported as its error, at
# its line.


class _StdoutClosed(BaseException):
    """The reader of stdout went away (Note [A closed stdout]). Not an ``Exception``: the
    handler that reports the user's function raising must let it through."""


_SIGPIPE_EXIT = 141


def _reader_gone() -> bool:
    """Is stdout a pipe whose reader has gone (Note [A closed stdout])? ``poll`` reports an
    error on the write end of such a pipe; a file, a terminal or a live pipe reports none."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no real stdout (a test's)
        return False


class _OutputFailed(Exception):
    """One of aotgrad's own writes failed (Note [A closed stdout]); ``where`` names the file."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def _emit(text: str = "", end: str = "\n") -> None:
    """Print ``text`` to stdout and flush, turning a closed pipe into ``_StdoutClosed``."""
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError as e:
        raise _StdoutClosed from e
    except OSError as e:
        raise _OutputFailed("stdout") from e


def _write_html(traced: Traced, path: str) -> None:
    try:
        traced.to_html(path)
    except OSError as e:
        raise _OutputFailed(path) from e


def _show(traced: Traced, fn: Any, args: Any, kwargs: Any, check: bool) -> int:
    _emit("=== tracer ===")
    _emit(str(traced.partitioned.joint.tracer), end="\n\n")
    _emit("=== forward graph ===")
    _emit(traced.forward.code.strip(), end="\n\n")
    if traced.backward is not None:
        _emit("=== backward graph ===")
        _emit(traced.backward.code.strip(), end="\n\n")
    _emit("=== calling convention ===")
    _emit(str(traced.signature), end="\n\n")
    _emit("=== saved for backward ===")
    _emit(memory_report(traced.saved), end="\n\n")
    _emit("=== peak memory ===")
    _emit(peak_report(traced.partitioned), end="\n\n")
    _emit("=== sequence numbers ===")
    _emit(str(traced.seq_table()), end="\n\n")
    if not check:
        return 0
    _emit("=== check against eager ===")
    report = verify(fn, *args, check=False, **kwargs)
    _emit(str(report))
    return 0 if report.ok else 1


class LoadError(Exception):
    """The target cannot be loaded: a one-line message, no traceback."""


def _load(target: str, inputs_name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    path_text, sep, name = target.rpartition(":")
    if not sep or not name:
        raise LoadError(f"expected FILE.py:FUNCTION, got {target!r}")
    path = Path(path_text)
    module = _import_file(path)
    fn = getattr(module, name, None)
    if fn is None:
        raise LoadError(f"{path_text} defines no {name!r}")
    if not callable(fn):
        raise LoadError(
            f"{path_text}:{name} is of type {type(fn).__name__}, not a function or module to trace"
        )
    make_inputs = getattr(module, inputs_name, None)
    if make_inputs is None:
        raise LoadError(
            f"{path_text} defines no {inputs_name}(); add one returning (args, kwargs) for {name}"
        )
    try:
        inputs = make_inputs()
    except SystemExit as e:
        raise LoadError(f"{path_text}:{inputs_name}() {_exited(e)}") from e
    except Exception as e:
        raise LoadError(f"{path_text}:{inputs_name}() raised {_one_line(e)}") from e
    return (fn, *_split_inputs(inputs, f"{path_text}:{inputs_name}()"))


def _split_inputs(inputs: Any, source: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what ``example_inputs()`` returned, or a LoadError."""
    shape_ok = (
        isinstance(inputs, tuple | list)
        and len(inputs) == 2
        and isinstance(inputs[0], tuple | list)
        and isinstance(inputs[1], dict)
    )
    if not shape_ok:
        got = type(inputs).__name__
        if isinstance(inputs, tuple | list):
            got += f" of {len(inputs)}: ({', '.join(type(x).__name__ for x in inputs)})"
        raise LoadError(
            f"{source} must return (args, kwargs): a tuple or list and a dict, got a {got}"
        )
    return tuple(inputs[0]), dict(inputs[1])


# Note [Importing the user's file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aotgrad show tools/copy.py:fn`` must import the file without letting it change aotgrad
# or the interpreter it runs in:
# - under a private module name (``_aotgrad_show_copy``), never its stem: registered as
#   ``sys.modules["copy"]`` it replaced the standard library's ``copy`` for aotgrad and torch;
# - its folder is appended to ``sys.path``, not put first, so that its sibling modules import
#   but a sibling ``typing.py`` cannot shadow the standard library;
# - with ``sys.argv == [FILE]`` while its code runs (import, inputs, capture, check), as
#   ``python FILE`` would give it: an ``argparse`` at import sees no aotgrad options (it
#   printed its own usage and exited);
# - a ``sys.exit`` at import (a script without an ``if __name__ == "__main__":`` guard) is
#   a LoadError naming the file, the line and the exit code; ``show`` exits 2, never 0 with
#   nothing printed. ``__name__`` is the private name, so such a guard keeps the script's
#   main part from running.


@contextlib.contextmanager
def _argv_of_a_script(path: str) -> Iterator[None]:
    """``sys.argv`` as ``python FILE`` gives it, while the file's code runs."""
    saved = sys.argv
    sys.argv = [path]
    try:
        yield
    finally:
        sys.argv = saved


def _exited(e: SystemExit) -> str:
    where = user_frame_from_traceback(e.__traceback__)
    location = f" at {where.filename}:{where.lineno}" if where is not None else ""
    code = "None (0)" if e.code is None else repr(e.code)
    return (
        f"called sys.exit({code}){location}: a file for `aotgrad show` must not exit while it"
        ' is imported; put the script\'s own main part under `if __name__ == "__main__":`'
    )


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise LoadError(f"no such file: {path}")
    name = "_aotgrad_show_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise LoadError(f"{e.filename or path}:{e.lineno}: syntax error: {e.msg}") from e
    except SystemExit as e:
        del sys.modules[name]
        raise LoadError(f"importing {path} {_exited(e)}") from e
    except Exception as e:
        del sys.modules[name]
        raise LoadError(f"importing {path} raised {_one_line(e)}") from e
    return module


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
