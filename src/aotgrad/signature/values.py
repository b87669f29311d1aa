"""Keys for the Python values a trace specializes on: by value, never by ``repr`` or identity.

Note [Keys of Python values]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A non-tensor argument, global, closure variable or module attribute is baked
into the graph, so its cache key must change exactly when the graph would.
Keys compare by value and carry the type, so values Python calls equal but a
graph tells apart get different entries::

    0.0, -0.0            (float, '0x0.0p+0'), (float, '-0x0.0p+0')   1/x differs
    1, True, 1.0         (int, 1), (bool, True), (float, '0x1.0000000000000p+0')
    nan                  (float, 'nan'): equal to itself, so nan hits its entry
    Cfg(scale=2.0)       (Cfg, (('scale', (float, '0x1.0000000000000p+1')),))
    torch.sin, nn.ReLU   themselves (a function or class is its own value)

A plain object is keyed by its attributes, recursively, so ``cfg.scale = 3.0``
after a call re-traces. A tensor inside a value that is not a pytree container
cannot be a graph input and would be baked in as a constant: :func:`value_key`
raises :class:`TensorInValue` naming where it sits, and the caller refuses (an
argument) or lifts it (a closed-over object; Note [Closed-over tensors]).
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from typing import Any

import torch

_PLAIN = (int, bool, str, bytes, type(None))
_ITSELF = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.ModuleType,
    type,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    type(Ellipsis),
    range,
)
_MAX_DEPTH = 8


class TensorInValue(Exception):
    """A tensor inside a non-pytree value; ``path`` says where (``.cache['k']``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class Incomparable(Exception):
    """A value aotgrad cannot compare by value (neither plain data nor an object with fields)."""


def value_key(value: Any) -> Any:
    """The cache key of a non-tensor value (Note [Keys of Python values]).

    >>> value_key(0.0) == value_key(-0.0), value_key(1) == value_key(True)
    (False, False)
    >>> value_key(float("nan")) == value_key(float("nan"))
    True
    """
    cls = type(value)
    if cls is float:
        return (float, value.hex())
    if cls in _PLAIN:
        return (cls, value)
    if cls is tuple:  # ``normalized_shape=(256,)``: read every call (Note [Reading a module, fast])
        key = _flat_tuple_key(value)
        if key is not None:
            return key
    return _key(value, "", 0, set())


def _flat_tuple_key(value: tuple[Any, ...]) -> Any:
    """``_key(value, ...)`` of a tuple of plain values and floats, without its recursion; None
    for any other tuple. ``(256, 1e-5)`` -> ``(tuple, ((int, 256), (float, '0x1.4f8b...p-17')))``.
    """
    parts = []
    for v in value:
        cls = type(v)
        if cls is float:
            parts.append((float, v.hex()))
        elif cls in _PLAIN:
            parts.append((cls, v))
        else:
            return None
    return (tuple, tuple(parts))


def _key(value: Any, path: str, depth: int, active: set[int]) -> Any:
    cls = type(value)
    if cls is float:
        return (float, value.hex())
    if cls in _PLAIN or isinstance(value, _ITSELF):
        return (cls, value)
    if isinstance(value, torch.Tensor | torch.nn.Module):  # a module holds parameters:
        raise TensorInValue(path)  # lift it, never bake it
    if depth > _MAX_DEPTH or id(value) in active:
        return (cls, "cycle", id(value))
    active.add(id(value))
    try:
        return (cls, _fields(value, path, depth + 1, active))
    finally:
        active.discard(id(value))


def _fields(value: Any, path: str, depth: int, active: set[int]) -> Any:
    if isinstance(value, float):  # a float subclass (numpy.float64)
        return float(value).hex()
    if isinstance(value, complex):
        return (value.real.hex(), value.imag.hex())
    if isinstance(value, int | str | bytes):
        return value
    if isinstance(value, tuple | list):
        return tuple(_key(v, f"{path}[{i}]", depth, active) for i, v in enumerate(value))
    if isinstance(value, dict):
        return tuple(
            (_key(k, path, depth, active), _key(v, f"{path}[{k!r}]", depth, active))
            for k, v in value.items()
        )
    if isinstance(value, set | frozenset):
        return frozenset(_key(v, path, depth, active) for v in value)
    if isinstance(value, slice):  # unhashable before Python 3.12
        return tuple(_key(v, path, depth, active) for v in (value.start, value.stop, value.step))
    if isinstance(value, functools.partial):
        parts = (value.func, value.args, value.keywords)
        return _key(parts, path, depth, active)
    if isinstance(value, types.MethodType):
        return (value.__func__, _key(value.__self__, path, depth, active))
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):  # an array: by bytes
        return (str(value.dtype), tuple(getattr(value, "shape", ())), value.tobytes())
    state = _state(value)
    if state is not None:
        return tuple((k, _key(v, f"{path}.{k}", depth, active)) for k, v in state)
    if isinstance(value, weakref.ref):
        return ("referent", id(value()))  # comparing referents could compare tensors
    try:
        hash(value)
    except TypeError:
        raise Incomparable(f"{type(value).__module__}.{type(value).__qualname__}") from None
    return value  # a hashable value without fields: its own __eq__ is its value


def _state(value: Any) -> list[tuple[str, Any]] | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None when it has none."""
    fields: list[tuple[str, Any]] = []
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        fields += attrs.items()
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                fields.append((slot, getattr(value, slot)))
    return None if attrs is None and not fields else fields
