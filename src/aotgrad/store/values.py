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

import dataclasses
import enum
import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.capture.aliasing import Alias, AliasSource, ConstantOutput, TensorOutput, ViewMeta
from aotgrad.capture.mutation import InputMutation
from aotgrad.capture.provenance import Kind, NodeInfo, Phase
from aotgrad.errors import StoreError, UserFrame
from aotgrad.partition import RecomputedOp
from aotgrad.partition.saved import SavedValue
from aotgrad.runtime.function import Plan, ZerosLike
from aotgrad.signature import descriptors
from aotgrad.signature.convention import Signature

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
        NodeInfo,
        Phase,
        Plan,
        RecomputedOp,
        SavedValue,
        Signature,
        TensorOutput,
        UserFrame,
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
        return {"treespec": dump_treespec(value)}
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
    except (
        TypeError,
        ValueError,
        AttributeError,
        KeyError,
        IndexError,
        AssertionError,
        NotImplementedError,
    ) as e:
        if isinstance(e, StoreError):
            raise
        raise StoreError(f"malformed stored value {data!r:.80}: {e}") from None


def _decode_object(data: dict[str, Any]) -> Any:
    if "tuple" in data:
        return tuple(decode(v) for v in data["tuple"])
    if "float" in data:
        return float.fromhex(data["float"])
    if "slice" in data:
        start, stop, step = data["slice"]
        return slice(_int(start), _int(stop), _int(step))
    if "device" in data:
        return torch.device(str(data["device"]))
    for kind, cls in _TORCH_ENUMS.items():
        if kind in data:
            found = getattr(torch, str(data[kind]), None)
            if not isinstance(found, cls):
                raise StoreError(f"unknown torch {kind} {data[kind]!r}")
            return found
    if "treespec" in data:
        return pytree.treespec_loads(str(data["treespec"]))
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
    return cls(**{str(k): decode(v) for k, v in fields.items()})


def _int(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise StoreError(f"expected an int or null, got {value!r:.40}")


def dump_treespec(spec: pytree.TreeSpec) -> str:
    """``pytree.treespec_dumps``; a ``StoreError`` for a structure it cannot write (a
    container type registered without a serialized name, such as a user's NamedTuple)."""
    try:
        return pytree.treespec_dumps(spec)
    except Exception as e:  # torch raises several types here
        raise StoreError(f"cannot store the structure {spec}: {e}") from None
