"""What a ``Traced`` was captured for, checked at every call: the capture's own ``CacheKey``.

Note [A Traced keeps to its capture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``aotgrad.trace`` captures graphs for one call: its shapes, dtypes, devices,
strides and ``requires_grad`` flags, the values of the module flags and Python
values the function reads (``model.training``, a global ``K``), the ambient
torch state, the environment variables it read. The graphs hold all of these as
constants. ``aot_function`` keys each call on exactly this (``CacheKey``, Note
[Ambient state]) and traces again when the key changes; a ``Traced`` cannot
trace again, so a call whose key differs from its capture's is a ``CallError``
that names the input and the difference, never a run::

    traced = aotgrad.trace(f, torch.randn(3, 4), w)
    traced(torch.randn(3, 4), w)      # the capture's key: runs
    traced(torch.randn(5, 4), w)      # CallError: input x: shape (3, 4) != (5, 4)
                                      #   (captured float32[3, 4], got float32[5, 4])
    model.eval(); traced_model(x)     # CallError: a module switched between train()
                                      #   and eval() (closure self.training: True != False)

There is one list of what matters, the key's: the capture's key is built by
``keyed_call`` from the example call, as ``aot_function`` keys its calls, and
each call's key is compared with it in a one-entry ``SpecializationCache`` --
the same ``find`` (shape guards of a dynamic capture, environment variables
read: Note [Entries with shape guards]) and the same last-entry fast path
(Note [The last entry]) serve it, so a plain call costs what an
``aot_function`` hit costs. The module state and closed-over tensors are read
again at every call, as ``aot_function`` reads them: a parameter replaced,
``model.double()`` or ``model.eval()`` shows in the key. A capture with dynamic
dimensions keeps its own: the call's sizes there are left to the capture's
shape guards. An argument passed by keyword where the capture passed it by
position is the same call (Note [Calls matched by argument name]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from aotgrad.cache.specializations import CacheKey, Entry, Miss, SpecializationCache, keyed_call
from aotgrad.capture.analyses.dynamic import DynamicDims
from aotgrad.capture.analyses.input_aliases import memory_sharing
from aotgrad.errors import CallError, format_error, user_frame_from_stack
from aotgrad.signature.arguments import ArgumentLayout, positional_names, tensor_text
from aotgrad.signature.descriptors import PrimalDescriptor
from aotgrad.signature.flatten import flatten_call, is_tensor_key, leaf_names
from aotgrad.signature.lifting import Lifted, State

_TODO = (
    "Call aotgrad.trace again with inputs like these, or use aotgrad.aot_function, which"
    " traces again for each specialization and keeps them all"
    " (Note [A Traced keeps to its capture])."
)


@dataclass(frozen=True, kw_only=True)
class Capture:
    """The call a ``Traced`` was captured for, as ``aot_function`` would key it."""

    # The capture's key, its state settled as ``aot_function`` stores it (``State.settle``).
    key: CacheKey
    # The dimensions the capture traced dynamic (Note [Marking dimensions dynamic]); a
    # call's key leaves out the same ones. None: every size static.
    dims: DynamicDims | None
    # Reads the module state, closed-over tensors and values at every call.
    state: State
    # The function whose parameters name the arguments (``call_target``).
    target: Callable[..., Any]
    # How the capture passed its arguments (Note [Calls matched by argument name]).
    layout: ArgumentLayout
    # Which graph inputs were one tensor or shared memory, and where (``memory_sharing``):
    # where a call's inputs share memory, it must be so (Note [Inputs that share memory]).
    sharing: tuple[Any, ...]
    # The graph inputs' descriptors, which name them in messages.
    descriptors: tuple[PrimalDescriptor, ...]
    # Leaf names by call structure, for module arguments (Note [Module arguments]).
    names: dict[Any, list[str]] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, kw_only=True)
class Call:
    """One call that matched the capture: the graphs' entry, the state and the leaves."""

    entry: Entry
    lifted: Lifted
    # The call's leaves, arranged as the capture passed them.
    leaves: Sequence[Any]
    key: CacheKey
    # Whether the call passed its arguments otherwise than the capture (Note [Calls matched
    # by argument name]): its leaves are not its positional arguments.
    arranged: bool


class Specialization:
    """A capture's one entry, and the check that a call keeps to it (Note [A Traced keeps to
    its capture])."""

    def __init__(self, capture: Capture, entry: Entry, owner: str) -> None:
        self.capture = capture
        self.cache = SpecializationCache(limit=1, owner=owner)
        self.cache.add(capture.key, entry)
        self.entry = entry
        # Call structures arranged as the capture's before (Note [Calls matched by argument
        # name]): their checks passed once, and pass again.
        self._arranged: frozenset[Any] = frozenset()
        # The positional parameters' names, by how many a call passes.
        self._names: dict[int, list[str]] = {}

    def fast(self, args: tuple[Any, ...]) -> Callable[[Sequence[Any]], Any] | None:
        """The entry, when a positional call of a function reading no state passes the
        last entry's guard (Note [The last entry])."""
        if not self.capture.state.empty:
            return None
        return self.cache.last_entry(args)

    def find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The entry for this call; a ``CallError`` saying what differs from the capture."""
        capture = self.capture
        leaves, structure = flatten_call(args, kwargs)
        arranged = structure != capture.key.structure
        if arranged:  # Note [Calls matched by argument name]
            given = structure
            names = self._positional_names(len(args))
            checked = given in self._arranged
            args, kwargs = _arranged(capture.layout, names, args, kwargs, checked)
            leaves, structure = flatten_call(args, kwargs)
            if structure == capture.key.structure:
                self._arranged = self._arranged | {given}  # whole (Note [Concurrent calls])
            else:
                raise _refusal(
                    "the arguments' containers differ from the capture's (a type or a key inside them)"
                )
        keyed = keyed_call(
            *(capture.target, capture.state, args, kwargs, capture.names),
            dims=lambda _: capture.dims,
            flat=(leaves, structure),
        )
        lifted, key = keyed.lifted, keyed.key
        found = self.cache.find(key, lifted.tensors, leaves)
        if isinstance(found, Miss):
            call = _Arguments(args, kwargs, lifted.tensors, leaves)
            raise _refusal(self._difference(found, key, call))
        if key.aliases is not None:  # some inputs share memory: where the capture's did?
            now = memory_sharing(found.inputs(lifted.tensors, leaves))
            if now != capture.sharing:
                raise _refusal(self._sharing_difference(now))
        return Call(entry=found, lifted=lifted, leaves=leaves, key=key, arranged=arranged)

    def _positional_names(self, count: int) -> list[str]:
        names = self._names.get(count)
        if names is None:
            names = self._names[count] = positional_names(self.capture.target, count)
        return names

    def remember(self, call: Call, kwargs: dict[str, Any]) -> None:
        """Let the next plain call take the fast path (as ``aot_function`` does)."""
        if not kwargs and not call.arranged and self.capture.state.empty:
            self.cache.remember(call.key, call.entry, call.leaves)

    def _difference(self, miss: Miss, key: CacheKey, call: _Arguments) -> str:
        """What differs from the capture, in ``cache_info``'s words, with both sides shown."""
        if miss.failed is not None:  # a shape guard of a dynamic capture, or the environment
            return miss.failed
        captured = self.capture.key
        if _first_difference(captured, key) == "aliases":
            primals = self.entry.inputs(call.state, call.leaves)
            return self._sharing_difference(memory_sharing(primals))
        names = leaf_names(self.capture.target, call.args, call.kwargs)
        if _first_difference(captured, key) == "leaves":
            module = _module_difference(captured, key, names)
            if module is not None:
                return module
        reason = key.explain(captured, names)
        both = _both_sides(captured, key)
        if both is None:
            return f"{reason} (the capture's first)"
        return f"{reason} (captured {both[0]}, got {both[1]})"

    def _sharing_difference(self, now: tuple[Any, ...]) -> str:
        names = self.capture.descriptors
        return (
            f"its inputs share memory {_sharing_text(self.capture.sharing, names)} at capture,"
            f" and {_sharing_text(now, names)} in this call (a tensor passed twice, views of"
            " one storage and their places in it)"
        )


class _Arguments(NamedTuple):
    """A call that differs from the capture, as messages need it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: tuple[torch.Tensor, ...]
    leaves: Sequence[Any]


def _first_difference(captured: CacheKey, key: CacheKey) -> str | None:
    """The first field of the keys that differs, in the order ``CacheKey.explain`` tells them."""
    for name in ("structure", "dynamic_dims", "leaves", "state", "aliases", "ambient"):
        if getattr(captured, name) != getattr(key, name):
            return name
    return None


def _module_difference(captured: CacheKey, key: CacheKey, names: Sequence[str]) -> str | None:
    """A module argument that is another object than the capture's (Note [Module arguments])."""
    for i, (a, b) in enumerate(zip(captured.leaves, key.leaves, strict=True)):
        if a != b:
            if not (_is_module_key(a) and _is_module_key(b)):
                return None
            name = names[i] if i < len(names) else f"leaf {i}"
            return (
                f"argument {name} is another module object than the capture's {a[1].__name__}"
                " (the graphs were captured for that object's parameters, buffers and flags)"
            )
    return None


def _is_module_key(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and key[0] == "module"


def _arranged(
    layout: ArgumentLayout,
    names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    checked: bool,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        return layout.arrange(names, args, kwargs, checked)
    except CallError as e:
        raise _refusal(str(e)) from None


def _both_sides(captured: CacheKey, key: CacheKey) -> tuple[str, str] | None:
    """The first tensor whose metadata differs, as ``float32[3, 4]`` at capture and now."""
    if captured.structure != key.structure or captured.dynamic_dims != key.dynamic_dims:
        return None
    for a, b in [
        *zip(captured.leaves, key.leaves, strict=True),
        *zip(captured.state.tensors, key.state.tensors, strict=False),
    ]:
        if a != b and is_tensor_key(a) and is_tensor_key(b):
            texts = _tensor_key_text(a), _tensor_key_text(b)
            return None if texts[0] == texts[1] else texts  # strides: the reason tells them
        if a != b:
            return None
    return None


def _tensor_key_text(key: tuple[Any, ...]) -> str:
    """A tensor key (``TENSOR_FIELDS`` order) as ``float32[3, 4]``."""
    cls, shape, _, _, dtype, device, requires_grad, _ = key
    return tensor_text(dtype, tuple(shape), device, requires_grad, cls)


def _sharing_text(sharing: tuple[Any, ...], descriptors: Sequence[Any]) -> str:
    """``memory_sharing``'s groups as ``a and b (the same tensor as a) [size ...]``."""
    if not sharing:
        return "(none)"

    def name(i: int) -> str:
        return str(descriptors[i]) if i < len(descriptors) else f"input {i}"

    groups = []
    for _, members in sharing:
        groups.append(
            " and ".join(
                name(i)
                + (f" (the same tensor as {name(same)})" if same != i else "")
                + f" [size {tuple(size)}, stride {tuple(stride)}, offset {offset}]"
                for i, same, size, stride, offset in members
            )
        )
    return "; ".join(groups)


def _refusal(what: str) -> CallError:
    return CallError(
        format_error(
            f"this call differs from the one this Traced was captured for: {what}. Its graphs"
            " hold the capture's shapes, dtypes, flags and values as constants, and would not"
            " compute what eager computes for this call",
            user_frame_from_stack(),
            _TODO,
        )
    )


def capture_of(
    *,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: CacheKey,
    dims: DynamicDims | None,
    state: State,
    sharing: tuple[Any, ...],
    descriptors: tuple[PrimalDescriptor, ...],
) -> Capture:
    """The capture of ``target(*args, **kwargs)``, keyed ``key`` (built before the trace,
    its state settled after)."""
    names = positional_names(target, len(args))
    return Capture(
        key=key,
        dims=dims,
        state=state,
        target=target,
        layout=ArgumentLayout.of_call(names, args, kwargs),
        sharing=sharing,
        descriptors=descriptors,
    )


def refuse_other_tensors(now: tuple[torch.Tensor, ...], captured: tuple[torch.Tensor, ...]) -> None:
    """A DDP or fully_shard module's state must still be the traced tensors (Note [Wrappers
    run around the graphs])."""
    if len(now) != len(captured) or any(a is not b for a, b in zip(now, captured, strict=True)):
        raise CallError(
            "this Traced was captured on the parameters and buffers its DDP or fully_shard"
            " module held at trace time, and the module now holds other tensors; call"
            " aotgrad.trace again (or use aotgrad.aot_module, which re-traces)"
        )
