"""The state a compiled function reads besides its arguments, read afresh on every call.

For a module: its parameters and buffers (``Param``/``Buffer`` inputs, passed
with ``functional_call``). For any function: the tensors it closes over
(``Closure``/``Global`` inputs), those of modules passed as arguments
(``Input`` inputs, Note [Module arguments]) and the Python values it reads, which key the
cache (Note [Closed-over tensors] in ``signature/closures.py``). Reading again
each call is what makes a parameter added after the first call, a global
rebound to another tensor, or ``m.scale = 3.0`` take effect: each changes the
key, so the call re-traces, and ``cache_info`` says what changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from aotgrad.signature.closures import EMPTY, Root, module_paths, read_environment, roots_of
from aotgrad.signature.descriptors import Buffer, Param, PrimalDescriptor
from aotgrad.signature.flatten import (
    FlatInputs,
    PlainTensorsGuard,
    alias_key,
    call_key,
    leaf_names,
)

# What capture traces (capture's ``Body``): the function on the graph's primals, as a
# context manager yielding its result (Note [Reentrant checkpoints] needs it kept open).
Body = Callable[[list[torch.Tensor]], AbstractContextManager[Any]]


class StateKey(NamedTuple):
    """What a trace specializes on in the lifted state: one field of every ``CacheKey``.

    A ``NamedTuple`` like ``CacheKey``, for the same reason: hashed on every call.

    >>> key = State(torch.nn.Linear(2, 2)).read().key
    >>> key.names
    ('param weight', 'param bias')
    >>> key.labels[:2], key.values[:2]
    (('closure self.training', 'closure self.in_features'), ((<class 'bool'>, True), (<class 'int'>, 2)))
    """

    # The lifted tensors' descriptors, printed: ``param fc1.weight``, ``closure lin.bias``.
    names: tuple[str, ...] = ()
    # Per lifted tensor, its metadata (``call_key``).
    tensors: tuple[Any, ...] = ()
    # The Python values the function reads, by label (``global K``, ``closure lin.training``) ...
    labels: tuple[str, ...] = ()
    # ... and their keys (Note [Keys of Python values]), in the same order.
    values: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Lifted:
    """One call's lifted state: module state first, then closed-over tensors."""

    tensors: tuple[torch.Tensor, ...]
    descriptors: tuple[PrimalDescriptor, ...]
    # Qualified names of the module's parameters and buffers (the leading tensors).
    module_names: tuple[str, ...]
    # What the trace specializes on.
    key: StateKey


NOTHING = Lifted(tensors=(), descriptors=(), module_names=(), key=StateKey())
# Tensors the C++ tensor check can key (subclasses and sparse ones by ``call_key``).
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Modules among a call's arguments, by argument path (Note [Module arguments]).
Arguments = tuple[tuple[str, torch.nn.Module], ...]


def module_arguments(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    structure: Any,
    names: dict[Any, list[str]],
) -> Arguments:
    """The modules among the call's leaves, by argument path (Note [Module arguments]).

    ``target`` is the function whose parameters name the arguments
    (``call_target``); ``structure`` the call's structure key (``flatten_call``).
    ``names`` caches the leaf names by structure: they are found once per structure.

    >>> net = torch.nn.Linear(2, 2)
    >>> args = (net, torch.ones(2))
    >>> from aotgrad.signature.flatten import flatten_call
    >>> leaves, structure = flatten_call(args, {})
    >>> module_arguments(lambda model, x: None, args, {}, leaves, structure, {})
    (('model', Linear(in_features=2, out_features=2, bias=True)),)
    """
    if isinstance(structure, int):  # a flat call of tensors and scalars (``flatten_call``)
        return ()
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.nn.Module)]
    if not positions:
        return ()
    if structure not in names:
        names[structure] = leaf_names(target, args, kwargs)
    return tuple((names[structure][i], leaves[i]) for i in positions)


def as_module(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``model.forward`` (a bound method) is traced as ``model``: its state becomes inputs.

    >>> net = torch.nn.Linear(2, 2)
    >>> as_module(net.forward) is net
    True
    """
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") == "forward":
        return owner
    return fn


def call_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function whose parameters name a call's arguments: a module's ``forward``."""
    return fn.forward if isinstance(fn, torch.nn.Module) else fn


class _Names(NamedTuple):
    """The lifted names as last read, and the descriptors and labels built from them."""

    read_as: tuple[Any, ...]
    descriptors: tuple[PrimalDescriptor, ...]
    labels: tuple[str, ...]


class State:
    """Reads a function's lifted state; ``empty`` when it reads nothing (the fast path)."""

    def __init__(self, fn: Callable[..., Any], read_environment: bool = True) -> None:
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.roots: tuple[Root, ...] = (
            roots_of(fn, skip_self=self.module is not None) if read_environment else ()
        )
        self.empty = self.module is None and not self.roots
        # The lifted names last read, with their descriptors and labels (built once per
        # change). Each cache below is one value, replaced whole: calls in several threads
        # read and refill them (Note [Concurrent calls]).
        self._names = _Names(read_as=(), descriptors=(), labels=())
        # Labels of values the function changes itself: side effects, never guarded.
        self._volatile: frozenset[str] = frozenset()
        # The lifted tensors' last key, with a guard passing exactly when it still holds.
        self._last_tensors: tuple[PlainTensorsGuard, tuple[Any, ...]] | None = None
        # The last key read: read again while nothing changed (equal keys compare by identity).
        self._last_key = StateKey()

    def read(self, arguments: Arguments = ()) -> Lifted:
        """The lifted state now; ``arguments``: the call's module arguments, by path (Note
        [Module arguments])."""
        if self.empty and not arguments:
            return NOTHING
        env = read_environment(self.roots, arguments) if self.roots or arguments else EMPTY
        if self.module is not None and not self.roots:  # Dynamo: module state only
            params, buffers = self.module.named_parameters(), self.module.named_buffers()
            env = replace(EMPTY, params=tuple(params), buffers=tuple(buffers))
        module_names = (*(n for n, _ in env.params), *(n for n, _ in env.buffers))
        num_params = len(env.params)
        tensors = (*(p for _, p in env.params), *(b for _, b in env.buffers), *env.tensors)
        names = self._names
        read_as = (module_names, num_params, env.sources)
        if read_as != names.read_as:
            descriptors = (
                *(Param(name=n) for n in module_names[:num_params]),
                *(Buffer(name=n) for n in module_names[num_params:]),
                *env.descriptors,
            )
            names = _Names(read_as, descriptors, tuple(str(d) for d in descriptors))
            self._names = names
        labels, keys = env.labels, env.keys
        volatile = self._volatile
        if volatile:
            kept = [i for i, label in enumerate(labels) if label not in volatile]
            labels, keys = tuple(labels[i] for i in kept), tuple(keys[i] for i in kept)
        key = self._key(names.labels, self._tensor_keys(tensors), labels, keys)
        return Lifted(
            tensors=tensors, descriptors=names.descriptors, module_names=module_names, key=key
        )

    def _key(
        self,
        names: tuple[str, ...],
        tensors: tuple[Any, ...],
        labels: tuple[str, ...],
        values: tuple[Any, ...],
    ) -> StateKey:
        """The state's key; the last one again when nothing changed."""
        last = self._last_key
        if (
            last.names is names
            and last.tensors is tensors
            and last.labels == labels
            and last.values == values
        ):
            return last
        key = StateKey(names=names, tensors=tensors, labels=labels, values=values)
        self._last_key = key
        return key

    def _tensor_keys(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        """``call_key(tensors)``: the last one again when Dynamo's C++ tensor check passes.

        ``PlainTensorsGuard`` passes exactly when ``call_key`` would be the same
        (Note [The last entry]); it checks all the tensors in one C++ call, far
        cheaper than building their keys in Python (bench/findings.md).
        """
        last = self._last_tensors
        if last is not None and last[0](tensors):
            return last[1]
        key = call_key(tensors)
        plain = alias_key(tensors) is None and all(
            type(t) in _PLAIN and t.layout is torch.strided for t in tensors
        )
        self._last_tensors = (PlainTensorsGuard(tensors), key) if plain else None
        return key

    def settle(self, before: Lifted, arguments: Arguments = ()) -> Lifted:
        """``before`` (read just before a capture), without the values the capture changed.

        A value the function itself changes (``calls.append(1)``, ``self.steps += 1``)
        is a Python side effect, which runs at capture only, not an input: guarding
        it would re-trace every call. It is left out of every later key.
        """
        if not self.roots and not arguments:
            return before
        _concrete_sizes(self._modules(arguments))  # Note [Sizes left in module attributes]
        after = read_environment(self.roots, arguments)
        labels, values = before.key.labels, before.key.values
        now = dict(zip(after.labels, after.keys, strict=True))
        changed = {label for label, v in zip(labels, values, strict=True) if now.get(label) != v}
        if not changed:
            return before
        self._volatile = self._volatile | changed
        kept = [i for i, label in enumerate(labels) if label not in changed]
        key = before.key._replace(
            labels=tuple(labels[i] for i in kept), values=tuple(values[i] for i in kept)
        )
        return replace(before, key=key)

    def module_paths(self, arguments: Arguments = ()) -> dict[int, str]:
        """The modules the function reaches, by ``id``, named as the lifted tensors are (Note
        [Module paths as the signature names them]); the traced module's own are relative
        to it (``blocks.3.attn``, and ``""`` for itself).

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> sorted(State(lambda x: net(x)).module_paths().values())
        ['net', 'net.0']
        >>> sorted(State(net).module_paths().values())
        ['', '0']
        """
        if self.roots or arguments:
            return module_paths(self.roots, arguments)
        if self.module is not None:  # module state only (Dynamo)
            return {id(m): name for name, m in self.module.named_modules()}
        return {}

    def _modules(self, arguments: Arguments) -> list[torch.nn.Module]:
        """The modules the function reaches directly: itself, closed over, passed."""
        found = [self.module] if self.module is not None else []
        found += [v for v in (root.get() for root in self.roots) if isinstance(v, torch.nn.Module)]
        found += [module for _, module in arguments]
        return found

    def body(self, fn: Callable[..., Any], lifted: Lifted, flat: FlatInputs) -> Body:
        """What capture traces: ``fn`` on the graph's primals. The lifted state stays in the
        user's objects; capture swaps it for the primals wherever an op reaches it (Note
        [Module state in a trace])."""
        target = fn if self.module is None else self.module

        @contextlib.contextmanager
        def body(primals: list[torch.Tensor]) -> Iterator[Any]:
            args, kwargs = flat.unflatten(primals[flat.num_lifted :])
            yield target(*args, **kwargs)

        return body


# Note [Module state in a trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A module's parameters and buffers are primals of its trace, and the trace
# runs the user's own module: nothing is written into it. ``self.fc.weight``
# still reads the real parameter; the capture's torch-function mode (Note
# [Real tensors in a trace]) swaps it for its traced primal where an op
# receives it, as it does for a closed-over tensor, for as long as the trace
# runs, the backward's recompute of a checkpointed region included::
#
#     F.linear(x', self.fc.weight, self.fc.bias)  ->  F.linear(x', weight', bias')
#     batch_norm(..., self.bn.running_mean, ...)  ->  running_mean' updated in place: an
#                                                     input mutation, applied to the real
#                                                     buffer at each call
#
# The mode is per thread. The capture used to point the module's attributes at
# the primals for its duration, and another thread calling the same module
# eagerly meanwhile computed on fake tensors: it got FakeTensors back, or an
# error from inside torch. Pointing attributes elsewhere and back also had to
# visit each attribute once however many names it has (a submodule registered
# in two places, timm's CoaT), or the restore left a fake tensor in the real
# module. Swapping values has neither problem: tied weights are one tensor, one
# primal, one summed gradient; ``self.a.weight is self.b.weight`` and
# ``isinstance(self.weight, nn.Parameter)`` answer as in eager; a subclass
# parameter is swapped for the subclass rebuilt from its inner primals (Note
# [Real subclass tensors in a trace]).


# Note [Sizes left in module attributes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under dynamic shapes a size is a ``SymInt`` of the capture's shape environment.
# Code that stores one on a module (transformers' Swin: ``self.window_size =
# min(input_resolution)``) would leave it in the user's real module after the
# capture, where eager leaves an int::
#
#     def forward(self, x): self.size = x.shape[0]; ...
#     aot_module(m, dynamic=True)(torch.randn(3, 4))   # m.size: 3, not the symbol s0
#
# So after a capture every module attribute (and list/tuple of them) holding a
# symbolic number gets the number it stood for at this call.
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _concrete_sizes(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        for sub in module.modules():
            for name, value in list(vars(sub).items()):
                concrete = _concrete(value)
                if concrete is not value:
                    object.__setattr__(sub, name, concrete)


def _concrete(value: Any) -> Any:
    if isinstance(value, _SYMBOLIC):
        hint = value.node.hint
        return value if hint is None else type(hint)(hint)
    if type(value) in (list, tuple) and any(isinstance(v, _SYMBOLIC) for v in value):
        return type(value)(_concrete(v) for v in value)
    return value
