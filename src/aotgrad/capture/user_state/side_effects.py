"""Traced tensors the function stores in the user's objects: stored again at every call, or refused.

Note [Side effects replayed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Capture runs the user's Python once, on fake tensors. Code that stores a
tensor somewhere the user can see -- a forward hook recording activations, a
module attribute set from a computed tensor, the legacy ``weight_norm``
pre-hook, a global list -- would store a fake tensor there at capture and
nothing on later calls, where eager stores a real tensor every call. So a
capture watches the places the function reaches (the modules it traces or
closes over, their submodules' attributes and hooks' closures, its closure
cells, defaults and the globals its code names, one or two containers deep):

1. before the body runs, each place's entries are copied (``Watch.watching``);
2. when the body returns, every entry that now holds a fake tensor is a side
   effect: an attribute, buffer (``self.avg = 0.9 * self.avg + ...`` rebinds a
   registered buffer; capture's own swap of buffers for primals is not one),
   dict key, variable or global *set*, or an item *appended* to a list (the old
   items unchanged, by identity). Each such
   tensor becomes an extra forward output of the graph, described by a
   ``SideEffect`` descriptor, and the store becomes a replay action;
3. when the capture leaves the body (after the backward), the fakes are taken
   out again: every place holds what it held before, apart from stores that
   hold no fake (``calls.append(1)``: a Python side effect, run at capture
   only, as before);
4. a last walk of the same places must find no fake tensor; one found (a fake
   deeper than the walk compares) is refused.

Every call of the compiled entry then runs the graphs and does each store
with the real output: a detached value (``out.detach()``) arrives detached,
a differentiable one (``weight_norm``'s weight) as an output of the compiled
autograd Function, so gradients flow through it as through eager's. For::

    feats = []
    model.fc.register_forward_hook(lambda m, i, out: feats.append(out.detach()))
    torch.nn.utils.weight_norm(model.fc)     # a pre-hook: model.fc.weight = g * v / |v|
    f = aot_module(model)

the forward graph returns ``output``, ``side effect self.fc.weight = ·``,
``side effect (hook <lambda> on self.fc) global feats.append(·)`` (a script's
global; ``closure feats`` when the hook is made in a function), then the
saved values; after each call ``feats`` holds one more real activation and
``model.fc.weight`` is that call's weight, as in eager (the previous call's
weight, lifted as ``closure self.fc.weight`` and never read, reaches the
Function detached: Note [Inputs no gradient reaches] in ``runtime/__init__.py``).
Replays find their place again at each call from the module, cell or
globals it hangs from (``model.acts = []`` between calls is honoured).

What cannot be stored again faithfully is refused, naming the place and the
user's code (the hook's or function's line): a fake stored while the backward
was traced (a full backward hook recording ``grad_output``: the compiled
backward runs no Python), a list holding a fake after a change other than an
append, a fake inside an object that is not a list, tuple or dict, a
container mixing fakes with tensors from before the call. So is a new list,
dict or set stored under a new key or attribute: on later calls eager may
replace it or add to it, and one capture cannot tell which::

    feats[name] = [out]                      # eager, call 2: [out2]
    feats.setdefault(name, []).append(out)   # eager, call 2: [out1, out2]

(a list that a ``defaultdict(list)`` makes for a new key is appended to; a
list that exists before the first call is appended to). Entries
with replays are kept in memory only: the disk cache and ``Traced.save``
cannot hold the user's objects they write to.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    MODULE_HOOKS,
    FakeTensor,
    FunctionalTensor,
    global_module_hooks,
    is_traceable_wrapper_subclass,
)
from aotgrad.errors import (
    CallError,
    UnsupportedSideEffectError,
    UserFrame,
    format_error,
    is_user_file,
    user_frame_of_function,
)
from aotgrad.signature.descriptors import SideEffect

# A module's own bookkeeping in ``__dict__`` (parameters are swapped in by capture).
_MODULE_FIELDS = frozenset(vars(torch.nn.Module())) - {"training"}
# Containers below a module attribute, a variable or a global that the watch compares.
_DEPTH = 2
_MISSING = object()
# How a place is reached from its root: an attribute, a key or index, a cell's contents.
PathStep = tuple[str, Any]


def is_fake(value: object) -> bool:
    """A tensor of a capture: a fake tensor or its functional wrapper."""
    return isinstance(value, FakeTensor | FunctionalTensor)


def holds_fake(value: object, depth: int = _DEPTH + 1) -> bool:
    """Is a fake tensor ``value``, or in its lists, tuples, dicts, sets or attributes?"""
    if is_fake(value):
        return True
    if is_traceable_wrapper_subclass(value):  # a DTensor around a fake local tensor
        attrs, _ = value.__tensor_flatten__()
        return any(is_fake(getattr(value, a)) for a in attrs)
    if depth <= 0 or isinstance(value, torch.Tensor | str | bytes | int | float | type):
        return False
    if isinstance(value, list | tuple | set | frozenset):
        return any(holds_fake(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(holds_fake(v, depth - 1) for v in value.values())
    if _walkable_object(value):
        return any(holds_fake(v, depth - 1) for v in vars(value).values())
    return False


def _walkable_object(value: object) -> bool:
    """A user object whose attributes the watch compares (not a module, function or class)."""
    if isinstance(value, types.ModuleType | types.FunctionType | types.MethodType | type):
        return False
    if isinstance(value, torch.Tensor | torch.nn.Module):
        return False
    try:
        return isinstance(getattr(value, "__dict__", None), dict)
    except Exception:  # a proxy whose __getattr__ raises: not walked
        return False


def _printable(text: str) -> str:
    """``text`` as one printable line: a label goes into generated code's comments."""
    return text if text.isprintable() else repr(text)[1:-1]


def _attribute_text(name: object) -> str:
    """``.name``; ``[1]`` for a ``Sequential``'s child ``"1"``; else quoted."""
    text = str(name)
    if text.isidentifier():
        return f".{text}"
    return f"[{text}]" if text.isdigit() else f".<attribute {text!r}>"


def _key_text(key: object) -> str:
    plain = isinstance(key, str | int | float | bool | type(None))
    return repr(key) if plain else f"<{type(key).__name__}>"


@dataclass(frozen=True)
class _Place:
    """A container the function reaches: ``kind`` says how its entries are read and written.

    ``vars``: an object's attributes; ``buffers``: a module's buffers (``self.avg =
    ...`` on a registered buffer); ``dict``: a dict; ``globals``: the names ``keys`` of
    a module's globals; ``cell``: a closure variable; ``list``: a list.
    """

    kind: str
    # How the user reaches the root (``self``, ``closure feats``), and the steps below it.
    base: str
    root: Any
    steps: tuple[PathStep, ...] = ()
    keys: frozenset[str] | None = None

    @property
    def label(self) -> str:
        text = self.base
        for how, key in self.steps:
            if how == "attr":
                text += _attribute_text(key)
            elif how == "item":
                text += f"[{_key_text(key)}]"
        return text

    def entry_label(self, key: object) -> str:
        """Where entry ``key`` is; a list's or a cell's: the place itself."""
        if self.kind in ("vars", "buffers"):
            return self.label + _attribute_text(key)
        if self.kind == "dict":
            return f"{self.label}[{_key_text(key)}]"
        if self.kind == "globals":
            return f"{self.base}{key}"
        return self.label

    def resolve(self) -> Any:
        """The container now, reached again from the root (a rebound attribute is followed)."""
        value = self.root
        for how, key in self.steps:
            if how == "attr":
                value = getattr(value, key)
            elif how == "cell":
                value = value.cell_contents
            else:  # "item", or "name": a global by name (not printed: the base names it)
                value = value[key]
        return value

    def entries(self, container: Any) -> Any:
        """A copy of the container's entries: a dict (by attribute, key, name) or a list."""
        if self.kind == "list":
            return list(container)
        if self.kind == "cell":
            try:
                return {"": container.cell_contents}
            except ValueError:  # an empty cell
                return {}
        if self.kind == "globals":
            return {k: container[k] for k in self.keys or () if k in container}
        if self.kind == "buffers":
            return dict(container._buffers)
        items = vars(container) if self.kind == "vars" else container
        skip = _MODULE_FIELDS if isinstance(container, torch.nn.Module) else ()
        return {k: v for k, v in items.items() if k not in skip}

    def write(self, container: Any, key: Any, value: Any) -> None:
        """Set entry ``key``; ``_MISSING`` deletes it."""
        if self.kind == "cell":
            if value is _MISSING:
                del container.cell_contents
            else:
                container.cell_contents = value
            return
        target = vars(container) if self.kind == "vars" else container
        if self.kind == "buffers":
            target = container._buffers
        if value is _MISSING:
            target.pop(key, None)
        else:
            target[key] = value


class _Places:
    """Finds the places a function reaches (Note [Side effects replayed])."""

    def __init__(self) -> None:
        self.places: list[_Place] = []
        # Per place index: the hook whose closure reached it (for the error's line).
        self.owners: dict[int, object] = {}
        # Backward hooks of the modules reached (for the line of a backward-time store).
        self.backward_hooks: list[object] = []
        self._seen: set[int] = set()
        self._owner: object = None

    def function(self, fn: Any, prefix: str) -> None:
        """A function's closure cells, mutable defaults and globals its code names."""
        if id(fn) in self._seen:
            return
        self._seen.add(id(fn))
        if isinstance(fn, torch.nn.Module):
            self.value(fn, fn, (), prefix + "self", _DEPTH)
        elif isinstance(fn, types.MethodType):
            owner = fn.__self__
            self.value(owner, owner, (), prefix + "self", _DEPTH)
            self.function(fn.__func__, prefix)
        elif isinstance(fn, functools.partial):
            self.value(fn.args, fn.args, (), prefix + "partial args", _DEPTH)
            self.value(fn.keywords, fn.keywords, (), prefix + "partial keywords", _DEPTH)
            self.function(fn.func, prefix)
        elif isinstance(fn, types.FunctionType):
            self._plain_function(fn, prefix)
        elif callable(fn) and not isinstance(fn, type | types.BuiltinFunctionType):
            self.value(fn, fn, (), prefix + "self", _DEPTH)
            self.function(vars(type(fn)).get("__call__"), prefix)

    def _plain_function(self, fn: types.FunctionType, prefix: str) -> None:
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            label = f"{prefix}closure {name}"
            self._add(_Place("cell", label, cell))
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            self.value(contents, cell, (("cell", None),), label, _DEPTH)
            if isinstance(contents, types.FunctionType | functools.partial | types.MethodType):
                self.function(contents, prefix)
        if not is_user_file(code.co_filename):
            return  # a library's defaults and globals are its own (its closure may hold the user's)
        for default in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            self.value(default, default, (), f"{prefix}default of {fn.__name__}", _DEPTH)
        namespace = fn.__globals__
        names = frozenset(n for n in _code_names(code) if n in namespace)
        names = frozenset(n for n in names if not isinstance(namespace[n], types.ModuleType))
        if not names:
            return
        self._add(_Place("globals", f"{prefix}global ", namespace, keys=names))
        for name in sorted(names):
            value = namespace[name]
            self.value(value, namespace, (("name", name),), f"{prefix}global {name}", _DEPTH)
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                self.function(value, prefix)

    def value(
        self, value: Any, root: Any, steps: tuple[PathStep, ...], base: str, depth: int
    ) -> None:
        """A value reached at ``root`` + ``steps``: its containers become places."""
        if id(value) in self._seen or depth < 0:
            return
        if isinstance(value, torch.nn.Module):
            self._seen.add(id(value))
            self._module(value, root, steps, base, depth)
        elif isinstance(value, list):
            self._seen.add(id(value))
            self._add(_Place("list", base, root, steps))
        elif isinstance(value, dict):
            self._seen.add(id(value))
            self._add(_Place("dict", base, root, steps))
            for key, item in list(value.items()):
                self.value(item, root, (*steps, ("item", key)), base, depth - 1)
        elif type(value) is tuple:
            for i, item in enumerate(value):
                self.value(item, root, (*steps, ("item", i)), base, depth - 1)
        elif _walkable_object(value) and not isinstance(value, torch.Tensor):
            self._seen.add(id(value))
            self._add(_Place("vars", base, root, steps))
            for key, item in list(vars(value).items()):
                self.value(item, root, (*steps, ("attr", key)), base, depth - 1)

    def _module(
        self, module: torch.nn.Module, root: Any, steps: tuple[PathStep, ...], base: str, depth: int
    ) -> None:
        place = _Place("vars", base, root, steps)
        self._add(place)
        self._add(_Place("buffers", base, root, steps))
        self.function(type(module).forward, "")  # the globals its forward names
        for hooks in MODULE_HOOKS:
            for hook in list(vars(module).get(hooks, {}).values()):
                if hooks.startswith("_backward"):
                    self.backward_hooks.append(hook)
                name = getattr(hook, "__qualname__", type(hook).__name__)
                owner, self._owner = self._owner, hook
                self.function(hook, f"(hook {name} on {place.label}) ")
                self._owner = owner
        for name, sub in list(module._modules.items()):
            if sub is not None:  # submodules do not count against the depth
                self.value(sub, root, (*steps, ("attr", name)), base, depth)
        for key, item in list(vars(module).items()):
            if key not in _MODULE_FIELDS:
                self.value(item, root, (*steps, ("attr", key)), base, depth - 1)

    def _add(self, place: _Place) -> None:
        if self._owner is not None:
            self.owners[len(self.places)] = self._owner
        self.places.append(place)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


@dataclass(frozen=True)
class _Store:
    """One store the function did at capture, to do again at every call with real tensors."""

    place: _Place
    how: str  # "append" or "set"
    key: Any  # the attribute, key or name set ("" for a cell; None for an append)
    # The stored value's structure, its leaves (fakes replaced at each call), and which
    # leaves are fakes; ``spec`` None: the value is one tensor.
    spec: pytree.TreeSpec | None
    leaves: tuple[Any, ...]
    fake_leaves: tuple[int, ...]
    fake_paths: tuple[str, ...]

    @property
    def fakes(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.fake_leaves]

    def descriptors(self) -> list[SideEffect]:
        path = _printable(self.place.entry_label(self.key))
        return [SideEffect(path=path, how=self.how, leaf=_printable(p)) for p in self.fake_paths]

    def apply(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.spec is None:
            value: Any = tensors[0]
        else:
            leaves = list(self.leaves)
            for i, t in zip(self.fake_leaves, tensors, strict=True):
                leaves[i] = t
            value = pytree.tree_unflatten(leaves, self.spec)
        try:
            container = self.place.resolve()
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise CallError(
                f"aotgrad stores this call's value in {self.place.label} after every call, as"
                f" the function did when it was captured (Note [Side effects replayed]), and"
                f" {self.place.label} is no longer there ({type(e).__name__}: {e}). Keep it"
                " in place, or compile the function again."
            ) from None
        if self.how == "append":
            if not isinstance(container, list):
                raise CallError(
                    f"aotgrad appends this call's value to the list {self.place.label} after"
                    f" every call (Note [Side effects replayed]); it now holds a"
                    f" {type(container).__name__}. Keep a list there, or compile again."
                )
            container.append(value)
        else:
            self.place.write(container, self.key, value)


@dataclass(frozen=True)
class Replay:
    """The stores of one captured function, done at every call (Note [Side effects replayed]).

    The compiled graphs return ``(result, [side effect tensors])``; calling
    the replay on that does the stores and gives the user's result.
    """

    stores: tuple[_Store, ...]

    @property
    def descriptors(self) -> tuple[SideEffect, ...]:
        return tuple(d for s in self.stores for d in s.descriptors())

    def __call__(self, out: Any) -> Any:
        result, tensors = out
        start = 0
        for store in self.stores:
            count = len(store.fake_leaves)
            store.apply(tensors[start : start + count])
            start += count
        return result


@dataclass
class _Snapshot:
    """One place's container and its entries before the body ran."""

    place: _Place
    index: int
    container: Any
    before: Any


class Watch:
    """Watches the places a function reaches while it is captured (Note [Side effects replayed]).

    ``roots``: the function or module, closed-over and argument modules, by label.
    After a capture, ``replay`` holds the stores of its last attempt (None: none).
    """

    def __init__(self, roots: Sequence[tuple[str, Any]], where: UserFrame | None) -> None:
        self._roots = tuple(roots)
        self._where = where
        self._snapshots: list[_Snapshot] = []
        self._owners: dict[int, object] = {}
        self._backward_hooks: list[object] = []
        self._forward_values: set[int] = set()
        # The traced inputs of the latest attempt (a module's buffers are swapped for them).
        self._primals: set[int] = set()
        self.replay: Replay | None = None

    def _places(self) -> _Places:
        found = _Places()
        for label, root in self._roots:
            if isinstance(root, torch.nn.Module):
                found.value(root, root, (), label, _DEPTH)
            else:
                found.function(root, "")
        for hooks in MODULE_HOOKS:  # register_module_forward_hook ...
            for hook in list(global_module_hooks(hooks).values()):
                found.function(hook, f"(global hook {getattr(hook, '__qualname__', '')}) ")
        return found

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around one attempt's body and backward: copy, then restore and check the places."""
        found = self._places()
        self._owners = found.owners
        self._backward_hooks = found.backward_hooks
        self._snapshots = []
        for i, place in enumerate(found.places):
            try:
                container = place.resolve()
            except Exception:  # a place that does not resolve now is not watched
                continue
            self._snapshots.append(_Snapshot(place, i, container, place.entries(container)))
        self._forward_values = set()
        self.replay = None
        failed = True
        try:
            yield
            self._check_backward()
            failed = False
        finally:
            self._restore()
            if not failed:
                self._check_clean()

    def stored(
        self, primals: Sequence[torch.Tensor]
    ) -> tuple[list[SideEffect], list[torch.Tensor]]:
        """After the body: the stores it did, as descriptors and the traced tensors stored.

        ``primals``: the traced inputs; capture swaps a module's buffers for them, which is
        no store of the function's.
        """
        self._primals = {id(p) for p in primals}
        stores = self._stores()
        tensors = [t for s in stores for t in s.fakes]
        self._forward_values = {id(t) for t in tensors}
        self.replay = Replay(tuple(stores)) if stores else None
        return [d for s in stores for d in s.descriptors()], tensors

    def _stores(self) -> list[_Store]:
        stores: list[_Store] = []
        for snap in self._snapshots:
            now = snap.place.entries(snap.container)
            if snap.place.kind == "list":
                stores += self._appended(snap, now)
                continue
            swapped = self._primals if snap.place.kind == "buffers" else ()
            for key, value in now.items():
                if snap.before.get(key, _MISSING) is value or id(value) in swapped:
                    continue
                if holds_fake(value):
                    stores += self._set(snap, key, value)
        return stores

    def _set(self, snap: _Snapshot, key: Any, value: Any) -> list[_Store]:
        """The stores of ``place[key] = value``; a new container is ambiguous (Note [Side
        effects replayed])."""
        if key in snap.before or not isinstance(value, list | dict | set):
            return [self._store(snap, "set", key, value)]
        factory = getattr(snap.container, "default_factory", None)
        if isinstance(snap.container, collections.defaultdict) and factory is list:
            place = snap.place
            items = _Place("list", place.base, place.root, (*place.steps, ("item", key)))
            at = _Snapshot(items, snap.index, value, [])
            return [self._store(at, "append", None, v) for v in value if holds_fake(v)]
        self._refuse(
            self._owners.get(snap.index),
            f"{snap.place.entry_label(key)} was given a new {type(value).__name__} holding"
            " traced tensors; aotgrad cannot tell whether later calls replace it"
            " (d[k] = [t]) or add to it (d.setdefault(k, []).append(t)), which eager runs"
            " differently from the second call on",
            "Create the container before the first call (it is then appended to), store a"
            " tuple, or return the tensors from the function.",
        )
        return []

    def _appended(self, snap: _Snapshot, now: list[Any]) -> list[_Store]:
        before: list[Any] = snap.before
        if len(now) >= len(before) and all(a is b for a, b in zip(before, now, strict=False)):
            return [
                self._store(snap, "append", None, v) for v in now[len(before) :] if holds_fake(v)
            ]
        if any(holds_fake(v) for v in now):
            self._refuse(
                self._owners.get(snap.index),
                f"the list {snap.place.label} holds a traced tensor after a change other than"
                " appending (an item replaced, inserted or removed)",
                "Append to the list, or return the tensor from the function and store it"
                " after the call.",
            )
        return []

    def _store(self, snap: _Snapshot, how: str, key: Any, value: Any) -> _Store:
        if is_fake(value):
            return _Store(snap.place, how, key, None, (value,), (0,), ("",))
        with_paths, spec = pytree.tree_flatten_with_path(value)
        leaves = tuple(leaf for _, leaf in with_paths)
        fakes = tuple(i for i, leaf in enumerate(leaves) if is_fake(leaf))
        where = snap.place.entry_label(key)
        if spec.is_leaf() or any(holds_fake(leaf) for leaf in leaves if not is_fake(leaf)):
            self._refuse(
                self._owners.get(snap.index),
                f"{where} was given a {type(value).__name__} holding traced tensors, which"
                " aotgrad cannot build again with each call's values (it can for a tensor,"
                " and for lists, tuples and dicts of tensors and constants)",
                "Store the tensors themselves (or a tuple of them), or return them from the"
                " function and store them after the call.",
            )
        if any(isinstance(leaf, torch.Tensor) and not is_fake(leaf) for leaf in leaves):
            self._refuse(
                self._owners.get(snap.index),
                f"{where} was given a {type(value).__name__} holding both traced tensors and"
                " tensors from before the call, which every later call would store again"
                " unchanged",
                "Store the traced tensors apart, or return them from the function.",
            )
        paths = tuple(pytree.keystr(with_paths[i][0]) for i in fakes)
        return _Store(snap.place, how, key, spec, leaves, fakes, paths)

    def _check_backward(self) -> None:
        """Stores done while the backward was traced: the compiled backward runs no Python."""
        for store in self._stores():
            if all(id(t) in self._forward_values for t in store.fakes):
                continue
            snap = next(s for s in self._snapshots if s.place.root is store.place.root)
            label = store.place.entry_label(store.key)
            hooks = [h for h in self._backward_hooks if user_frame_of_function(h) is not None]
            self._refuse(
                hooks[0] if hooks else self._owners.get(snap.index),
                f"a tensor of the backward was stored in {label} while the backward was"
                " traced (a full backward hook or a tensor hook recording gradients): the"
                " compiled backward runs no Python code, so it would hold a stale value on"
                " later calls",
                "Remove the hook from the compiled model, return the activation from the"
                " function and record its gradient outside (out.register_hook(...)), or use"
                ' torch.compile(model, backend="aotgrad"), which runs such hooks in Python.',
            )

    def _refuse(self, owner: object, what: str, todo: str) -> None:
        """Refuse at the line of ``owner`` (the hook whose closure reached the place), if any."""
        where = user_frame_of_function(owner) if owner is not None else None
        raise UnsupportedSideEffectError(format_error(what, where or self._where, todo))

    def _restore(self) -> None:
        """Take every fake out of the places: they hold what they held before the body."""
        for snap in reversed(self._snapshots):
            place, container = snap.place, snap.container
            if place.kind == "list":
                if any(holds_fake(v) for v in container):
                    before: list[Any] = snap.before
                    prefix = all(a is b for a, b in zip(before, container, strict=False))
                    added = container[len(before) :] if prefix else []
                    container[:] = [*before, *(v for v in added if not holds_fake(v))]
                continue
            for key, value in place.entries(container).items():
                if snap.before.get(key, _MISSING) is not value and holds_fake(value):
                    place.write(container, key, snap.before.get(key, _MISSING))

    def _check_clean(self) -> None:
        """No fake tensor is left where the function reaches (step 4 of the Note)."""
        found = self._places()
        for i, place in enumerate(found.places):
            try:
                container = place.resolve()
            except Exception:
                continue
            entries = place.entries(container)
            items = enumerate(entries) if isinstance(entries, list) else entries.items()
            for key, value in items:
                if holds_fake(value):
                    self._refuse(
                        found.owners.get(i),
                        f"a traced (fake) tensor was left in {place.entry_label(key)} by the"
                        " capture, deeper in an object than aotgrad can store again at every"
                        " call",
                        "Store tensors in module attributes, lists or dicts (aotgrad stores"
                        " them again at every call), or return them from the function.",
                    )
