"""The disk cache behind ``aot_function``, ``aot_module`` and the Dynamo backend.

The frontends call :func:`entry_key` on a miss, :func:`load_graphs` before tracing
and :func:`store_graphs` after (Note [The disk cache], Note [Disk cache keys]).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad.errors import StoreError
from aotgrad.partition import Budget
from aotgrad.pipeline import Options, compilers
from aotgrad.runtime import CompiledGraphs
from aotgrad.runtime.boxing import nop
from aotgrad.store.disk import DiskCache
from aotgrad.store.format import Stored, aotgrad_version
from aotgrad.store.keys import (
    Unkeyable,
    digest,
    function_text,
    module_code,
    source_files,
    stable_text,
)
from aotgrad.store.loaded import compile_stored


@dataclass(frozen=True, kw_only=True)
class EntryKey:
    """Where one specialization's graphs sit in the disk cache."""

    cache: DiskCache
    key: str


def code_text(fn: Any) -> tuple[Any, set[str]]:
    """The code a trace of ``fn`` runs, as stable text, and the modules it names.

    Raises :class:`Unkeyable` for a callable without a stable key (Note [Disk cache keys]).
    """
    modules: set[str] = set()
    if isinstance(fn, torch.nn.Module):
        return module_code(fn, modules), modules
    if isinstance(fn, types.FunctionType):
        return function_text(fn, modules), modules
    raise Unkeyable(f"a {type(fn).__qualname__} has no stable key (pass a function or a module)")


def options_text(options: Options) -> Any:
    """The options that change the graphs; compilers are not among them (they run on load)."""
    decompositions = options.decompositions  # a named set is keyed by its name
    if decompositions is not None and not isinstance(decompositions, str):
        raise Unkeyable("custom decompositions have no stable key")
    o = options
    if not isinstance(
        o.partition, str | Budget
    ):  # a policy's code is not keyed, even a dataclass's
        raise Unkeyable("a partition policy has no stable key")
    partition = o.partition if isinstance(o.partition, str) else repr(o.partition)
    return [
        partition,
        o.tracer,
        o.dynamic,
        o.keep_inference_input_mutations,
        o.fast,
        decompositions,
    ]


def entry_key(
    *,
    cache: DiskCache,
    code: tuple[Any, set[str]],
    call: Sequence[Any],
    names: Any,
    options: Any,
) -> EntryKey:
    """The disk entry for one call's key in ``cache``.

    Raises :class:`Unkeyable` when some part has no stable text.
    """
    text, modules = code
    called = stable_text(list(call), modules)
    parts = {
        "versions": [torch.__version__, aotgrad_version(), sys.version],
        "code": text,
        "files": source_files(sorted(modules)),
        "call": called,
        "names": names,
        "options": options,
    }
    return EntryKey(cache=cache, key=digest(parts))


def load_graphs(
    entry: EntryKey, options: Options
) -> tuple[CompiledGraphs, tuple[int, ...] | None] | None:
    """The compiled graphs and input positions stored under ``entry``; None on a miss."""
    # A user's compiler receives fx modules: read all now, so a bad file is a miss here.
    lazy = all(c is None or c is nop for c in compilers(options))
    stored = entry.cache.get(entry.key, lazy=lazy)
    if stored is None:
        return None
    positions = stored.call.get("positions")
    if positions is not None and not all(isinstance(p, int) for p in positions):
        return None
    # Anything a crafted file provokes while aotgrad compiles is a miss; a user's compiler's
    # errors are the user's to see, a bad entry a miss.
    missed: type[Exception] = Exception if lazy else StoreError
    try:
        compiled = compile_stored(stored, options)
    except missed:
        return None
    return compiled, None if positions is None else tuple(positions)


def store_graphs(
    entry: EntryKey, compiled: CompiledGraphs, positions: tuple[int, ...] | None
) -> str | None:
    """Write one specialization's graphs; the reason when they cannot be stored, else None."""
    partitioned = compiled.partitioned
    if partitioned is None:
        return "the graphs came from the disk cache"
    if partitioned.joint.inputs.subclasses is not None:
        return "tensor subclass inputs are not stored"
    call = {"positions": None if positions is None else list(positions)}
    stored = Stored(partitioned=partitioned, plan=compiled.plan, call=call)
    try:
        entry.cache.put(entry.key, stored)
    except StoreError as e:
        return str(e)
    return None
