"""Specializations of a compiled function: hits, misses, and which guard each miss failed.

An ``AOTFunction`` keeps one compiled entry per specialization key: the
call's structure, every tensor's metadata (type, shape, stride, storage
offset, dtype, device, requires_grad, layout), every non-tensor value, the
module state's metadata, which inputs alias, train/eval flags and grad mode.
A call whose key matches an entry is a hit; otherwise aotgrad traces again
and records, for the miss, the first guard that differs from the latest entry::

    >>> import torch, aotgrad
    >>> f = aotgrad.aot_function(lambda x: x.sin())
    >>> _ = f(torch.ones(4, 8)); _ = f(torch.ones(4, 8)); _ = f(torch.ones(4, 16))
    >>> info = aotgrad.cache_info(f)
    >>> info.hits, info.misses, info.reasons[-1]
    (1, 2, 'input x: shape (4, 8) != (4, 16)')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_TENSOR_FIELDS = (
    "type",
    "shape",
    "stride",
    "storage offset",
    "dtype",
    "device",
    "requires_grad",
    "layout",
)


@dataclass
class CacheInfo:
    """What a compiled function's cache did so far."""

    hits: int = 0
    misses: int = 0
    # One reason per miss, in order: "first call", "input x: shape (4, 8) != (4, 16)", ...
    reasons: list[str] = field(default_factory=list)
    # Calls that ran eagerly because the cache was full.
    fallbacks: int = 0
    entries: int = 0

    def __str__(self) -> str:
        lines = [
            f"{self.hits} hits, {self.misses} misses, {self.entries} entries, {self.fallbacks} eager fallbacks"
        ]
        lines += [f"  miss {i}: {reason}" for i, reason in enumerate(self.reasons)]
        return "\n".join(lines)


def cache_info(fn: Any) -> CacheInfo:
    """The :class:`CacheInfo` of an ``aot_function`` or ``aot_module`` result."""
    info = getattr(getattr(fn, "compiled", fn), "info", None)
    if not isinstance(info, CacheInfo):
        raise TypeError(
            f"expected what aot_function or aot_module returned, got {type(fn).__name__}"
        )
    return info


def explain_miss(
    new: tuple[Any, ...],
    old: tuple[Any, ...] | None,
    names: Sequence[str],
    state_names: Sequence[str],
) -> str:
    """The first guard ``new`` fails against ``old``, in the user's terms."""
    if old is None:
        return "first call"
    spec, leaves, state, aliases, modes, grad = new
    old_spec, old_leaves, old_state, old_aliases, old_modes, old_grad = old
    if spec != old_spec:
        return f"argument structure changed: {spec} != {old_spec}"
    labels = [f"input {n}" for n in names] + list(state_names)
    for label, a, b in zip(labels, [*leaves, *state], [*old_leaves, *old_state], strict=False):
        if a != b:
            return f"{label}: {_leaf_difference(a, b)}"
    if aliases != old_aliases:
        return "which inputs are the same tensor or share memory changed"
    if modes != old_modes:
        return "a module switched between train() and eval()"
    if grad != old_grad:
        return f"grad mode {grad} != {old_grad}"
    return "unknown"


def _leaf_difference(new: Any, old: Any) -> str:
    if len(new) == len(old) == len(_TENSOR_FIELDS):
        for label, a, b in zip(_TENSOR_FIELDS, new, old, strict=True):
            if a != b:
                return f"{label} {_show(b)} != {_show(a)}"
    return f"value {_show(old[-1])} != {_show(new[-1])}"


def _show(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return str(tuple(value))
    if hasattr(value, "__len__") and type(value).__name__ == "Size":
        return str(tuple(value))
    return repr(value) if isinstance(value, str) else str(value)
