"""The disk cache: what ``aot_function``, ``aot_module`` and the Dynamo backend look up and write.

``api.AOTFunction`` asks a :class:`DiskCacheUse` where a miss's graphs sit on disk
(:meth:`~DiskCacheUse.slot`: the entry's key, :func:`entry_key`), loads them from there
(:meth:`~DiskCacheUse.load`) or, after tracing, writes them (:meth:`~DiskCacheUse.store`).
The file format is ``format.py``, the keys of code and values ``keys.py``, the folder
``disk.py`` (Note [The disk cache], Note [Disk cache keys], docs/caching.md).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.cache import CacheInfo, CacheKey, Entry
from aotgrad.errors import StoreError
from aotgrad.partition import Budget
from aotgrad.runtime import CompiledGraphs
from aotgrad.runtime.higher_order import Driver
from aotgrad.settings import Options, only_nop
from aotgrad.store.disk import DiskCache, disk_cache
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


class DiskCacheUse:
    """Where one compiled function's specializations sit in the disk cache.

    >>> options = Options(disk_cache=False)
    >>> use = DiskCacheUse(
    ...     fn=lambda x: x, code_key=None, input_names=None, options=options, driver=None)
    >>> info = CacheInfo()
    >>> use.slot(None, info, wrapped=False) is None, info.disk_skipped
    (True, 'disk_cache=False')
    """

    def __init__(
        self,
        *,
        fn: Callable[..., Any],
        code_key: tuple[Any, set[str]] | None,
        input_names: Sequence[str] | None,
        options: Options,
        driver: Driver,
    ) -> None:
        self._fn = fn
        # The code a trace runs, as the key holds it (Note [Disk cache keys]): given by the
        # caller (Dynamo's graph), else read from ``fn`` on the first miss.
        self._code = code_key
        self._names = list(input_names or ())
        # The options that change the graphs are in the key; the compilers run on load.
        self._options = options
        # Captures a loaded entry's create_graph backward (``differentiable_backward_driver``).
        self._driver = driver

    def slot(self, key: CacheKey, info: CacheInfo, *, wrapped: bool) -> EntryKey | None:
        """Where this miss's graphs sit on disk; None (and why, in ``info``) when not cached."""
        why: str | None
        if not self._options.disk_cache:
            why = "disk_cache=False"
        elif key.dynamic_dims is not None or wrapped:
            why = "dynamic shapes and DDP/FSDP2 wrappers are not cached on disk"
        elif key.retrace:  # Note [Environment read at capture]
            why = "a second trace under one key (the environment read changed)"
        elif (cache := disk_cache()) is None:  # a ConfigError for a bad AOTGRAD_CACHE_SIZE_MB
            why = "AOTGRAD_CACHE=0"
        else:
            why = cache.refused()  # Note [Who may write the cache]
        info.disk_skipped = why
        if why is not None or cache is None:  # (cache is read exactly when why is None)
            return None
        try:
            if self._code is None:
                self._code = code_text(self._fn)
            return entry_key(
                cache=cache,
                code=self._code,
                call=key,
                names=self._names,
                options=options_text(self._options),
            )
        except (Unkeyable, OSError) as e:
            info.disk_skipped = str(e)
            return None

    def load(self, slot: EntryKey, info: CacheInfo) -> Entry | None:
        """The entry stored at ``slot``, compiled; None (a disk miss) when absent or unreadable."""
        found = load_graphs(slot, self._options, self._driver)
        if found is None:
            info.disk_misses += 1
            return None
        info.disk_hits += 1
        compiled, positions = found
        return Entry(compiled=compiled, positions=positions)

    def store(self, slot: EntryKey, entry: Entry, *, same_key: bool, info: CacheInfo) -> None:
        """Write a traced entry at ``slot``, unless the trace changed a value its key read."""
        if not same_key:  # Note [Disk cache keys]: a value the function changes
            info.disk_skipped = "the function changes a value it reads"
            return
        if entry.replay is not None:  # Note [Side effects replayed]
            info.disk_skipped = "the function stores tensors in the user's objects"
            return
        if entry.environ is not None:  # Note [Environment read at capture]
            info.disk_skipped = f"the function read {entry.environ.what} at capture"
            return
        info.disk_skipped = store_graphs(slot, entry.compiled, entry.positions)


# Note [Reports after a disk hit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``memory_report()``, ``seq_table()`` and ``to_html()`` describe the joint graph,
# which a cache entry does not hold (it holds the forward and backward graphs).
# After a hit they read the same description a miss gives by tracing the call
# again, once, when a report is first asked for: the call is kept as its
# structure, its non-tensor leaves and each tensor's metadata (no tensor is kept
# alive), and the trace runs on new tensors of that metadata, under the hit's
# grad mode. Nothing is compiled or written. A script that prints its memory
# report prints the same text on the miss that wrote the entry and on every hit::
#
#     f(x)                       disk hit: the graphs run, no trace
#     f.memory_report()          traced once now, on a tensor like x; same text
#     f.seq_table()              the same trace, no other
#
# If the call's key then differs (a value the function reads changed, autocast
# is on now), the report is a ``CallError`` saying so, never another call's graphs.


@dataclass(frozen=True)
class _TensorLike:
    """A tensor leaf as its metadata (Note [Reports after a disk hit])."""

    parameter: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def make(self) -> torch.Tensor:
        """A new tensor of this metadata (its values unset: a trace reads none)."""
        extent = self.offset + (
            1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
            if all(self.size)
            else 0
        )
        storage = torch.empty(extent, dtype=self.dtype, device=self.device).untyped_storage()
        t = torch.empty(0, dtype=self.dtype, device=self.device)
        t.set_(storage, self.offset, self.size, self.stride)
        if self.parameter:
            return torch.nn.Parameter(t, requires_grad=self.requires_grad)
        return t.requires_grad_(self.requires_grad)


@dataclass(frozen=True, kw_only=True)
class HitCall:
    """A call a disk hit served, kept to trace again for reports (Note [Reports after a disk
    hit])."""

    spec: pytree.TreeSpec
    # Each leaf: a ``_TensorLike`` for a plain tensor or parameter, else the value itself.
    leaves: tuple[Any, ...]
    key: CacheKey
    grad_mode: bool

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: dict[str, Any], key: CacheKey) -> HitCall:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return HitCall(
            spec=spec,
            leaves=tuple(_described(leaf) for leaf in leaves),
            key=key,
            grad_mode=torch.is_grad_enabled(),
        )

    def call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments like the hit's: new tensors of its tensors' metadata."""
        leaves = [leaf.make() if isinstance(leaf, _TensorLike) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def _described(leaf: Any) -> Any:
    if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.layout != torch.strided:
        return leaf  # a value, a tensor subclass or a sparse tensor (kept as it is)
    return _TensorLike(
        parameter=type(leaf) is torch.nn.Parameter,
        size=tuple(leaf.shape),
        stride=tuple(leaf.stride()),
        offset=leaf.storage_offset(),
        dtype=leaf.dtype,
        device=leaf.device,
        requires_grad=leaf.requires_grad,
    )


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
    # A policy's code is not keyed (a dataclass's neither): no stable key.
    if not isinstance(o.partition, str | Budget):
        raise Unkeyable("a partition policy has no stable key")
    partition = o.partition if isinstance(o.partition, str) else repr(o.partition)
    keyed = (o.tracer, o.dynamic, o.keep_inference_input_mutations, o.fast, decompositions)
    # Whether the compiled forward takes its draws as inputs (and what the capture checked).
    return [partition, *keyed, o.draws_as_inputs]


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
    entry: EntryKey, options: Options, driver: Driver
) -> tuple[CompiledGraphs, tuple[int, ...] | None] | None:
    """The compiled graphs and input positions stored under ``entry``; None on a miss."""
    # A user's compiler receives fx modules: read all now, so a bad file is a miss here.
    lazy = only_nop(options)
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
        compiled = compile_stored(stored, options, driver)
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
