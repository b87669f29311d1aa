"""What a function reads besides its arguments: closed-over tensors (lifted) and values (guarded).

Note [Closed-over tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A function reaches tensors and Python values that are not its arguments:
closure cells, globals, default arguments, its bound ``self``, and through
them modules and objects. Each call, aotgrad reads them afresh from these
*roots* (found once from the code objects) and

- lifts every tensor found as a graph input named by the expression that
  reaches it (``Closure("lin.weight")``, ``Global("W")``), after the module
  state and before the user's tensors: its gradient flows into the real
  tensor's ``.grad`` and an in-place update of it is an input mutation,
  replayed on the real tensor by every call (capture never touches it);
- keys every other value by value (Note [Keys of Python values]): a changed
  global, closure variable or module attribute re-traces, and ``cache_info``
  names it. Functions, classes and Python modules are keyed by identity.

For::

    lin, K = nn.Linear(3, 2), 2
    def helper(x): return x * K
    f = aot_function(lambda x: helper(lin(x)).sum())

the roots are ``lin`` (closure cell) and ``helper`` (global), and through
``helper`` (a function of the same module, walked too) ``K``; the inputs are
``closure lin.weight, closure lin.bias, x``, and the guards ``helper`` (itself),
``lin.training`` (False/True), ``K`` ((int, 2)). ``K = 3`` re-traces, with the
miss reason ``global K: value 2 != 3``.

What is walked: the function's closure cells, defaults, globals named by its
code (nested code objects included), and functions of its own module that it
names (recursively). Python modules, and functions of other modules, are
keyed by identity and not walked: a library's globals are its own business.
A real tensor reached some other way that requires grad or is mutated is
refused during capture (``capture/user_state/closed_over.py``), never silently baked in.

Note [Module arguments]
~~~~~~~~~~~~~~~~~~~~~~~
A module passed as an argument is not a pytree: it is one opaque leaf of the
call, hiding its parameters and buffers from the graph. aotgrad reads it each
call as it reads a closed-over module: its tensors are lifted as inputs named
by the argument's path (``Input("model.fc.weight")``), after the closed-over
tensors and before the user's, and its other attributes are guarded by value
(``input model.training``). The leaf itself is keyed by identity: the trace
ran that object's code, so another module object re-traces. For::

    def step(model, x): return model(x).sum()
    aot_function(step)(net, x)

the inputs are ``model.fc.weight, model.fc.bias, model.bn.running_mean, ...,
x``; ``net.fc.weight.grad`` accumulates as in eager, BatchNorm's running
statistics are input mutations replayed on ``net``'s buffers, and ``net.eval()``
re-traces (``input model.training: value True != False``). The capture runs
the user's function on the real module; the closed-over swap (Note [Real
tensors in a trace]) hands its ops the traced tensors.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad._torch_compat import MODULE_HOOKS, global_module_hooks, is_fsdp_bookkeeping
from aotgrad.signature.descriptors import Closure, Global, Input, PrimalDescriptor
from aotgrad.signature.values import Incomparable, TensorInValue, value_key

# A module's own bookkeeping in ``__dict__``: not user attributes (``training`` is).
_MODULE_FIELDS = frozenset(vars(torch.nn.Module())) - {"training"}

# Note [Module hooks]
# ~~~~~~~~~~~~~~~~~~~
# A module's hooks run inside its call, so the trace bakes in the ones present
# at capture. They are module bookkeeping (``_MODULE_FIELDS``), not attributes,
# and guarded apart: each non-empty hook dict is a guard keyed by its hooks'
# identities. ``lin.register_forward_hook(scale)`` after a call adds the guard
# ``closure lin._forward_hooks`` and re-traces; removing it re-traces again:
#
#     f = aot_function(lambda x: lin(x));  f(x)     guards: ..., lin.training
#     lin.register_forward_hook(scale);    f(x)     + lin._forward_hooks: ((7, scale),)
#
# Global module hooks (``register_module_forward_hook``) are guarded the same
# way, as ``global module_forward_hooks``, whenever the function reaches a module.

# How a lifted tensor was reached: closure/default/self, global, or a module argument.
Kind = type[Closure] | type[Global] | type[Input]
# Each kind as its guards' labels start: ``closure K``, ``global K``, ``input model.training``.
_LABELS: dict[Kind, str] = {Closure: "closure", Global: "global", Input: "input"}
# Values keyed as themselves (``value_key``): the common module attributes, keyed inline.
_PLAIN = (int, bool, str, type(None))


@dataclass(frozen=True)
class Root:
    """A place the function reads: a closure cell, a global, a default, ``self``."""

    kind: Kind
    name: str
    get: Callable[[], Any]


@dataclass(frozen=True)
class Environment:
    """One call's reading of the roots: the tensors to lift and the keys of everything else."""

    # Lifted tensors and where each was found, in the order found (each tensor once):
    # ``(Closure, "lin.weight")``; ``descriptors`` makes them descriptors (not every call).
    tensors: tuple[torch.Tensor, ...]
    sources: tuple[tuple[Kind, str], ...]
    # Guarded values: a label per value (``global K``, ``lin.training``) and its key.
    labels: tuple[str, ...]
    keys: tuple[Any, ...]
    # The traced module's parameters and buffers (``roots_of(..., skip_self=True)``).
    params: tuple[tuple[str, torch.Tensor], ...] = ()
    buffers: tuple[tuple[str, torch.Tensor], ...] = ()

    @property
    def descriptors(self) -> tuple[PrimalDescriptor, ...]:
        return tuple(kind(name) for kind, name in self.sources)


EMPTY = Environment((), (), (), ())


def roots_of(fn: Callable[..., Any], *, skip_self: bool = False) -> tuple[Root, ...]:
    """The places ``fn`` reads besides its arguments (Note [Closed-over tensors]).

    ``skip_self``: ``fn`` is a module traced with its state as inputs; its own
    parameters and buffers are not roots (its other attributes are).
    """
    roots: list[Root] = []
    _collect(fn, roots, set(), skip_self)
    unique: dict[tuple[type, str], Root] = {}  # each place once, where first found
    for root in roots:
        unique.setdefault((root.kind, root.name), root)
    return tuple(unique.values())


def _collect(fn: Any, roots: list[Root], visited: set[int], skip_self: bool) -> None:
    if id(fn) in visited:
        return
    visited.add(id(fn))
    if isinstance(fn, torch.nn.Module):
        module = fn
        get = (lambda: _Attributes(module)) if skip_self else (lambda: module)
        roots.append(Root(Closure, "self", get))
        _collect(type(fn).forward, roots, visited, skip_self=False)
    elif isinstance(fn, types.MethodType):
        owner = fn.__self__
        roots.append(Root(Closure, "self", lambda: owner))
        _collect(fn.__func__, roots, visited, skip_self=False)
    elif isinstance(fn, functools.partial):
        partial = fn
        roots.append(Root(Closure, "partial", lambda: (partial.args, partial.keywords)))
        _collect(fn.func, roots, visited, skip_self=False)
    elif isinstance(fn, types.FunctionType):
        _function_roots(fn, roots, visited)
    elif callable(fn) and not isinstance(fn, type | types.BuiltinFunctionType):
        owner = fn
        roots.append(Root(Closure, "self", lambda: owner))
        _collect(vars(type(fn)).get("__call__"), roots, visited, skip_self=False)


def _function_roots(fn: types.FunctionType, roots: list[Root], visited: set[int]) -> None:
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        roots.append(Root(Closure, name, functools.partial(_cell_contents, cell)))
    parameters = _parameters_with_defaults(fn)
    for name in parameters:
        roots.append(Root(Closure, f"{name} (default)", functools.partial(parameters.get, name)))
    namespace = fn.__globals__
    for name in global_names(code):
        if name not in namespace:
            continue  # a builtin, or an attribute name
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            continue  # torch, F, math: identity never changes in practice
        roots.append(Root(Global, name, functools.partial(namespace.get, name)))
        if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
            _collect(value, roots, visited, skip_self=False)


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later in the enclosing function)
        return None


def _parameters_with_defaults(fn: types.FunctionType) -> dict[str, Any]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def global_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` and the code nested in it (lambdas, comprehensions) look up."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from global_names(const)


# Note [Reading a module, fast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aot_module`` and a closed-over module read the whole module tree every call
# (``_Walk._module``): every parameter and buffer, every non-empty hook dict and
# every attribute, since any of them may have changed since the last call. The
# reading is what the call's key must see, so none of it is skipped or cached
# between calls; only the bookkeeping around it is trimmed, each step giving
# exactly the tensors, labels and keys of the plain loop (one pass of
# ``named_modules()``, every ``vars(sub)`` entry filtered by ``_MODULE_FIELDS``):
#
# - the four hook dicts are looked at one by one only when one is non-empty
#   (almost never: ``Linear`` has none);
# - only a dict is asked whether it is FSDP2's bookkeeping (``is_fsdp_bookkeeping``
#   is False for anything else), and a plain value (``int``, ``bool``, ``str``,
#   ``None``: ``training``, ``in_features``) is keyed before: a ``Linear`` asks 0
#   times, not 3;
# - a tuple of plain values and floats (``LayerNorm.normalized_shape``) is keyed
#   by one loop (``values._flat_tuple_key``), not ``_key``'s recursion: the same key;
# - a ``float`` or ``tuple`` attribute goes to ``_value`` without ``visit``'s
#   tensor/module checks, which such a value never passes (a tuple holding a
#   tensor is still split by ``_value``, as before);
# - the traced module's parameters and buffers are named relative to it as they
#   are found (``0.weight``), not built as ``self.0.weight`` and then sliced;
# - no generator per submodule for its tensors, and each prefix is built once;
# - module paths (Note [Module paths as the signature names them]) are kept only by the
#   walk a capture asks for them, not by every call's.
#
# Tried and dropped (timings: bench/findings.md, 2026-12-07): walking the tree
# with a list as stack (slower than ``named_modules``' generators); keeping each
# ``__dict__``'s user attribute names by the tuple of its names (a small saving,
# and a name that compares equal to a ``str`` without being one would be
# labelled by the stored string). ``tests/test_module_read.py`` keeps the plain
# loop and checks both give the same tensors, labels and keys over a zoo of
# modules and changes, and that every change re-traces as before.

# Attribute types keyed by ``_value`` straight away: ``eps``, ``normalized_shape``.
_KEYED = (float, tuple)
# The hook dicts, one name each (Note [Module hooks]).
_FORWARD_PRE, _FORWARD, _BACKWARD_PRE, _BACKWARD = MODULE_HOOKS


class _Attributes:
    """A traced module's attributes, without its parameters and buffers (they are inputs)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


def read_environment(
    roots: tuple[Root, ...], arguments: tuple[tuple[str, torch.nn.Module], ...] = ()
) -> Environment:
    """Read every root now: the tensors to lift and the keys of the values to guard.

    ``arguments``: modules among the call's arguments, by argument path (Note
    [Module arguments]); walked after the roots, their tensors named ``Input``.
    """
    if not roots and not arguments:
        return EMPTY
    walk = _Walk()
    walk.roots(roots, arguments)
    if walk.saw_module:  # hooks every module call runs (Note [Module hooks])
        for hooks in MODULE_HOOKS:
            registered = global_module_hooks(hooks)
            if registered:
                walk.labels.append(f"global module{hooks}")
                walk.keys.append(tuple(registered.items()))
    return Environment(
        tuple(walk.tensors),
        tuple(walk.sources),
        tuple(walk.labels),
        tuple(walk.keys),
        tuple(walk.params),
        tuple(walk.buffers),
    )


# Note [Module paths as the signature names them]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The reports name each op's module by its path (Note [Module paths and source
# lines] in ``capture/provenance.py``). The path is the name the signature gives
# the module's tensors, without the tensor's own name: one walk (``_Walk``)
# names both, so ``grad of global net.0.weight`` and the module ``net.0`` agree
# however the function reaches the module::
#
#     net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
#     def loss_fn(x): return net(x).square().mean()     # global:   net, net.0, net.1, net.2
#     aot_function(lambda x: net(x))                     # closure:  net, net.0, ...
#     def step(model, x): ...; step(net, x)              # argument: model, model.0, ...
#     trainer.step (self.model = net, a plain object)    # bound:    self.model, self.model.0
#     def f(x, model=net): ...                           # default:  model (default).0
#     aot_module(net), trace(net, x)                     # itself:   0, 1, 2 (ops of its own
#                                                        #   forward: the class, Sequential)
#
# A module reached two ways (a global that is also a closure cell, a block also
# reachable as ``net.blocks[3]``) takes the first name the walk gives it, as its
# tensors do. A module reached no way the walk reads (one made inside the
# function, or reached through another Python module's globals) is named by its
# class.


def module_paths(
    roots: tuple[Root, ...], arguments: tuple[tuple[str, torch.nn.Module], ...] = ()
) -> dict[int, str]:
    """Every module the function reaches, by ``id``, named as the signature names its tensors
    (Note [Module paths as the signature names them]); read once per capture.

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> paths = module_paths(roots_of(lambda x: net(x)))
    >>> paths[id(net)], paths[id(net[0])], paths[id(net[1])]
    ('net', 'net.0', 'net.1')
    """
    walk = _Walk(paths={})
    walk.roots(roots, arguments)
    return walk.paths or {}


class _Walk:
    def __init__(self, paths: dict[int, str] | None = None) -> None:
        # Module paths by ``id`` of the module, when asked (Note [Module paths as the signature
        # names them]): each module under the name its tensors are lifted under.
        self.paths = paths
        self.tensors: list[torch.Tensor] = []
        self.sources: list[tuple[Kind, str]] = []
        self.labels: list[str] = []
        self.keys: list[Any] = []
        self._seen: set[int] = set()  # tensors and modules already visited
        self.saw_module = False
        # The traced module's own parameters and buffers, by name (lifted as Param/Buffer).
        self.params: list[tuple[str, torch.Tensor]] = []
        self.buffers: list[tuple[str, torch.Tensor]] = []

    def roots(
        self, roots: tuple[Root, ...], arguments: tuple[tuple[str, torch.nn.Module], ...]
    ) -> None:
        """Visit every root, then the module arguments (named ``Input``)."""
        for root in roots:
            self.visit(root.kind, root.name, root.get())
        for name, module in arguments:
            self.visit(Input, name, module)

    def visit(self, kind: Kind, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor(kind, name, value)
        elif isinstance(value, torch.nn.Module):
            self._module(kind, name, value, with_state=True)
        elif isinstance(value, _Attributes):
            self._module(kind, name, value.module, with_state=False)
        else:
            self._value(kind, name, value)

    def _tensor(self, kind: Kind, name: str, t: torch.Tensor) -> None:
        if id(t) in self._seen:
            return
        self._seen.add(id(t))
        self.tensors.append(t)
        self.sources.append((kind, name))

    def _module(
        self,
        kind: Kind,
        name: str,
        module: torch.nn.Module,
        with_state: bool,
    ) -> None:
        """One pass over the module tree: parameters, then buffers, then other attributes.

        Without ``with_state`` (the traced module) the parameters and buffers are
        collected apart, by their names relative to the module (``Param``/``Buffer``).
        Runs every call: Note [Reading a module, fast].
        """
        seen = self._seen
        if id(module) in seen:
            return
        self.saw_module = True
        # (name, tensor), named ``name.fc.weight`` with state, else ``fc.weight``.
        params: list[tuple[str, torch.Tensor]] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        attributes: list[tuple[str, Any]] = []
        labels, keys = self.labels, self.keys
        head = f"{_LABELS[kind]} {name}."  # ``closure self.``
        paths = self.paths
        for relative, sub in module.named_modules():
            seen.add(id(sub))
            prefix = f"{relative}." if relative else ""  # relative to the module
            named = f"{name}.{prefix}" if with_state else prefix  # the tensors' names
            if paths is not None:  # ``net.0`` for ``net.0.weight``; ``0`` for ``param 0.weight``
                paths.setdefault(id(sub), named[:-1])
            for n, p in sub._parameters.items():
                if p is not None:
                    params.append((named + n, p))
            for n, b in sub._buffers.items():
                if b is not None:
                    buffers.append((named + n, b))
            state = vars(sub)
            get = state.get
            if get(_FORWARD_PRE) or get(_FORWARD) or get(_BACKWARD_PRE) or get(_BACKWARD):
                for hooks in MODULE_HOOKS:  # Note [Module hooks]
                    if get(hooks):
                        labels.append(f"{head}{prefix}{hooks}")
                        keys.append(tuple(state[hooks].items()))
            for a, v in state.items():
                if a in _MODULE_FIELDS:
                    continue
                cls = type(v)
                if cls in _PLAIN:  # ``training``, ``in_features``: keyed here, as ``_value`` would
                    labels.append(f"{head}{prefix}{a}")
                    keys.append((cls, v))
                elif not isinstance(v, dict) or not is_fsdp_bookkeeping(v):  # (only a dict is)
                    attributes.append((f"{name}.{prefix}" + a, v))
                # else FSDP2's state: it runs around the graphs (Note [Wrappers run around the graphs])
        for found_tensors, into in ((params, self.params), (buffers, self.buffers)):
            for qualname, t in found_tensors:
                if id(t) in seen:
                    continue  # tied: one input under its first name
                if with_state:
                    self._tensor(kind, qualname, t)
                else:
                    seen.add(id(t))
                    into.append((qualname, t))
        for label, value in attributes:
            if type(value) in _KEYED:  # never a tensor or a module: ``visit`` would call ``_value``
                self._value(kind, label, value)
            else:
                self.visit(kind, label, value)

    def _value(self, kind: Kind, name: str, value: Any) -> None:
        try:
            key = value_key(value)
        except TensorInValue:
            self._parts(kind, name, value)
            return
        except Incomparable:
            key = (type(value), "identity", id(value))
        self.labels.append(f"{_LABELS[kind]} {name}")
        self.keys.append(key)

    def _parts(self, kind: Kind, name: str, value: Any) -> None:
        """A container or object holding tensors: visit its parts (tensors lifted, rest keyed)."""
        if id(value) in self._seen:
            return
        self._seen.add(id(value))
        if isinstance(value, tuple | list):
            items: Any = ((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            items = ((f"{name}[{k!r}]", v) for k, v in value.items())
        else:
            items = ((f"{name}.{k}", v) for k, v in getattr(value, "__dict__", {}).items())
        for label, part in items:
            self.visit(kind, label, part)
