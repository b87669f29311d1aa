"""``aotgrad show FILE:FUNCTION``: print a function's graphs, descriptors, saved values and peak.

The file must define ``example_inputs()`` (or the name given by ``--inputs``)
returning ``(args, kwargs)`` for the function.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import re
import select
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from aotgrad._torch_compat import OpOverload
from aotgrad.api import Traced, aot_function, aot_module, trace
from aotgrad.errors import AotgradError, user_frame_from_traceback
from aotgrad.ops.core_aten import DECOMPOSITION_SETS
from aotgrad.partition.strategies import Budget, budget
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
        "--partition",
        metavar="STRATEGY",
        default="save_all",
        help="what the backward saves: save_all (default), mincut, 'budget(0.1)',"
        " 'budget(peak=BYTES)', or the name of a policy fx.Node -> bool in the file"
        " (Note [Options on the command line])",
    )
    show.add_argument(
        "--decompositions",
        metavar="SET",
        help="decompositions at capture: core_aten, or the name of a dict OpOverload -> function"
        " in the file",
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
        module, fn, args, kwargs = _load(options.target, options.inputs)
        partition = _partition_of(options.partition, module)
        decompositions = _decompositions_of(options.decompositions, module)
    except LoadError as e:
        print(f"aotgrad: {e}", file=sys.stderr)
        return 2
    fast, check = (False if options.no_fast else None), (True if options.check else None)
    chosen = dict(tracer=options.tracer, fast=fast, check=check)
    chosen.update(partition=partition, decompositions=decompositions)
    try:
        traced = trace(fn, *args, **chosen, **kwargs)
        if options.json:
            _emit(json.dumps(show_document(traced.partitioned), indent=1))
        elif options.html:
            _write_html(traced, options.html)
            _emit(f"wrote {options.html}")
        else:
            check_with = None if options.no_check else _compiled_as(chosen)
            return _show(traced, fn, args, kwargs, check_with)
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


def _compiled_as(chosen: dict[str, Any]) -> Any:
    """``verify``'s ``compile_fn``: the function compiled with the options ``show`` traced it
    with, so the eager check runs the graphs it printed."""

    def compile_fn(fn: Any) -> Any:
        frontend = aot_module if isinstance(fn, torch.nn.Module) else aot_function
        return frontend(fn, **chosen)

    return compile_fn


def _show(traced: Traced, fn: Any, args: Any, kwargs: Any, check_with: Any) -> int:
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
    if check_with is None:
        return 0
    _emit("=== check against eager ===")
    report = verify(fn, *args, check=False, compile_fn=check_with, **kwargs)
    _emit(str(report))
    return 0 if report.ok else 1


class LoadError(Exception):
    """The target cannot be loaded: a one-line message, no traceback."""


def _load(target: str, inputs_name: str) -> tuple[ModuleType, Any, tuple[Any, ...], dict[str, Any]]:
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
    return (module, fn, *_split_inputs(inputs, f"{path_text}:{inputs_name}()"))


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


# Note [Options on the command line]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``--partition`` and ``--decompositions`` take every value the keywords of ``trace`` take,
# spelled as text; a name stands for a value the file defines, as FUNCTION and --inputs do::
#
#     --partition save_all | mincut         the named strategies
#     --partition 'budget(0.1)'             aotgrad.budget(0.1): a fraction, or bytes when > 1
#     --partition 'budget(peak=2e6)'        aotgrad.budget(peak=2_000_000), time_limit= too
#     --partition save_matmuls              a policy fx.Node -> bool (or a Budget) in the file
#     --decompositions core_aten            a decomposition set, by name
#     --decompositions my_table             a dict OpOverload -> function in the file
#
# A budget's arguments are read as number literals (``ast.literal_eval``), never run as code,
# and go through ``aotgrad.budget``, so its checks and messages are the API's. Anything else
# is a one-line error before any capture (exit 2), naming the value and the forms above:
# ``--partition budget(-1)`` says "a budget must be positive, got -1.0".

_PARTITION_FORMS = (
    "save_all, mincut, 'budget(FRACTION or BYTES)', 'budget(peak=BYTES)', or the name of a"
    " policy (a function fx.Node -> bool) or a Budget the file defines"
)
_DECOMPOSITION_FORMS = (
    f"{', '.join(DECOMPOSITION_SETS)}, or the name of a dict from OpOverload to function the"
    " file defines"
)


def _partition_of(text: str, module: ModuleType) -> Any:
    """The ``partition=`` value ``--partition`` spells (Note [Options on the command line])."""
    if text in ("save_all", "mincut"):
        return text
    if text.lstrip().startswith(("budget(", "aotgrad.budget(")):
        return _budget_of(text)
    value = getattr(module, text, None) if text.isidentifier() else None
    if isinstance(value, Budget) or (callable(value) and not isinstance(value, type)):
        return value
    found = "" if value is None else f" (the file's {text} is of type {type(value).__name__})"
    raise LoadError(
        f"--partition {text!r} is not a partition strategy{found}: pass {_PARTITION_FORMS}"
    )


def _budget_of(text: str) -> Budget:
    """``aotgrad.budget`` called with the number literals ``text`` gives it."""
    try:
        call = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise LoadError(f"--partition {text!r}: {e.msg}; write it as 'budget(0.1)'") from e
    if not isinstance(call, ast.Call):
        raise LoadError(f"--partition {text!r}: write a budget as 'budget(0.1)'")
    values = [*call.args, *(k.value for k in call.keywords)]
    if any(k.arg is None for k in call.keywords) or not all(map(_is_number, values)):
        raise LoadError(
            f"--partition {text!r}: a budget's arguments must be numbers, as in 'budget(0.1)'"
            " or 'budget(peak=2e6)'"
        )
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
    try:
        return budget(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise LoadError(f"--partition {text!r}: {e}") from e


def _is_number(node: ast.expr) -> bool:
    """A number literal, signed or not (``0.1``, ``-1``, ``2e6``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _decompositions_of(text: str | None, module: ModuleType) -> Any:
    """The ``decompositions=`` value ``--decompositions`` spells (Note [Options on the
    command line])."""
    if text is None or text in DECOMPOSITION_SETS:
        return text
    value = getattr(module, text, None) if text.isidentifier() else None
    if isinstance(value, Mapping):
        wrong = [k for k, v in value.items() if not (_is_op(k) and callable(v))]
        if not wrong:
            return dict(value)
        raise LoadError(
            f"--decompositions {text!r}: the dict must map each OpOverload (aten.silu.default,"
            f" not aten.silu) to a function; its entry {wrong[0]!r} does not"
        )
    found = "" if value is None else f" (the file's {text} is of type {type(value).__name__})"
    raise LoadError(
        f"--decompositions {text!r} is not a decomposition set{found}: pass {_DECOMPOSITION_FORMS}"
    )


def _is_op(key: Any) -> bool:
    return isinstance(key, OpOverload)  # aten.silu.default; aten.silu would match no op


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
