"""Graphs in files: the graph file format (``format``) and the disk cache built on it (``persist``).

See ``docs/caching.md`` and Note [Files run no code].
"""

from aotgrad.store.format import Read, Stored, dumps, loads

__all__ = ["Read", "Stored", "dumps", "loads"]
