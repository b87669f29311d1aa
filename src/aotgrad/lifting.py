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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module

from aotgrad.capture import Body
from aotgrad.signature import (
    Buffer,
    FlatInputs,
    Param,
    PrimalDescriptor,
    call_key,
)
from aotgrad.signature.closures import EMPTY, Environment, Root, read_environment, roots_of


@dataclass(frozen=True)
class Lifted:
    """One call's lifted state: module state first, then closed-over tensors."""

    tensors: tuple[torch.Tensor, ...]
    descriptors: tuple[PrimalDescriptor, ...]
    # Qualified names of the module's parameters and buffers (the leading tensors).
    module_names: tuple[str, ...]
    # (input names, tensor keys, value labels, value keys): what the trace specializes on.
    key: tuple[Any, ...]


NOTHING = Lifted((), (), (), ())

# Modules among a call's arguments, by argument path (Note [Module arguments]).
Arguments = tuple[tuple[str, torch.nn.Module], ...]


def _module_state(module: torch.nn.Module) -> Environment:
    """A module's parameters and buffers alone, when its environment is not read."""
    return Environment(
        (), (), (), (), tuple(module.named_parameters()), tuple(module.named_buffers())
    )


class State:
    """Reads a function's lifted state; ``empty`` when it reads nothing (the fast path)."""

    def __init__(self, fn: Callable[..., Any], read_environment: bool = True) -> None:
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.roots: tuple[Root, ...] = (
            roots_of(fn, skip_self=self.module is not None) if read_environment else ()
        )
        self.empty = self.module is None and not self.roots
        # The lifted names last read, and their descriptors and labels (built once per change).
        self._read_as: tuple[Any, ...] = ()
        self._descriptors: tuple[PrimalDescriptor, ...] = ()
        self._labels: tuple[str, ...] = ()
        # Labels of values the function changes itself: side effects, never guarded.
        self._volatile: set[str] = set()

    def read(self, arguments: Arguments = ()) -> Lifted:
        """The lifted state now; ``arguments``: the call's module arguments, by path (Note
        [Module arguments])."""
        if self.empty and not arguments:
            return NOTHING
        env = read_environment(self.roots, arguments) if self.roots or arguments else EMPTY
        if self.module is not None and not self.roots:  # Dynamo: module state only
            env = _module_state(self.module)
        module_names = (*(n for n, _ in env.params), *(n for n, _ in env.buffers))
        num_params = len(env.params)
        tensors = (*(p for _, p in env.params), *(b for _, b in env.buffers), *env.tensors)
        if (module_names, num_params, env.descriptors) != self._read_as:
            self._read_as = (module_names, num_params, env.descriptors)
            self._descriptors = (
                *(Param(n) for n in module_names[:num_params]),
                *(Buffer(n) for n in module_names[num_params:]),
                *env.descriptors,
            )
            self._labels = tuple(str(d) for d in self._descriptors)
        labels, keys = env.labels, env.keys
        if self._volatile:
            kept = [i for i, label in enumerate(labels) if label not in self._volatile]
            labels, keys = tuple(labels[i] for i in kept), tuple(keys[i] for i in kept)
        key = (self._labels, call_key(tensors), labels, keys)
        return Lifted(tensors, self._descriptors, module_names, key)

    def settle(self, before: Lifted, arguments: Arguments = ()) -> Lifted:
        """``before`` (read just before a capture), without the values the capture changed.

        A value the function itself changes (``calls.append(1)``, ``self.steps += 1``)
        is a Python side effect, which runs at capture only, not an input: guarding
        it would re-trace every call. It is left out of every later key.
        """
        if not self.roots and not arguments:
            return before
        after = read_environment(self.roots, arguments)
        names, tensors, labels, keys = before.key
        now = dict(zip(after.labels, after.keys, strict=True))
        changed = {label for label, key in zip(labels, keys, strict=True) if now.get(label) != key}
        if not changed:
            return before
        self._volatile |= changed
        kept = [i for i, label in enumerate(labels) if label not in changed]
        key = (names, tensors, tuple(labels[i] for i in kept), tuple(keys[i] for i in kept))
        return Lifted(before.tensors, before.descriptors, before.module_names, key)

    def body(self, fn: Callable[..., Any], lifted: Lifted, flat: FlatInputs) -> Body:
        """What capture traces: ``fn`` on the graph's primals (closed-over tensors are swapped
        in by capture itself, Note [Real tensors in a trace])."""
        module, names = self.module, lifted.module_names

        @contextlib.contextmanager
        def body(primals: list[torch.Tensor]) -> Iterator[Any]:
            # The lifted state stays in place until capture leaves the body: capture
            # differentiates inside it, and a reentrant checkpoint re-runs its region during
            # the backward on the lifted parameters, not the real ones (Note [Reentrant
            # checkpoints]).
            args, kwargs = flat.unflatten(primals[flat.num_lifted :])
            if module is None:
                yield fn(*args, **kwargs)
                return
            state = dict(zip(names, primals[: len(names)], strict=True))
            with _reparametrize_module(module, state, tie_weights=True, strict=False):
                yield module(*args, **kwargs)

        return body
