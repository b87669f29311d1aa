"""Flatten the user's arguments into graph inputs, naming each by its pytree key path.

Note [Input order]
~~~~~~~~~~~~~~~~~~
The user's graph inputs are the tensor leaves of ``(args, kwargs)`` in the order
``torch.utils._pytree`` flattens them, never in the order the function body
happens to use them. For::

    def fn(carry, x):
        b = x['biases']; w = x['weights']      # body reads x first
        return torch.sin(carry['a'] @ w + b) + carry['b']

    fn({'a': a, 'b': b}, {'weights': w, 'biases': bias})

the inputs are ``carry['a'], carry['b'], x['weights'], x['biases']`` (dicts
flatten in insertion order). Each leaf is named by the parameter it was bound
to plus its key path below it, so the names survive positional and keyword
calls alike. Non-tensor leaves are not graph inputs: they are specialized
into the graph and are part of the cache key, so a different value re-traces.

The user's tensor leaves come last: before them, in this order, are the
*lifted* tensors the function reads without receiving them as tensor leaves
(``flatten_inputs``'s ``lifted``): the traced module's own parameters, then its
buffers; tensors reached through closure cells, globals and defaults, in the
order they are found (Note [Closed-over tensors]); the state of modules passed
as arguments (Note [Module arguments]). ``step(model, x)`` reading the globals
``W`` and ``lin`` takes ``global W, global lin.weight, global lin.bias,
model.weight, model.bias, x`` (Note [Calling convention] runs it).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    TensorGuards,
    is_opaque_reference,
    is_traceable_wrapper_subclass,
)
from aotgrad.errors import CallError, format_error, user_frame_of_function
from aotgrad.signature.descriptors import Inner, Input, PrimalDescriptor
from aotgrad.signature.storage import storage_key
from aotgrad.signature.subclasses import (
    Body,
    Subclasses,
    SubclassMeta,
    inner_tensors,
    meta_of,
    subclass_key,
    take_apart_inputs,
)
from aotgrad.signature.values import Incomparable, TensorInValue, value_key


@dataclass(frozen=True)
class FlatInputs:
    """The user's call, flattened: which leaves are graph inputs and what each one is."""

    # Tree structure of the user's ``(args, kwargs)``.
    spec: pytree.TreeSpec
    # All leaves of ``(args, kwargs)``; tensor leaves are replaced by ``None``
    # (they are graph inputs), the rest are the specialized constants.
    constants: tuple[Any, ...]
    # Position, among all leaves, of each tensor leaf (the user's graph inputs).
    tensor_positions: tuple[int, ...]
    # One descriptor per graph input: the lifted tensors first, then the user's (Note [Input
    # order]).
    descriptors: tuple[PrimalDescriptor, ...]
    # How many leading graph inputs are lifted: module state, closed-over tensors, module
    # arguments' state.
    num_lifted: int
    # How tensor subclass inputs are taken apart into plain graph inputs (Note [Tensor
    # subclasses]); None when every input is plain. With it, ``descriptors`` and
    # ``num_lifted`` count plain graph inputs, ``tensor_positions`` the user's tensors.
    subclasses: Subclasses | None = None

    def __post_init__(self) -> None:
        expected = self.num_lifted + len(self.tensor_positions)
        if self.subclasses is None and len(self.descriptors) != expected:
            raise AssertionError(f"expected {expected} descriptors, got {len(self.descriptors)}")

    def renamed(self, names: Sequence[str]) -> FlatInputs:
        """The same inputs, the user's tensors named ``names`` (lifted state keeps its names)."""
        user = tuple(Input(path=n) for n in names)
        if len(user) != len(self.tensor_positions):
            raise AssertionError(f"expected {len(self.tensor_positions)} names, got {len(user)}")
        return replace(self, descriptors=(*self.descriptors[: self.num_lifted], *user))

    def unflatten(self, user_tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from the user's graph inputs (lifted state excluded)."""
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, user_tensors, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


def desugar(
    flat: FlatInputs,
    primals: Sequence[torch.Tensor],
    body: Body,
    dynamic_dims: Mapping[int, Sequence[int]] | None,
    split_grads: Mapping[PrimalDescriptor, SubclassMeta] | None = None,
) -> tuple[FlatInputs, list[torch.Tensor], Body]:
    """The call with every subclass input taken apart, and a body that builds them again.

    The result's descriptors name inner tensors (``Inner``), its ``subclasses``
    says how to take a call's inputs apart (Note [Tensor subclasses]). A call
    without subclass inputs is returned unchanged, its body only taking subclass
    outputs apart. ``split_grads``: plain
    inputs with subclass gradients (Note [Subclass gradients of plain inputs]).
    """
    subclasses, inner, body = take_apart_inputs(
        primals, flat.descriptors, body, dynamic_dims, split_grads
    )
    if subclasses is None:
        return flat, inner, body
    descriptors: list[PrimalDescriptor] = []
    num_lifted = 0
    for i, (d, meta) in enumerate(zip(flat.descriptors, subclasses.metas, strict=True)):
        layout = meta or subclasses.split_at(i)
        names = [d] if layout is None else [Inner(of=d, attr=p) for p in layout.paths()]
        descriptors += names
        num_lifted += len(names) if i < flat.num_lifted else 0
    desugared = replace(
        flat, descriptors=tuple(descriptors), num_lifted=num_lifted, subclasses=subclasses
    )
    return desugared, inner, body


def flatten_inputs(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lifted: Sequence[PrimalDescriptor] = (),
) -> tuple[FlatInputs, list[torch.Tensor]]:
    """Flatten a call of ``fn`` into its tensor inputs and their descriptors.

    >>> flat, tensors = flatten_inputs(lambda carry, x: None, ({'a': torch.ones(1)}, 2.0), {})
    >>> [str(d) for d in flat.descriptors], flat.constants
    (["carry['a']"], (None, 2.0))
    """
    names = _argument_names(fn, args, kwargs)
    with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
    if register_dataclasses([leaf for _, leaf in with_paths]):
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
    constants: list[Any] = []
    positions: list[int] = []
    descriptors: list[PrimalDescriptor] = list(lifted)
    tensors: list[torch.Tensor] = []
    for position, (path, leaf) in enumerate(with_paths):
        if isinstance(leaf, torch.Tensor):
            constants.append(None)
            positions.append(position)
            descriptors.append(Input(path=_leaf_name(path, names)))
            tensors.append(leaf)
        else:
            constants.append(leaf)
    flat = FlatInputs(spec, tuple(constants), tuple(positions), tuple(descriptors), len(lifted))
    return flat, tensors


def leaf_names(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The name of every leaf of a call, tensors and non-tensors alike: ``x['weights']``, ``n``."""
    return named_leaves(_argument_names(fn, args, kwargs), args, kwargs)


def named_leaves(names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """``leaf_names`` with the positional arguments named ``names`` (``args[i]`` past them)."""
    names = [*names, *(f"args[{i}]" for i in range(len(names), len(args)))]
    with_paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [_leaf_name(path, names) for path, _ in with_paths]


def _argument_names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """The parameter name each positional argument binds to (``args[i]`` for ``*args``); a
    module's are its ``forward``'s."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins and some C functions have no signature
        return [f"args[{i}]" for i in range(len(args))]
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise CallError(
            format_error(
                f"cannot call {name}{signature} with {len(args)} positional argument(s)"
                f" and keyword(s) {sorted(kwargs)}: {e}",
                user_frame_of_function(fn),
                "Pass the arguments the function declares.",
            )
        ) from None
    names: list[str] = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
        elif parameter.kind == parameter.VAR_POSITIONAL:
            start = len(names)
            names.extend(f"{parameter.name}[{i - start}]" for i in range(start, len(args)))
    return names[: len(args)]


def _leaf_name(path: tuple[Any, ...], names: Sequence[str]) -> str:
    """``(SequenceKey(0), SequenceKey(1), MappingKey('a'))`` → ``x['a']`` if arg 1 is ``x``."""
    in_args, key, *rest = path
    root = names[key.idx] if in_args.idx == 0 else str(key.key)
    return root + pytree.keystr(tuple(rest))


_SCALAR_TYPES = frozenset({int, float, bool, str, type(None)})


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Sequence[Any], Any]:
    """The call's leaves and a hashable structure key; skips pytree for flat positional calls.

    A call of tensors and scalars only, without keywords, has leaves ``args``
    in the same order ``pytree`` would give; its structure key is the count.

    >>> flatten_call((torch.ones(1), 2.0), {})[1]
    2
    >>> leaves, structure = flatten_call(({"a": 1},), {"b": 2})
    >>> leaves, structure == pytree.tree_flatten((({"a": 1},), {"b": 2}))[1]
    ([1, 2], True)
    """
    if not kwargs and all(isinstance(a, torch.Tensor) or type(a) in _SCALAR_TYPES for a in args):
        return args, len(args)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if register_dataclasses(leaves):  # Note [Dataclass arguments]
        leaves, spec = pytree.tree_flatten((args, kwargs))
    return leaves, spec


def call_key(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """What a traced graph is specialized on: tensor metadata and non-tensor values.

    Two calls with equal keys (and equal tree structure) can share one trace.
    """
    return tuple([_tensor_key(x) if isinstance(x, torch.Tensor) else _value_key(x) for x in leaves])


def dynamic_call_key(leaves: Sequence[Any], dims: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """``call_key`` with the dynamic dimensions (``dims[i]`` for leaf ``i``) left out.

    Their sizes are checked by the trace's shape guards instead (Note [Dynamic shapes]).
    A leaf with dynamic dimensions has the fields of ``DYNAMIC_TENSOR_FIELDS``:
    its shape holds ``None`` at each dynamic dimension, and contiguity stands for
    the strides.

    >>> key = dynamic_call_key([torch.ones(8, 4), 2.0], [(0,), ()])
    >>> key[0][1:3], key[1]
    (((None, 4), True), (<class 'float'>, '0x1.0000000000000p+1'))
    """
    keys = []
    for leaf, leaf_dims in zip(leaves, dims, strict=True):
        key = _tensor_key(leaf) if isinstance(leaf, torch.Tensor) else _value_key(leaf)
        if leaf_dims:
            shape = tuple(None if d in leaf_dims else n for d, n in enumerate(leaf.shape))
            key = (key[0], shape, leaf.is_contiguous(), *key[3:])
        keys.append(key)
    return tuple(keys)


def alias_key(leaves: Sequence[Any]) -> tuple[int, ...] | None:
    """Which tensor leaves are the same tensor or share memory: part of the specialization.

    Cheap when no leaf is a view, none repeats and no two share a storage (the common
    case): ``None``. Leaves that share a storage without being views (``x`` and
    ``x.detach()``, ``.data``, ``set_``) are found by their storages' addresses.
    """
    tensors = _plain_tensors(leaves)
    if not _distinct_memory(tensors):
        groups: dict[Any, int] = {}
        return tuple(groups.setdefault(storage_key(t), len(groups)) for t in tensors) + tuple(
            groups.setdefault(("id", id(t)), len(groups)) for t in tensors
        )
    return None


def _plain_tensors(leaves: Sequence[Any]) -> list[torch.Tensor]:
    """The tensor leaves, each subclass replaced by its inner tensors: those are what share
    memory (Note [Inputs sharing memory without a common base])."""
    out: list[torch.Tensor] = []
    for leaf in leaves:
        if type(leaf) in _PLAIN:
            out.append(leaf)
        elif isinstance(leaf, torch.Tensor):
            meta = meta_of(leaf)
            out += [leaf] if meta is None else inner_tensors(leaf, meta)
    return out


def _distinct_memory(tensors: Sequence[torch.Tensor]) -> bool:
    """No tensor is a view, none repeats, no two plain strided ones share a storage."""
    seen = set()
    storages = set()
    for t in tensors:
        if t._is_view() or id(t) in seen:
            return False
        seen.add(id(t))
        if t.layout is torch.strided and type(t) in _PLAIN:
            address = t.untyped_storage().data_ptr()  # 0: no memory (empty, meta)
            if address and address in storages:
                return False
            storages.add(address)
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses: their own storages


class PlainTensorsGuard:
    """Passes leaves exactly when they give the same ``call_key`` as ``leaves`` and no ``alias_key``.

    The per-call fast path (Note [The last entry]). Built from distinct,
    non-view tensors; the fields of ``_tensor_key`` are compared by Dynamo's
    C++ tensor check (type, dispatch keys -- which carry device type and
    layout --, dtype, device index, requires_grad, sizes, strides) plus the
    storage offsets and the alias conditions here.

    >>> x, w = torch.ones(2, 3), torch.ones(3, requires_grad=True)
    >>> guard = PlainTensorsGuard((x, w))
    >>> guard((torch.zeros(2, 3), w)), guard((x, w.detach())), guard((x, x[0])), guard((w, w))
    (True, False, False, False)
    """

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        self._offsets = tuple(t.storage_offset() for t in leaves)
        # One size and one stride list per tensor (the stub's element type is wrong).
        sizes: Any = [list(t.shape) for t in leaves]
        strides: Any = [list(t.stride()) for t in leaves]
        self._check = TensorGuards(
            *leaves, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides
        ).check
        # Several plain strided tensors at offset 0 (the usual call): then so is every call's
        # that passes the C++ check, each one's ``data_ptr`` is its storage's address, and
        # the check is straight-line code (Note [The guard, written out]).
        at_zero = len(leaves) > 1 and all(
            type(t) in _PLAIN and t.layout is torch.strided and not offset
            for t, offset in zip(leaves, self._offsets, strict=True)
        )
        self.passes = _written_out(len(leaves), self._check) if at_zero else self._passes

    def __call__(self, leaves: Sequence[Any]) -> bool:
        return self.passes(leaves)

    def _passes(self, leaves: Sequence[Any]) -> bool:
        if len(leaves) != len(self._offsets) or not self._check(*leaves):
            return False
        for t, offset in zip(leaves, self._offsets):  # noqa: B905 -- lengths checked above
            if t.storage_offset() != offset:
                return False
        if len(leaves) == 1:
            return not leaves[0]._is_view()
        return _distinct_memory(leaves)


# Note [The guard, written out]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The last entry's guard runs on every call (Note [The last entry]); a loop over
# the tensors costs more than the checks in it. For several plain strided tensors
# at offset 0 it is made as straight-line code, for two tensors::
#
#     def passes(leaves):
#         if len(leaves) != 2:
#             return False
#         t0, t1 = leaves
#         if not check(t0, t1):                   # Dynamo's C++ tensor check
#             return False
#         if t0.storage_offset() or t0._is_view() or t1.storage_offset() or t1._is_view():
#             return False
#         a0 = t0.data_ptr()                      # offset 0: the storage's address
#         a1 = t1.data_ptr()
#         return bool(a0 and a1 and len({a0, a1}) == 2) or distinct_memory(leaves)
#
# A tensor with no memory (address 0) or a repeated address leaves the answer to
# ``_distinct_memory``, as for any other guard.
def _written_out(n: int, check: Callable[..., bool]) -> Callable[[Sequence[Any]], bool]:
    tensors = ", ".join(f"t{i}" for i in range(n))
    addresses = ", ".join(f"a{i}" for i in range(n))
    lines = [
        "def passes(leaves):",
        f"    if len(leaves) != {n}:",
        "        return False",
        f"    {tensors}, = leaves",
        f"    if not check({tensors}):",
        "        return False",
        "    if "
        + " or ".join(f"t{i}.storage_offset() or t{i}._is_view()" for i in range(n))
        + ":",
        "        return False",
        *(f"    a{i} = t{i}.data_ptr()" for i in range(n)),
        "    return bool("
        + " and ".join(f"a{i}" for i in range(n))
        + f" and len({{{addresses}}}) == {n}) or distinct_memory(leaves)",
    ]
    names: dict[str, Any] = {"check": check, "distinct_memory": _distinct_memory}
    exec(compile("\n".join(lines) + "\n", f"<aotgrad guard of {n} tensors>", "exec"), names)
    return names["passes"]


# The fields of a tensor's key (``call_key``), in order; and of a tensor with dynamic
# dimensions (``dynamic_call_key``), whose strides are left to the shape guards.
TENSOR_FIELDS = (
    "type",
    "shape",
    "stride",
    "storage offset",
    "dtype",
    "device",
    "requires_grad",
    "layout",
)
DYNAMIC_TENSOR_FIELDS = tuple("contiguous" if f == "stride" else f for f in TENSOR_FIELDS)


def is_tensor_key(key: Any) -> bool:
    """Is ``key`` a tensor's key (``call_key``, ``dynamic_call_key``), not a value's?"""
    return (
        type(key) is tuple
        and len(key) == len(TENSOR_FIELDS)
        and isinstance(key[0], type)
        and issubclass(key[0], torch.Tensor)
    )


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The metadata a trace specializes on, in the order of ``TENSOR_FIELDS``.

    A tensor subclass's layout field holds its flatten context and inner tensors' metadata
    too (Note [Tensor subclasses]): another DTensor placement traces again.
    """
    if is_traceable_wrapper_subclass(t):
        key = _plain_tensor_key(t)
        return (*key[:-1], (key[-1], subclass_key(t)))
    return _plain_tensor_key(t)


def _plain_tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        type(t),
        t.shape,
        t.stride() if t.layout is torch.strided else None,  # sparse tensors have no strides
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
        t.layout,
    )


def _value_key(value: Any) -> Any:
    """A non-tensor argument's key, by value (Note [Keys of Python values]); refuses what
    cannot be keyed so, or holds tensors pytree does not see."""
    if isinstance(value, torch.nn.Module):  # its state is lifted (Note [Module arguments])
        return module_key(value)
    try:
        return value_key(value)
    except (TensorInValue, Incomparable) as e:
        if is_opaque_reference(value):  # a DeviceMesh Dynamo passes: by identity
            return ("opaque", type(value), id(value))
        if isinstance(e, TensorInValue):
            raise CallError(
                format_error(
                    f"an argument of type {_type_name(value)} holds a tensor (at"
                    f" {e.path or 'the top'}), but it is not a pytree container, so the tensor"
                    " cannot be a graph input: it would be baked into the graph as a constant,"
                    " without gradient",
                    None,
                    "Make it a dataclass or register it with"
                    " torch.utils._pytree.register_pytree_node (or register_dataclass), or"
                    " pass the tensor itself as an argument.",
                )
            ) from None
        raise CallError(
            format_error(
                f"an argument of type {_type_name(value)} holds a {e}, which aotgrad cannot"
                " compare by value; aotgrad specializes the graph on every non-tensor"
                " argument and must tell when it changes",
                None,
                "Pass plain Python values (numbers, strings, tuples, dicts, dataclasses), or"
                " close over the object instead of passing it.",
            )
        ) from None


def module_key(module: torch.nn.Module) -> tuple[Any, ...]:
    """A module argument's key: its identity (Note [Module arguments])."""
    return ("module", type(module), id(module))


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


# Note [Dataclass arguments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dataclass instance among the arguments is flattened into its fields, as
# ``torch.utils._pytree.register_dataclass`` would: aotgrad registers its type
# the first time it sees one (once per type, for the whole process, exactly
# what the user would do by hand). ``f(Batch(x=t, scale=2.0))`` then has the
# input ``batch.x`` and the constant ``2.0`` instead of an opaque leaf.


def register_dataclasses(leaves: Sequence[Any]) -> bool:
    """Register the types of unregistered dataclass instances among ``leaves`` as pytrees.

    True when any was registered: flatten again (Note [Dataclass arguments]).
    """
    registered = False
    for leaf in leaves:
        cls = type(leaf)
        if dataclasses.is_dataclass(leaf) and cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
            registered = True
    return registered
