"""The disk cache's folder: graph files by key, least recently used evicted past a cap.

Note [The disk cache]
~~~~~~~~~~~~~~~~~~~~~
Each entry is one graph file (Note [Files run no code]) named by its key (Note
[Disk cache keys]), holding the graphs *before* the user's compilers run: the
compilers run on every load, so a cached entry serves any compiler. Reading is
never trusted::

    entry missing                      -> a miss: trace, then write the entry
    cut short, edited, another torch or
    aotgrad, unreadable                -> a miss too, and the entry is written again
    not a regular file (a FIFO, a
    device, a symlink), not ours, huge -> a miss, without opening or reading it
                                          (Note [Who may write the cache])
    two processes write the same key   -> each writes a temporary file and renames it
                                          over the entry: both succeed, readers see one
                                          whole file or the other

A hit for ``nop`` reads only the checked line of what runs (Note [Graphs read
from a file]); the description line, unused, is then read by no one, and a bad
one costs nothing. A hit for a user's compiler reads and checks both lines, so
a bad description is a miss like the rest.

A hit touches the file's modification time; after each write, while the
directory holds more than the cap (``AOTGRAD_CACHE_SIZE_MB``, 1024 by
default), the entry used least recently is deleted. Only files aotgrad names
are counted and deleted (Note [What eviction deletes]). ``AOTGRAD_CACHE=0``
(or ``disk_cache=False`` on ``aot_function``) turns the cache off;
``AOTGRAD_CACHE_DIR`` moves it (default ``~/.cache/aotgrad``).

Note [Who may write the cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An entry decides what a compiled function computes, so the cache is read only
where no one but its owner can have written it, as ccache and pip do::

    the folder (AOTGRAD_CACHE_DIR)   created 0700; used when it is a directory owned
                                     by this user (euid) and not group- or
                                     world-writable
    each shard folder ("3f/")        created 0700; the same checks, on the folder
                                     itself: a symlink is refused, never followed
    each entry                       opened without following links and without
                                     blocking (O_NOFOLLOW | O_NONBLOCK), then read only
                                     when fstat says: a regular file, owned by this
                                     user, at most the cap's size

A folder that fails its check turns the disk cache off for the process's
calls that would use it, with one warning naming the folder and the fix:
``/tmp/shared`` of mode 0777, or owned by another user, is never read, so an
entry planted there (``x * -100`` for ``x * 2``) is never run. A shard or an
entry that fails is a miss.

Note [What eviction deletes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eviction deletes only what aotgrad wrote: entries named by their key
(``3f/3f2a...64 hex digits.aotgrad``, in the shard of their first two digits)
and the temporary files of writers (``3f/.3f2a....aotgrad.<random>.tmp``).
Everything else in the folder -- a ``model.aotgrad`` a user saved there with
``Traced.save``, a README -- is neither counted nor deleted. A temporary file
counts toward the cap, and one untouched for ``_STALE_TEMPORARY_S`` (a writer
killed mid-write) is deleted; a younger one belongs to a writer still at work
and is left alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import stat
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from aotgrad.errors import ConfigError
from aotgrad.settings import switch
from aotgrad.store.format import Read, Stored, dumps, loads, write_atomically

SUFFIX = ".aotgrad"
DEFAULT_SIZE_MB = 1024
# Temporary files untouched this long are a killed writer's (Note [What eviction deletes]).
_STALE_TEMPORARY_S = 600.0
_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"([0-9a-f]{64})\.aotgrad")
_TEMPORARY = re.compile(r"\.([0-9a-f]{64})\.aotgrad\.[A-Za-z0-9_]+\.tmp")
# Folders warned about, once each (Note [Who may write the cache]).
_warned: set[str] = set()


@dataclass(frozen=True, kw_only=True)
class DiskCache:
    """One cache directory and its size cap."""

    directory: pathlib.Path
    max_bytes: int

    def path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"{key}{SUFFIX}"

    def refused(self) -> str | None:
        """Why this directory must not be used (warned once), or None when it is this
        user's own (Note [Who may write the cache]). Creates it, 0700, when missing."""
        directory = self.directory
        try:
            if not directory.exists():
                directory.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(directory, 0o700)
            why = untrusted(os.stat(directory))
        except OSError as e:
            why = f"cannot be used ({e.strerror or e})"
        if why is None:
            return None
        reason = f"the cache folder {directory} {why}"
        if str(directory) not in _warned:
            _warned.add(str(directory))
            warnings.warn(
                f"aotgrad: {reason}, so another user could have written its entries: running"
                " without the disk cache. Use a folder only you can write: `chmod 700"
                f" {directory}` if it is yours, or set AOTGRAD_CACHE_DIR to another folder"
                " (docs/caching.md, Trust model).",
                stacklevel=2,
            )
        return reason

    def get(self, key: str, lazy: bool = False) -> Read | None:
        """The entry under ``key``; None when missing or unreadable (a miss, never an error).

        ``lazy``: read what running the graphs needs (Note [Graphs read from a file]).
        """
        data = self._read(key)
        try:
            return None if data is None else loads(data, str(self.path(key)), lazy=lazy)
        except Exception:  # StoreError, or anything a crafted file provokes: a miss
            return None

    def _read(self, key: str) -> bytes | None:
        """The bytes of the entry under ``key``, read only from a regular file of ours in a
        shard of ours (Note [Who may write the cache]); touched as recently used."""
        try:
            shard = _open_shard(self.directory / key[:2], create=False)
            try:
                return _read_entry(shard, f"{key}{SUFFIX}", self.max_bytes)
            finally:
                os.close(shard)
        except OSError:
            return None

    def put(self, key: str, stored: Stored) -> None:
        """Write the entry (atomically), then evict past the cap. Raises ``StoreError``
        when the graphs cannot be stored; I/O errors are ignored (the cache is optional)."""
        data = dumps(stored)
        with contextlib.suppress(OSError):
            os.close(_open_shard(self.directory / key[:2], create=True))
            write_atomically(self.path(key), data)
            self.evict()

    def evict(self, now: float | None = None) -> None:
        """Delete the least recently used entries until the directory fits the cap, and
        killed writers' temporary files (Note [What eviction deletes])."""
        now = time.time() if now is None else now
        entries, total = [], 0
        for path, info, temporary in _own_files(self.directory):
            if temporary and now - info.st_mtime > _STALE_TEMPORARY_S:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            total += info.st_size
            if not temporary:
                entries.append((info.st_mtime_ns, info.st_size, path))
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size


def untrusted(info: os.stat_result) -> str | None:
    """Why a folder with this ``lstat``/``stat`` may hold others' files; None when only
    this user can write it (Note [Who may write the cache])."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):#o})"
    return None


def _open_shard(shard: pathlib.Path, *, create: bool) -> int:
    """A descriptor of a shard folder that is a real directory of ours, never a link's
    target; ``create``: make it (0700) when missing. ``OSError`` otherwise."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(shard, 0o700)
    fd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    why = untrusted(os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise PermissionError(f"shard {shard} {why}")
    return fd


def _read_entry(shard: int, name: str, max_bytes: int) -> bytes | None:
    """The bytes of ``name`` in the shard, if it is a regular file of ours of at most
    ``max_bytes``; None otherwise. Never follows a link nor waits on a FIFO or a device."""
    try:
        seen = os.stat(name, dir_fd=shard, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not _own_regular_file(seen, max_bytes):
        return None  # not opened at all: a device's open may act
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=shard)
    try:
        info = os.fstat(fd)
        if not _own_regular_file(info, max_bytes):
            return None
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(info.st_size)  # at most the size checked
        with contextlib.suppress(OSError):
            os.utime(fd)  # recently used
        return data
    finally:
        os.close(fd)


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file at ``path`` (``aotgrad.load``): a FIFO, a device or a
    directory there is an ``OSError`` at once, never a read that waits or acts."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"not a regular file (mode {stat.filemode(info.st_mode)})")
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read()
    finally:
        os.close(fd)


def _own_regular_file(info: os.stat_result, max_bytes: int) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_size <= max_bytes


def _own_files(
    directory: pathlib.Path,
) -> list[tuple[pathlib.Path, os.stat_result, bool]]:
    """Every entry and temporary file aotgrad wrote in ``directory``, with its ``lstat``
    and whether it is a temporary file (Note [What eviction deletes])."""
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as shards:
        for shard in shards:
            if not (_SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                continue
            with contextlib.suppress(OSError), os.scandir(shard.path) as files:
                for file in files:
                    entry = _ENTRY.fullmatch(file.name) or _TEMPORARY.fullmatch(file.name)
                    if entry is None or not entry.group(1).startswith(shard.name):
                        continue
                    with contextlib.suppress(OSError):
                        info = file.stat(follow_symlinks=False)
                        if stat.S_ISREG(info.st_mode):
                            path = pathlib.Path(file.path)
                            found.append((path, info, file.name.endswith(".tmp")))
    return found


def disk_cache(environ: Mapping[str, str] = os.environ) -> DiskCache | None:
    """The cache the environment asks for; None when ``AOTGRAD_CACHE=0`` (Note [The disk cache]).

    >>> disk_cache({"AOTGRAD_CACHE_DIR": "/tmp/ag", "AOTGRAD_CACHE_SIZE_MB": "1"})
    DiskCache(directory=PosixPath('/tmp/ag'), max_bytes=1048576)
    >>> disk_cache({"AOTGRAD_CACHE": "0"}) is None
    True
    >>> disk_cache({"AOTGRAD_CACHE_SIZE_MB": "inf"})
    Traceback (most recent call last):
    ...
    aotgrad.errors.ConfigError: AOTGRAD_CACHE_SIZE_MB='inf' is not a size: expected a finite number of megabytes >= 0 (1024 by default; 0 keeps no entry), or AOTGRAD_CACHE=0 to turn the disk cache off
    """
    if not switch("AOTGRAD_CACHE", True, environ):
        return None
    default = pathlib.Path(environ.get("XDG_CACHE_HOME", "~/.cache")) / "aotgrad"
    directory = pathlib.Path(environ.get("AOTGRAD_CACHE_DIR") or default).expanduser()
    megabytes = cache_size_mb(environ.get("AOTGRAD_CACHE_SIZE_MB"))
    return DiskCache(directory=directory, max_bytes=int(megabytes * 2**20))


def cache_size_mb(text: str | None) -> float:
    """``AOTGRAD_CACHE_SIZE_MB``'s value: a finite number >= 0, else a ``ConfigError``."""
    if text is None or not text.strip():
        return float(DEFAULT_SIZE_MB)
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = math.nan
    if not (math.isfinite(megabytes) and 0 <= megabytes * 2**20 < 2**63):
        raise ConfigError(
            f"AOTGRAD_CACHE_SIZE_MB={text!r} is not a size: expected a finite number of"
            f" megabytes >= 0 ({DEFAULT_SIZE_MB} by default; 0 keeps no entry), or"
            " AOTGRAD_CACHE=0 to turn the disk cache off"
        )
    return megabytes
