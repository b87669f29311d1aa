"""The disk cache as the frontends use it: one ``AOTFunction``'s lookups and writes.

``api.AOTFunction`` asks a :class:`DiskCacheUse` where a miss's graphs sit on disk
(:meth:`~DiskCacheUse.slot`), loads them from there (:meth:`~DiskCacheUse.load`)
or, after tracing, writes them (:meth:`~DiskCacheUse.store`). The file format, the
keys and the directory live in ``store/`` (Note [The disk cache], Note [Disk cache
keys], docs/caching.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.cache import CacheInfo, CacheKey, Entry
from aotgrad.pipeline import Options
from aotgrad.store.disk import disk_cache
from aotgrad.store.keys import Unkeyable
from aotgrad.store.persist import (
    EntryKey,
    code_text,
    entry_key,
    load_graphs,
    options_text,
    store_graphs,
)


class DiskCacheUse:
    """Where one compiled function's specializations sit in the disk cache.

    >>> use = DiskCacheUse(
    ...     fn=lambda x: x, code_key=None, input_names=None, options=Options(disk_cache=False))
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
    ) -> None:
        self._fn = fn
        # The code a trace runs, as the key holds it (Note [Disk cache keys]): given by the
        # caller (Dynamo's graph), else read from ``fn`` on the first miss.
        self._code = code_key
        self._names = list(input_names or ())
        # The options that change the graphs are in the key; the compilers run on load.
        self._options = options

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
        found = load_graphs(slot, self._options)
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
