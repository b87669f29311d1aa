"""The arguments of a captured call, by name: a later call matched to them.

Note [Calls matched by argument name]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``Traced`` (and graphs from ``aotgrad.load``) runs graphs captured for one
call. A later call that passes the same arguments another way -- a keyword
where the capture passed it by position -- is the same call in eager, so it is
arranged as the capture passed them before its structure is compared. A call
that leaves out an argument the capture passed, or passes one the capture did
not, is told by the argument's name, with what the capture had::

    traced = aotgrad.trace(f, x, w)         # def f(x, w, scale=1.0)
    traced(x, w=w)                          # arranged as (x, w): runs
    traced(x)                               # CallError: argument w is missing
                                            #   (the capture passed float32[3, 4])
    traced(x, w, scale=2.0)                 # CallError: argument scale (2.0) was not
                                            #   passed at capture: the graphs were
                                            #   captured without it (they hold 1.0)

Positional arguments are named by the function's parameters (``args[i]`` for
``*args``); graphs read from a file have no function, and name the positional
arguments past the capture's by their place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad.errors import CallError

_MAX_TEXT = 80


@dataclass(frozen=True, kw_only=True)
class ArgumentLayout:
    """How the captured call passed its arguments.

    >>> layout = ArgumentLayout.of_call(["x", "w"], (torch.ones(3, 4),), {"w": {"a": 2.0}})
    >>> layout.positional, layout.keywords, layout.described
    (('x',), ('w',), ('float32[3, 4]', "{'a': 2.0}"))
    >>> layout.arrange(["x", "w"], (torch.ones(3, 4), {"a": 1.0}), {})[1]
    {'w': {'a': 1.0}}
    """

    # The names of the positional arguments, in order (Note [Calls matched by argument name]).
    positional: tuple[str, ...]
    # The keyword arguments, in the order the call passed them.
    keywords: tuple[str, ...]
    # Per argument, positional then keywords: its structure, leaves as ``*`` (compared) ...
    structures: tuple[str, ...]
    # ... and with its leaves shown (``float32[3, 4]``, ``2.0``): what messages tell.
    described: tuple[str, ...]

    @staticmethod
    def of_call(
        names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ArgumentLayout:
        """The layout of a call whose positional arguments are named ``names``."""
        values = [*args, *kwargs.values()]
        return ArgumentLayout(
            positional=tuple(names[: len(args)]),
            keywords=tuple(kwargs),
            structures=tuple(structure_text(v) for v in values),
            described=tuple(structure_text(v, leaves=True) for v in values),
        )

    def arrange(
        self,
        names: Sequence[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        checked: bool = False,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call passed as the capture passed it; a ``CallError`` naming the argument
        missing, extra or structured otherwise. ``names`` names this call's positional
        arguments; ``checked``: a call of this structure was arranged before (no checks)."""
        given: dict[str, Any] = {}
        for i, value in enumerate(args):  # past the parameters: named by place (unnamed)
            given[names[i] if i < len(names) else f"#{i}"] = value
        given.update(kwargs)
        if checked:
            return tuple(given[n] for n in self.positional), {k: given[k] for k in self.keywords}
        for name in kwargs:
            if name in names[: len(args)]:
                raise CallError(f"argument {name} is passed twice, by position and by keyword")
        captured = (*self.positional, *self.keywords)
        for name, described in zip(captured, self.described, strict=True):
            if name not in given:
                raise CallError(f"argument {name} is missing (the capture passed {described})")
        for name, value in given.items():
            if name not in captured:
                label = f"positional argument {name}" if name[0] == "#" else f"argument {name}"
                raise CallError(
                    f"{label} ({structure_text(value, leaves=True)}) was not passed at capture:"
                    " the graphs were captured without it"
                )
        for name, text, described in zip(captured, self.structures, self.described, strict=True):
            if structure_text(given[name]) != text:
                now = structure_text(given[name], leaves=True)
                raise CallError(
                    f"argument {name} is structured otherwise: the capture passed {described},"
                    f" this call passes {now}"
                )
        return tuple(given[n] for n in self.positional), {k: given[k] for k in self.keywords}

    def to_data(self) -> dict[str, list[str]]:
        """As plain lists of strings, for a graph file."""
        return {
            "positional": list(self.positional),
            "keywords": list(self.keywords),
            "structures": list(self.structures),
            "described": list(self.described),
        }

    @staticmethod
    def from_data(data: Any) -> ArgumentLayout:
        """Read back ``to_data``'s lists; a ``ValueError`` when they are not lists of strings."""
        if not isinstance(data, dict):
            raise ValueError("the argument layout is not a dict")
        fields = {}
        for name in ("positional", "keywords", "structures", "described"):
            value = data.get(name)
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise ValueError(f"the argument layout's {name} is not a list of strings")
            fields[name] = tuple(value)
        layout = ArgumentLayout(**fields)
        count = len(layout.positional) + len(layout.keywords)
        if len(layout.structures) != count or len(layout.described) != count:
            raise ValueError("the argument layout describes another number of arguments")
        return layout


def positional_names(fn: Callable[..., Any], count: int) -> list[str]:
    """The parameters ``count`` positional arguments of ``fn`` bind to, without binding:
    ``args[i]`` for ``*args``; those past its parameters are left unnamed (fewer names).

    >>> positional_names(lambda x, *rest, k=1: None, 3)
    ['x', 'rest[0]', 'rest[1]']
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C functions have no signature
        return [f"args[{i}]" for i in range(count)]
    names: list[str] = []
    for p in parameters:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            start = len(names)
            names.extend(f"{p.name}[{i - start}]" for i in range(start, count))
    return names[:count]


def structure_text(value: Any, leaves: bool = False) -> str:
    """A pytree's structure, its leaves as ``*`` or shown (``leaves``), shortened.

    >>> structure_text({"a": torch.ones(2), "b": [1, 2]})
    "{'a': *, 'b': [*, *]}"
    >>> structure_text((torch.ones(2, dtype=torch.float64, requires_grad=True), 3), leaves=True)
    '(float64[2] requiring grad, 3)'
    """
    text = _text(value, leaves)
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _text(value: Any, leaves: bool) -> str:
    if type(value) is tuple:
        inner = ", ".join(_text(v, leaves) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if type(value) is list:
        return "[" + ", ".join(_text(v, leaves) for v in value) + "]"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {_text(v, leaves)}" for k, v in value.items()) + "}"
    children, spec = pytree.tree_flatten(value)
    if not spec.is_leaf():  # another pytree node: its type and leaves
        inner = ", ".join(_text(v, leaves) for v in children)
        return f"{type(value).__name__}({inner})"
    return leaf_text(value) if leaves else "*"


def leaf_text(value: Any) -> str:
    """A leaf as messages show it: ``float32[3, 4]``, ``cuda:0 float16[8] requiring grad``, ``2.0``."""
    if isinstance(value, torch.Tensor):
        return tensor_text(
            value.dtype, tuple(value.shape), value.device, value.requires_grad, type(value)
        )
    if isinstance(value, torch.nn.Module):
        return f"a {type(value).__name__} module"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def tensor_text(
    dtype: torch.dtype,
    shape: Sequence[int | None],
    device: torch.device,
    requires_grad: bool,
    cls: type = torch.Tensor,
) -> str:
    """``float32[3, 4]``; a device other than the CPU, a subclass and requiring grad added.

    >>> tensor_text(torch.float32, (3, None), torch.device("cpu"), True)
    'float32[3, *] requiring grad'
    """
    sizes = ", ".join("*" if n is None else str(n) for n in shape)
    text = f"{str(dtype).removeprefix('torch.')}[{sizes}]"
    if device.type != "cpu":
        text = f"{device} {text}"
    if cls not in (torch.Tensor, torch.nn.Parameter):
        text = f"{cls.__name__} {text}"
    return text + " requiring grad" * requires_grad
