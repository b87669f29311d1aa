"""Plain data to JSON and back, for a closed list of types (Note [Files run no code]).

Every value aotgrad stores is built from JSON scalars, lists, and a fixed list of
aotgrad's own frozen dataclasses and enums (``TYPES``), torch dtypes, devices,
layouts and memory formats, slices and tree specs. Decoding builds exactly those,
by keyword, and nothing else: an unknown type name is a :class:`StoreError`.

>>> import torch
>>> from aotgrad.signature.descriptors import Grad, Input
>>> encoded = encode((Grad(of=Input(path="x")), torch.float16, slice(0, 2)))
>>> decode(encoded)
(Grad(of=Input(path='x')), torch.float16, slice(0, 2, None))
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.capture.analyses.aliasing import (
    Alias,
    AliasSource,
    ConstantOutput,
    TensorOutput,
    ViewMeta,
)
from aotgrad.capture.analyses.backward_state import StateRegion
from aotgrad.capture.analyses.mutation import InputMutation
from aotgrad.capture.analyses.set_storage import NewStorage
from aotgrad.capture.provenance import Kind, NodeInfo, Phase
from aotgrad.errors import StoreError, UserFrame
from aotgrad.partition import RecomputedOp
from aotgrad.partition.saved import SavedValue
from aotgrad.runtime.function import Plan, ZerosLike
from aotgrad.signature import descriptors
from aotgrad.signature.convention import Signature
from aotgrad.signature.views import ViewCreation

# Every class a file may name: aotgrad's own data, nothing with behaviour on construction
# beyond checking its fields.
TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Alias,
        AliasSource,
        ConstantOutput,
        InputMutation,
        Kind,
        NewStorage,
        NodeInfo,
        Phase,
        Plan,
        RecomputedOp,
        SavedValue,
        Signature,
        StateRegion,
        TensorOutput,
        UserFrame,
        ViewCreation,
        ViewMeta,
        ZerosLike,
        *(
            value
            for value in vars(descriptors).values()
            if isinstance(value, type)
            and issubclass(value, descriptors.Descriptor)
            and dataclasses.is_dataclass(value)
        ),
    )
}

# What decoding malformed data can raise besides StoreError: each becomes a StoreError
# (RecursionError: data nested deeper than Python's stack, OverflowError: a huge number).
MALFORMED = (
    KeyError,
    TypeError,
    ValueError,
    IndexError,
    AttributeError,
    AssertionError,
    NotImplementedError,
    RecursionError,
    OverflowError,
)

_TORCH_ENUMS: dict[str, type] = {
    "dtype": torch.dtype,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}


def encode(value: Any) -> Any:
    """``value`` as JSON data; a :class:`StoreError` naming any value of another type."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": value.hex()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"tuple": [encode(v) for v in value]}
    return _encode_object(value)


def _encode_object(value: Any) -> Any:
    if isinstance(value, slice):
        return {"slice": [value.start, value.stop, value.step]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, cls in _TORCH_ENUMS.items():
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    if isinstance(value, pytree.TreeSpec):
        return {"structure": dump_structure(value)}
    name = type(value).__name__
    if TYPES.get(name) is not type(value):
        raise StoreError(f"cannot store a value of type {type(value).__qualname__}: {value!r:.80}")
    if isinstance(value, enum.Enum):
        return {"enum": name, "value": value.value}
    fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}  # type: ignore[arg-type]
    return {"type": name, "fields": fields}


def decode(data: Any) -> Any:
    """The value :func:`encode` made ``data`` from; a :class:`StoreError` for anything else."""
    if data is None or isinstance(data, bool | int | str | float):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict) or not data:
        raise StoreError(f"unexpected stored value {data!r:.80}")
    try:
        return _decode_object(data)
    except StoreError:
        raise
    except MALFORMED as e:
        raise StoreError(f"malformed stored value {data!r:.80}: {type(e).__name__}: {e}") from None


def _decode_object(data: dict[str, Any]) -> Any:
    if "tuple" in data:
        return tuple(decode(v) for v in data["tuple"])
    if "float" in data:
        return float.fromhex(data["float"])
    if "slice" in data:
        start, stop, step = data["slice"]
        return slice(_int(start), _int(stop), _int(step))
    if "device" in data:
        try:
            return torch.device(str(data["device"]))
        except RuntimeError:  # torch's error for a string that names no device
            raise StoreError(f"unknown torch device {data['device']!r:.40}") from None
    for kind, cls in _TORCH_ENUMS.items():
        if kind in data:
            found = getattr(torch, str(data[kind]), None)
            if not isinstance(found, cls):
                raise StoreError(f"unknown torch {kind} {data[kind]!r}")
            return found
    if "structure" in data:
        return load_structure(data["structure"])
    return _decode_type(data)


def _decode_type(data: dict[str, Any]) -> Any:
    name = data.get("enum", data.get("type"))
    cls = TYPES.get(str(name))
    if cls is None:
        raise StoreError(f"unknown stored type {name!r}: not one of aotgrad's data types")
    if "enum" in data:
        return cls(data["value"])
    fields = data["fields"]
    if not isinstance(fields, dict):
        raise StoreError(f"malformed fields of {name}")
    values = {str(k): decode(v) for k, v in fields.items()}
    hints = _field_types(cls)  # typing.get_type_hints, once per class
    for key, value in values.items():
        if key in hints and not _conforms(value, hints[key]):
            raise StoreError(
                f"stored {name}.{key} is {value!r:.60}, not a {hints[key]}"
                " (Note [Files run no code]: every field is checked against its type)"
            )
    return cls(**values)


_field_types = functools.cache(typing.get_type_hints)


def _conforms(value: Any, hint: Any) -> bool:
    """Is ``value`` of the declared type ``hint`` (the forms aotgrad's data classes use)?

    >>> _conforms((1, 2), tuple[int, ...]), _conforms((1, None), tuple[int, ...])
    (True, False)
    """
    return _checker(hint)(value)


@functools.cache
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A test of ``hint``, made once per type (a load checks ~10^4 fields)."""
    if hint is Any:
        return lambda value: True
    if hint is None or hint is type(None):
        return lambda value: value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        tests = [_checker(a) for a in args]
        return lambda value: any(test(value) for test in tests)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _checker(args[0])
        return lambda value: isinstance(value, tuple) and all(map(item, value))
    if origin is tuple:
        items = [_checker(a) for a in args]
        return lambda value: (
            isinstance(value, tuple)
            and len(value) == len(items)
            and all(test(v) for test, v in zip(items, value, strict=True))
        )
    if origin in (list, dict):
        return lambda value: isinstance(value, origin)
    if hint is int:
        return lambda value: type(value) is int
    if hint is float:
        return lambda value: type(value) in (int, float)
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    return lambda value: True  # a form these classes do not use: left to the class


def _int(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise StoreError(f"expected an int or null, got {value!r:.40}")


# Note [Tree structure in a file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A file never names a Python type to import. torch's ``treespec_loads`` does:
# its JSON names a registered type, and a context may name a module to import
# (an enum's ``fqn``, a ``defaultdict``'s factory), so a crafted spec naming
# ``unittest.__main__`` ran that module inside ``aotgrad.load``. aotgrad writes
# tree structure in its own JSON, one ``[kind, context, children]`` per node,
# ``null`` for a leaf, where ``kind`` is one of a closed list of containers::
#
#     ((x, y), {"lr": 0.1})   ->  ["tuple", null, [["tuple", null, [null, null]],
#                                                  ["dict", ["lr"], [null]]]]
#
# ``STRUCTURES`` holds them: tuple, list, dict, OrderedDict, deque (context: its
# ``maxlen``), defaultdict (context: ``[factory, keys]``, a factory from
# ``_FACTORIES`` only), torch.Size and torch's own ``torch.return_types``
# (looked up in that module, never imported). Keys are JSON data
# (:func:`encode`). Reading builds exactly these; anything else is a
# ``StoreError``.
#
# A user's own container (a NamedTuple, a registered dataclass, ``ModelOutput``)
# has no place in that list, and a file must not name its type for aotgrad to
# find. Where a structure is only compared with a live one (the arguments a
# loaded file was saved for: ``match_only=True``), such a node is written as
# ``["named", {"type": "pkg.mod.Point", "context": ...}, children]`` and the
# caller's own arguments are written the same way at each call and compared as
# data: the type is never looked up. Where a structure must be built (the
# result's), such a node is a ``StoreError`` when saving: the graphs are then
# not stored (``Traced.save`` raises; the disk cache traces as before).

# Default factories of a ``defaultdict`` that a file may name.
_FACTORIES: dict[str, Any] = {
    "None": None,
    **{f.__name__: f for f in (list, dict, set, tuple, int, float, str, bool)},
}
_FACTORY_NAMES = {id(f): name for name, f in _FACTORIES.items()}
# Containers a structure may hold, by the kind a file names them with.
STRUCTURES: dict[str, type] = {
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "defaultdict": collections.defaultdict,
    "deque": collections.deque,
    "Size": torch.Size,
}
_KINDS = {cls: kind for kind, cls in STRUCTURES.items()}
_LEAF = pytree.tree_structure(0)
_MAX_DEPTH = 200  # deeper nesting than any argument structure; a file beyond it is refused


def dump_structure(spec: pytree.TreeSpec, *, match_only: bool = False) -> Any:
    """``spec`` as aotgrad's own JSON data (Note [Tree structure in a file]).

    >>> spec = pytree.tree_structure(((1, 2), {"lr": 0.1}))
    >>> dump_structure(spec)
    ['tuple', None, [['tuple', None, [None, None]], ['dict', ['lr'], [None]]]]
    >>> load_structure(dump_structure(spec)) == spec
    True
    """
    return _dump_node(spec, match_only, 0)


def _dump_node(spec: pytree.TreeSpec, match_only: bool, depth: int) -> Any:
    if spec.is_leaf():
        return None
    if depth > _MAX_DEPTH:
        raise StoreError(f"cannot store a structure nested deeper than {_MAX_DEPTH} levels")
    children = [_dump_node(child, match_only, depth + 1) for child in spec.children()]
    cls, context = spec.type, spec.context
    kind = _KINDS.get(cls)
    if kind in ("tuple", "list", "Size"):
        return [kind, None, children]
    if kind in ("dict", "OrderedDict"):
        return [kind, _keys(context), children]
    if kind == "deque" and (context is None or type(context) is int):
        return [kind, context, children]
    if kind == "defaultdict":
        factory, keys = context
        name = _FACTORY_NAMES.get(id(factory))
        if name is not None:
            return [kind, [name, _keys(keys)], children]
        if match_only:
            return [kind, [_qualified(factory), _keys(keys)], children]
    elif _is_return_type(cls) and context is None:
        return ["return_types", cls.__name__, children]
    elif match_only:
        if cls is collections.namedtuple or _is_namedtuple(cls):
            # A NamedTuple: torch keeps its class as the type or the context.
            cls = context if _is_namedtuple(context) else cls
            context = list(getattr(cls, "_fields", ()))
        else:
            try:
                context = encode(context)
            except StoreError:
                raise StoreError(
                    f"cannot store the structure of a {_qualified(cls)} argument: its pytree"
                    " context is not plain data"
                ) from None
        return ["named", {"type": _qualified(cls), "context": context}, children]
    if cls is collections.namedtuple and _is_namedtuple(context):
        cls = context
    raise StoreError(
        f"cannot store the structure of a result holding a {_qualified(cls)}: a graph file"
        f" names only the containers {sorted(STRUCTURES)} and torch.return_types"
        " (Note [Tree structure in a file]); return a tuple, list or dict of tensors to"
        " store these graphs"
    )


def _is_namedtuple(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _keys(keys: Any) -> Any:
    return encode(list(keys))


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _is_return_type(cls: Any) -> bool:
    return (
        isinstance(cls, type)
        and getattr(torch.return_types, cls.__name__, None) is cls
        and cls in pytree.SUPPORTED_NODES
    )


def load_structure(data: Any) -> pytree.TreeSpec:
    """The ``TreeSpec`` :func:`dump_structure` wrote as ``data``; a ``StoreError`` for any
    other data, and for a ``"named"`` node, which is only ever compared (Note [Tree
    structure in a file])."""
    return _load_node(data, 0)


def _load_node(data: Any, depth: int) -> pytree.TreeSpec:
    if data is None:
        return _LEAF
    if depth > _MAX_DEPTH:
        raise StoreError(f"a stored structure is nested deeper than {_MAX_DEPTH} levels")
    if not (isinstance(data, list) and len(data) == 3 and isinstance(data[2], list)):
        raise StoreError(f"malformed stored structure {data!r:.80}")
    kind, context, children_data = data
    children = [_load_node(child, depth + 1) for child in children_data]
    if kind == "return_types":
        cls = getattr(torch.return_types, str(context), None)
        if not _is_return_type(cls):
            raise StoreError(f"unknown torch.return_types type {context!r:.60}")
        return pytree.TreeSpec(cls, None, children)
    cls = STRUCTURES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise StoreError(
            f"a stored structure names {kind!r:.60}, not one of the containers"
            f" {sorted(STRUCTURES)} (Note [Tree structure in a file])"
        )
    if kind in ("tuple", "list", "Size"):
        context = None
    elif kind in ("dict", "OrderedDict"):
        context = _loaded_keys(context, len(children))
    elif kind == "deque":
        context = _int(context)
        if context is not None and context < 0:
            raise StoreError(f"a stored deque has maxlen {context}")
    else:
        if not (isinstance(context, list) and len(context) == 2):
            raise StoreError(f"malformed defaultdict context {context!r:.60}")
        if context[0] not in _FACTORIES:
            raise StoreError(f"a stored defaultdict names the factory {context[0]!r:.60}")
        context = [_FACTORIES[context[0]], _loaded_keys(context[1], len(children))]
    return pytree.TreeSpec(cls, context, children)


def _loaded_keys(data: Any, count: int) -> list[Any]:
    keys = decode(data)
    if not isinstance(keys, list) or len(keys) != count:
        raise StoreError("a stored dict's keys do not match its values")
    if not all(isinstance(key, str | int | float | bool | tuple) or key is None for key in keys):
        raise StoreError(f"a stored dict has a key that is not plain data: {keys!r:.80}")
    try:
        if len(set(keys)) != len(keys):
            raise StoreError(f"a stored dict repeats a key: {keys!r:.80}")
    except TypeError:  # a tuple holding a list
        raise StoreError(f"a stored dict has a key that is not plain data: {keys!r:.80}") from None
    return keys
