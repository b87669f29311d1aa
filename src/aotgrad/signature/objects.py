"""Objects among the outputs: plain Python objects holding tensors, flattened by their attributes.

Note [Objects among the outputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A function may return an object of a class no pytree knows, holding tensors:
transformers' causal LMs return a ``DynamicCache`` (``past_key_values``), whose
``layers`` list holds ``DynamicLayer`` objects holding the key and value tensors.
torch's pytree sees one opaque leaf. aotgrad flattens such an object the way
pickle and ``copy`` see it, by its ``__dict__``: before the result is flattened,
each object holding a tensor becomes an :class:`ObjectNode`, a pytree node
whose children are the attributes that hold tensors and whose context keeps the
class and the other attributes (by reference, as eager's object would hold
them). Unflattening the node builds a new object of the class (``__new__``,
then its ``__dict__``), as ``copy`` does; the runtime so returns, each call, a
new ``DynamicCache`` holding the graph's output tensors::

    out.past_key_values                     DynamicCache
      .layers[0]                            DynamicLayer
        .keys, .values                      tensors -> outputs
        .is_initialized, .dtype, .device    constants (context)
      .layer_class_to_replicate, .offloading  constants (context)

    output names: ...past_key_values.layers[0].keys, ...layers[0].values, ...

Only plain objects qualify: not modules, tensors or classes, no ``__slots__``,
no ``__setstate__`` (their state is not their ``__dict__``), class not already
a pytree node. An object reached twice (or in a cycle) cannot be rebuilt as one
object and is refused; objects without tensors stay leaves (and are refused as
outputs, as before: they may be shared state, such as a model's config).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import pytree_node_type


class SharedObjectError(ValueError):
    """An object holding tensors is reached twice in one result (``path`` names the second)."""


@dataclass(frozen=True)
class _Class:
    """An ``ObjectNode``'s context: the class, every attribute name in order, the constants."""

    cls: type
    names: tuple[str, ...]
    # Attributes holding no tensor, by name: kept by reference.
    constants: tuple[tuple[str, Any], ...]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Class)
            and (self.cls, self.names) == (other.cls, other.names)
            and all(a is b or a == b for a, b in zip(self.constants, other.constants, strict=True))
        )

    def __hash__(self) -> int:
        return hash((self.cls, self.names))


class ObjectNode:
    """An object flattened by its attributes; unflattens to a new object of its class."""

    def __init__(self, context: _Class, children: dict[str, Any]) -> None:
        self.context = context
        self.children = children


def _unflatten(values: Any, context: _Class) -> Any:
    """A new object of the class: ``__new__``, then its ``__dict__`` in the original order."""
    cls: Any = context.cls
    obj = cls.__new__(cls)
    state = dict(context.constants)
    children = [n for n in context.names if n not in state]
    state.update(zip(children, values, strict=True))
    obj.__dict__.update((n, state[n]) for n in context.names)
    return obj


pytree.register_pytree_node(
    ObjectNode,
    lambda node: (list(node.children.values()), node.context),
    _unflatten,
    flatten_with_keys_fn=lambda node: (
        [(pytree.GetAttrKey(k), v) for k, v in node.children.items()],
        node.context,
    ),
)


def objects_as_nodes(result: Any) -> Any:
    """``result`` with every plain object holding a tensor replaced by an :class:`ObjectNode`
    (Note [Objects among the outputs]); raises :class:`SharedObjectError` for shared ones."""
    return _convert(result, set())


def _convert(value: Any, seen: set[int]) -> Any:
    """``value`` with its objects as nodes; containers without any are returned as they are
    (unflattening would lose what pytree does not keep: a ``torch.Size`` becomes a tuple)."""
    if _is_plain_object(value):
        return _as_node(value, seen) if _holds_tensor(value, set()) else value
    if pytree.tree_is_leaf(value):
        return value
    node = pytree.SUPPORTED_NODES[pytree_node_type(value)]
    children, context = node.flatten_fn(value)
    converted = [_convert(c, seen) for c in children]
    if all(new is old for new, old in zip(converted, children, strict=True)):
        return value
    return node.unflatten_fn(converted, context)


def _as_node(value: Any, seen: set[int]) -> ObjectNode:
    if id(value) in seen:
        raise SharedObjectError(type(value).__qualname__)
    seen.add(id(value))
    constants, children = [], {}
    for name, attribute in vars(value).items():
        if _holds_tensor(attribute, set()):
            children[name] = _convert(attribute, seen)
        else:
            constants.append((name, attribute))
    context = _Class(type(value), tuple(vars(value)), tuple(constants))
    return ObjectNode(context, children)


def _is_plain_object(value: Any) -> bool:
    cls = type(value)
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, torch.Tensor | torch.nn.Module | type | types.ModuleType)
        and not callable(value)
        and cls not in pytree.SUPPORTED_NODES
        and "__slots__" not in vars(cls)
        and getattr(cls, "__setstate__", None) is None
    )


def _holds_tensor(value: Any, active: set[int]) -> bool:
    """Does ``value`` reach a tensor through pytree containers and plain objects' attributes?"""
    if isinstance(value, torch.Tensor):
        return True
    if id(value) in active:
        return False  # a cycle: reported when the object is reached twice
    active.add(id(value))
    if type(value) in pytree.SUPPORTED_NODES:
        children, _ = pytree.tree_flatten(value)
        if children != [value]:
            return any(_holds_tensor(c, active) for c in children)
        return False
    if _is_plain_object(value):
        return any(_holds_tensor(v, active) for v in vars(value).values())
    return False
