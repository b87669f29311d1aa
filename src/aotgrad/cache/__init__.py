"""Specializations and their keys: the compiled entries of ``aot_function`` by ``CacheKey``
(``specializations``), and the one entry a ``Traced`` keeps to (``traced``).

The disk cache, which keeps entries across processes, is ``store/persist.py``.
"""

from aotgrad.cache.specializations import (
    CacheInfo,
    CacheKey,
    Entry,
    KeyedCall,
    Miss,
    SpecializationCache,
    ambient_key,
    cache_info,
    keyed_call,
)

__all__ = [
    "CacheInfo",
    "CacheKey",
    "Entry",
    "KeyedCall",
    "Miss",
    "SpecializationCache",
    "ambient_key",
    "cache_info",
    "keyed_call",
]
