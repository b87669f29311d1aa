"""Specializations of a compiled function: hits, misses, and which guard each miss failed.

An ``AOTFunction`` keeps one compiled entry per specialization key: the
call's structure, every tensor's metadata (type, shape, stride, storage
offset, dtype, device, requires_grad, layout), every non-tensor value, the
module state's and closed-over tensors' metadata, the values of the globals,
closure variables and module attributes the function reads (train/eval flags
included), which inputs alias, and the ambient torch state a trace bakes in
(grad mode, autocast, the default dtype: Note [Ambient state]).
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

import torch

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


# Note [Ambient state]
# ~~~~~~~~~~~~~~~~~~~~
# Some global torch state changes what the same call computes, and a trace bakes
# it in: grad mode (whether a backward is built), autocast (which ops run in
# lower precision) and the default dtype (what ``torch.ones(2)`` makes). It is
# part of every key. The common state is cheap to key: grad mode alone.
#
#     >>> ambient_key()
#     True
#     >>> with torch.autocast("cpu", dtype=torch.bfloat16):
#     ...     ambient_key()
#     (True, torch.float32, (('cpu', torch.bfloat16, True),))
#     >>> explain_ambient((True, torch.float32, (("cpu", torch.bfloat16, True),)), True)
#     'autocast cpu/bfloat16 != off'
#
# So a function first called under ``torch.autocast`` traces again when called
# outside it, instead of returning bfloat16 results where eager gives float32.
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def ambient_key() -> Any:
    """The ambient torch state a trace depends on (Note [Ambient state])."""
    grad = torch.is_grad_enabled()
    if torch.get_default_dtype() is torch.float32 and not torch._C._is_any_autocast_enabled():
        return grad
    return (grad, torch.get_default_dtype(), _autocast_state())


def _autocast_state() -> tuple[tuple[str, torch.dtype, bool], ...]:
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (device, torch.get_autocast_dtype(device), cache)
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


def explain_ambient(new: Any, old: Any) -> str:
    """Which part of the ambient state differs, in the user's terms."""
    grad, dtype, autocast = new if isinstance(new, tuple) else (new, torch.float32, ())
    old_grad, old_dtype, old_autocast = old if isinstance(old, tuple) else (old, torch.float32, ())
    if grad != old_grad:
        return f"grad mode {grad} != {old_grad}"
    if dtype != old_dtype:
        return f"default dtype {dtype} != {old_dtype}"
    return f"autocast {_show_autocast(autocast)} != {_show_autocast(old_autocast)}"


def _show_autocast(state: tuple[tuple[str, torch.dtype, bool], ...]) -> str:
    if not state:
        return "off"
    return ", ".join(f"{device}/{str(dtype).removeprefix('torch.')}" for device, dtype, _ in state)


def cache_info(fn: Any) -> CacheInfo:
    """The :class:`CacheInfo` of an ``aot_function`` or ``aot_module`` result."""
    info = getattr(getattr(fn, "compiled", fn), "info", None)
    if not isinstance(info, CacheInfo):
        raise TypeError(
            f"expected what aot_function or aot_module returned, got {type(fn).__name__}"
        )
    return info


def explain_miss(new: tuple[Any, ...], old: tuple[Any, ...] | None, names: Sequence[str]) -> str:
    """The first guard ``new`` fails against ``old``, in the user's terms.

    A key is ``(structure, leaves, state, aliases, ambient state)``; ``state`` is
    ``(input names, tensor keys, value labels, value keys)`` of the lifted
    module state, closed-over tensors and guarded values (``aotgrad/lifting.py``).
    """
    if old is None:
        return "first call"
    spec, leaves, state, aliases, grad = new
    old_spec, old_leaves, old_state, old_aliases, old_grad = old
    if spec != old_spec:
        return f"argument structure changed: {spec} != {old_spec}"
    labels = [f"input {n}" for n in names]
    for label, a, b in zip(labels, leaves, old_leaves, strict=False):
        if a != b:
            return f"{label}: {_leaf_difference(a, b)}"
    if state != old_state:
        return _state_difference(state, old_state)
    if aliases != old_aliases:
        return "which inputs are the same tensor or share memory changed"
    if grad != old_grad:
        return explain_ambient(grad, old_grad)
    return "unknown"


def _state_difference(new: tuple[Any, ...], old: tuple[Any, ...]) -> str:
    names, tensors, labels, values = new or ((), (), (), ())
    old_names, old_tensors, old_labels, old_values = old or ((), (), (), ())
    if names != old_names:
        added = [n for n in names if n not in old_names]
        removed = [n for n in old_names if n not in names]
        return f"lifted tensors changed: added {added or 'none'}, removed {removed or 'none'}"
    for name, a, b in zip(names, tensors, old_tensors, strict=True):
        if a != b:
            return f"{name}: {_leaf_difference(a, b)}"
    if labels != old_labels:
        added = [label for label in labels if label not in old_labels]
        removed = [label for label in old_labels if label not in labels]
        return f"the values the function reads changed: added {added}, removed {removed}"
    for label, a, b in zip(labels, values, old_values, strict=True):
        if a != b:
            change = f"{label}: value {show_value(b)} != {show_value(a)}"
            if label.endswith(".training"):
                return f"a module switched between train() and eval() ({change})"
            return change
    return "unknown"


def _leaf_difference(new: Any, old: Any) -> str:
    if len(new) == len(old) == len(_TENSOR_FIELDS):
        for label, a, b in zip(_TENSOR_FIELDS, new, old, strict=True):
            if a != b:
                return f"{label} {_show(b)} != {_show(a)}"
    return f"value {show_value(old)} != {show_value(new)}"


def show_value(key: Any) -> str:
    """A value key (Note [Keys of Python values]) as the value it stands for: ``-0.0``, ``True``."""
    if isinstance(key, tuple) and len(key) == 3 and key[0] == "module":  # ``module_key``
        return f"<{key[1]} object at {key[2]:#x}>"
    if isinstance(key, tuple) and len(key) == 2:
        cls, value = key
        if cls is float and isinstance(value, str):
            return repr(float.fromhex(value))
        if cls in (int, bool, str, type(None)):
            return repr(value)
    text = str(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _show(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return str(tuple(value))
    if hasattr(value, "__len__") and type(value).__name__ == "Size":
        return str(tuple(value))
    return repr(value) if isinstance(value, str) else str(value)
