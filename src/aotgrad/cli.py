"""``aotgrad show FILE:FUNCTION``: print a function's graphs, descriptors and saved values.

The file must define ``example_inputs()`` (or the name given by ``--inputs``)
returning ``(args, kwargs)`` for the function.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from aotgrad.api import trace
from aotgrad.capture import TracerChoice
from aotgrad.errors import AotgradError, user_frame_from_traceback
from aotgrad.report import show_document
from aotgrad.testing import verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aotgrad", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print forward/backward graphs and saved values")
    show.add_argument("target", help="FILE.py:FUNCTION")
    show.add_argument(
        "--inputs", default="example_inputs", help="function returning (args, kwargs)"
    )
    show.add_argument("--no-check", action="store_true", help="skip the comparison with eager")
    show.add_argument(
        "--json", action="store_true", help="print one JSON document (schema aotgrad.show/2)"
    )
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
        fn, args, kwargs = _load(options.target, options.inputs)
    except LoadError as e:
        print(f"aotgrad: {e}", file=sys.stderr)
        return 2
    try:
        if options.json:
            traced = trace(fn, *args, tracer=options.tracer, **kwargs)
            print(json.dumps(show_document(traced.partitioned), indent=1))
            return 0
        if options.html:
            trace(fn, *args, tracer=options.tracer, **kwargs).to_html(options.html)
            print(f"wrote {options.html}")
            return 0
        return _show(fn, args, kwargs, check=not options.no_check, tracer=options.tracer)
    except AotgradError as e:  # the function cannot be captured: aotgrad's message says why
        print(f"aotgrad: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the user's function raised: its line, not a traceback
        where = user_frame_from_traceback(e.__traceback__)
        location = f" at {where}" if where is not None else ""
        print(f"aotgrad: {options.target} raised {_one_line(e)}{location}", file=sys.stderr)
        return 1


def _show(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], check: bool, tracer: TracerChoice
) -> int:
    traced = trace(fn, *args, tracer=tracer, **kwargs)
    print("=== tracer ===")
    print(traced.partitioned.joint.tracer, end="\n\n")
    print("=== forward graph ===")
    print(traced.forward.code.strip(), end="\n\n")
    if traced.backward is not None:
        print("=== backward graph ===")
        print(traced.backward.code.strip(), end="\n\n")
    print("=== calling convention ===")
    print(traced.signature, end="\n\n")
    print("=== saved for backward ===")
    print(traced.memory_report(), end="\n\n")
    print("=== sequence numbers ===")
    print(traced.seq_table(), end="\n\n")
    if not check:
        return 0
    print("=== check against eager ===")
    report = verify(fn, *args, check=False, **kwargs)
    print(report)
    return 0 if report.ok else 1


class LoadError(Exception):
    """The target cannot be loaded: a one-line message, no traceback."""


def _load(target: str, inputs_name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    path_text, sep, name = target.rpartition(":")
    if not sep or not name:
        raise LoadError(f"expected FILE.py:FUNCTION, got {target!r}")
    module = _import_file(Path(path_text))
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


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise LoadError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise LoadError(f"{e.filename or path}:{e.lineno}: syntax error: {e.msg}") from e
    except Exception as e:
        raise LoadError(f"importing {path} raised {_one_line(e)}") from e
    return module


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
