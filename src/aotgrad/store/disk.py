"""The disk cache: graph files by key, in one directory, least recently used evicted past a cap.

Note [The disk cache]
~~~~~~~~~~~~~~~~~~~~~
Each entry is one graph file (Note [Files run no code]) named by its key (Note
[Disk cache keys]), holding the graphs *before* the user's compilers run: the
compilers run on every load, so a cached entry serves any compiler. Reading is
never trusted::

    entry missing                      -> a miss: trace, then write the entry
    cut short, edited, another torch or
    aotgrad, unreadable                -> a miss too, and the entry is written again
    two processes write the same key   -> each writes a temporary file and renames it
                                          over the entry: both succeed, readers see one
                                          whole file or the other

A hit for ``nop`` reads only the checked line of what runs (Note [Graphs read
from a file]); the description line, unused, is then read by no one, and a bad
one costs nothing. A hit for a user's compiler reads and checks both lines, so
a bad description is a miss like the rest.

A hit touches the file's modification time; after each write, while the
directory holds more than the cap (``AOTGRAD_CACHE_SIZE_MB``, 1024 by
default), the entry used least recently is deleted. ``AOTGRAD_CACHE=0`` (or
``disk_cache=False`` on ``aot_function``) turns the cache off;
``AOTGRAD_CACHE_DIR`` moves it (default ``~/.cache/aotgrad``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from aotgrad.store.format import Read, Stored, dumps, loads, write_atomically

SUFFIX = ".aotgrad"


@dataclass(frozen=True, kw_only=True)
class DiskCache:
    """One cache directory and its size cap."""

    directory: pathlib.Path
    max_bytes: int

    def path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str, lazy: bool = False) -> Read | None:
        """The entry under ``key``; None when missing or unreadable (a miss, never an error).

        ``lazy``: read what running the graphs needs (Note [Graphs read from a file]).
        """
        path = self.path(key)
        try:
            stored = loads(path.read_bytes(), str(path), lazy=lazy)
        except Exception:  # OSError, StoreError, or anything a crafted file provokes: a miss
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return stored

    def put(self, key: str, stored: Stored) -> None:
        """Write the entry (atomically), then evict past the cap. Raises ``StoreError``
        when the graphs cannot be stored; I/O errors are ignored (the cache is optional)."""
        data = dumps(stored)
        with contextlib.suppress(OSError):
            write_atomically(self.path(key), data)
            self.evict()

    def evict(self) -> None:
        """Delete the least recently used entries until the directory fits the cap."""
        entries = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = path.stat()
                entries.append((stat.st_mtime_ns, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size


def disk_cache(environ: Mapping[str, str] = os.environ) -> DiskCache | None:
    """The cache the environment asks for; None when ``AOTGRAD_CACHE=0`` (Note [The disk cache]).

    >>> disk_cache({"AOTGRAD_CACHE_DIR": "/tmp/ag", "AOTGRAD_CACHE_SIZE_MB": "1"})
    DiskCache(directory=PosixPath('/tmp/ag'), max_bytes=1048576)
    >>> disk_cache({"AOTGRAD_CACHE": "0"}) is None
    True
    """
    if environ.get("AOTGRAD_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    default = pathlib.Path(environ.get("XDG_CACHE_HOME", "~/.cache")) / "aotgrad"
    directory = pathlib.Path(environ.get("AOTGRAD_CACHE_DIR") or default).expanduser()
    try:
        megabytes = float(environ.get("AOTGRAD_CACHE_SIZE_MB", "1024"))
    except ValueError:
        megabytes = 1024.0
    return DiskCache(directory=directory, max_bytes=int(megabytes * 2**20))
