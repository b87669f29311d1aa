"""``Traced.save`` and ``aotgrad.load``'s :class:`Loaded`: one call's graphs in a file, run again
without tracing; :class:`TraceView`, what a ``Traced`` and a ``Loaded`` both show.

Note [Loaded module state]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A file holds graphs, never tensors' values: a module's parameters and buffers
are graph inputs named by their descriptors (``Param("0.weight")``,
``Buffer("1.running_mean")``). ``aotgrad.load(path, module=model)`` reads them
from ``model`` by those names at every call, as the traced module itself would,
so an optimizer step or a ``load_state_dict`` between calls is seen, and an
in-place buffer update (BatchNorm's running statistics) lands in ``model``::

    t = aotgrad.trace(model, x); t.save("m.aotgrad")
    f = aotgrad.load("m.aotgrad", module=model)   # another process: a model built alike
    f(x)          # reads model.get_parameter("0.weight") ... now, not at load time

A file of a module loaded without one, a module missing a name, a tensor
whose shape, stride, dtype, device or requires_grad differs from the traced
one's, or a module whose flags and values the capture read differ from the
file's (``model.eval()`` after a trace in training mode: ``closure
self.training: True at capture, False now``; the file keeps those values as
stable text, ``store/keys.py``) is a ``CallError``, never a call on other
inputs than the graphs expect (Note [A Traced keeps to its capture]). Python
values a function (not a module) read are held by its graphs, and cannot be
read back without the function: they are not checked.
Closed-over tensors and globals cannot be read back by name: such a trace is
not saved (``StoreError``); pass the tensor as an argument instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad.capture.analyses.autocast import autocast_state
from aotgrad.errors import CallError, StoreError, format_error, user_frame_from_stack
from aotgrad.partition import Partitioned, RecomputedOp
from aotgrad.partition.saved import SavedValue
from aotgrad.runtime import CompiledGraphs, compile_graphs, higher_order_of
from aotgrad.runtime.function import Plan
from aotgrad.runtime.higher_order import Driver
from aotgrad.runtime.straight_line import Step, straight_line
from aotgrad.runtime.transforms import refuse_transforms_on
from aotgrad.settings import Options, compilers, only_nop
from aotgrad.signature import FlatInputs, Signature
from aotgrad.signature.arguments import ArgumentLayout, tensor_text
from aotgrad.signature.descriptors import Buffer, Param
from aotgrad.signature.flatten import named_leaves
from aotgrad.signature.lifting import State, StateKey
from aotgrad.store.encoding import MALFORMED, decode, dump_structure, encode
from aotgrad.store.format import Read, Stored, StoredGraph, dumps, with_values, write_atomically
from aotgrad.store.keys import Unkeyable, stable_text

TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool]


def save_traced(
    path: str | os.PathLike[str],
    *,
    partitioned: Partitioned,
    plan: Plan,
    autocast: Any,
    layout: ArgumentLayout,
    state: StateKey,
) -> None:
    """Write one trace's graphs to ``path`` (Note [Files run no code], Note [Loaded module state])."""
    flat = partitioned.joint.inputs
    _refuse_unloadable(flat, partitioned.signature)
    try:
        constants = encode(list(flat.constants))
    except StoreError as e:
        raise StoreError(
            f"the traced call has an argument a graph file cannot hold ({e}); only tensors,"
            " numbers, strings, None and containers of them can be saved"
        ) from None
    call = {
        "spec": dump_structure(flat.spec, match_only=True),
        "constants": constants,
        "tensor_positions": list(flat.tensor_positions),
        "num_lifted": flat.num_lifted,
        "autocast": encode(autocast),
        "requires_grad": list(partitioned.joint.requires_grad),
        "layout": layout.to_data(),  # Note [Calls matched by argument name]
        "values": _values_data(state),  # Note [Loaded module state]
    }
    write_atomically(path, dumps(Stored(partitioned=partitioned, plan=plan, call=call)))


def _refuse_unloadable(flat: FlatInputs, signature: Signature) -> None:
    if flat.subclasses is not None:
        raise StoreError("a trace with tensor subclass inputs cannot be saved yet")
    for d in flat.descriptors[: flat.num_lifted]:
        if not isinstance(d, Param | Buffer):
            raise StoreError(
                f"the trace reads {d}, which a loaded file could not find again by name"
                " (Note [Loaded module state]); pass that tensor as an argument to save it"
            )
    if len(signature.forward_inputs) != len(flat.descriptors):
        raise StoreError(
            "a trace whose graph takes extra inputs (random state) cannot be saved yet"
        )


class TraceView:
    """One trace's graphs and what aotgrad decided, as ``Traced`` (traced in this process) and
    :class:`Loaded` (read from a file) both show them."""

    def _trace(self) -> Partitioned | Read:
        raise NotImplementedError

    @property
    def forward(self) -> fx.GraphModule:
        return _module(self._trace().forward)

    @property
    def backward(self) -> fx.GraphModule | None:
        backward = self._trace().backward
        return None if backward is None else _module(backward)

    @property
    def signature(self) -> Signature:
        return self._trace().signature

    @property
    def saved(self) -> tuple[SavedValue, ...]:
        return self._trace().saved

    @property
    def recomputed(self) -> tuple[RecomputedOp, ...]:
        return self._trace().recomputed

    def __str__(self) -> str:
        parts = [str(self.signature), "# forward", self.forward.code.strip()]
        if self.backward is not None:
            parts += ["# backward", self.backward.code.strip()]
        return "\n\n".join(parts)


def _module(graph: fx.GraphModule | StoredGraph) -> fx.GraphModule:
    return graph if isinstance(graph, fx.GraphModule) else graph.module()


class Loaded(TraceView):
    """Graphs read from a file: call it like the ``Traced`` that saved them."""

    def __init__(
        self, stored: Read, module: torch.nn.Module | None, options: Options, driver: Driver
    ) -> None:
        self._stored = stored
        call = stored.call
        try:
            # Only ever compared with the caller's (Note [Tree structure in a file]).
            self._spec: Any = call["spec"]
            self._matched: pytree.TreeSpec | None = None
            self._constants = tuple(decode(call["constants"]))
            self._tensor_positions = tuple(int(i) for i in call["tensor_positions"])
            self._autocast = _autocast_of(decode(call["autocast"]))
            num_lifted = int(call["num_lifted"])
            _check_call(self._spec, self._constants, self._tensor_positions)
        except (*MALFORMED, StoreError) as e:
            raise StoreError(f"malformed call description in the graph file: {e}") from None
        try:
            self._layout = ArgumentLayout.from_data(call.get("layout"))
            self._values = _values_of_data(call.get("values"))
        except ValueError as e:
            raise StoreError(f"malformed call description in the graph file: {e}") from None
        self._state_names = _state_names(stored.signature, num_lifted)
        if self._state_names and module is None:
            raise CallError(
                f"these graphs read the parameters and buffers of a module ({num_lifted} tensors,"
                f" first {self._state_names[0][1]!r}): pass it, aotgrad.load(path, module=model)"
                " (Note [Loaded module state])"
            )
        self._module = module
        # Reads the module's flags and values at every call (Note [Loaded module state]).
        self._reader = None if module is None else State(module)
        self._checked: StateKey | None = None
        try:
            self._expected = _expected(stored.forward.values(), stored.forward.steps, call)
        except MALFORMED as e:
            raise StoreError(f"malformed input description in the graph file: {e}") from None
        if len(self._expected) != num_lifted + len(self._tensor_positions):
            raise StoreError("the graph file's forward graph takes another number of inputs")
        if only_nop(options):
            try:  # aotgrad's own code made from the file's checked steps
                self._compiled = compile_stored(stored, options, driver)
            except (*MALFORMED, SyntaxError, MemoryError) as e:
                raise StoreError(f"the graph file's graphs cannot be run: {e}") from None
        else:  # a user's compiler: its errors are the user's to see
            self._compiled = compile_stored(stored, options, driver)

    def _trace(self) -> Read:
        return self._stored

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        refuse_transforms_on(leaves)  # Note [Transforms run the function]
        if spec != self._matched and not self._match(spec):
            try:  # Note [Calls matched by argument name]
                args, kwargs = self._layout.arrange(self._layout.positional, args, kwargs)
            except CallError as e:
                raise _refusal(str(e)) from None
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if not self._match(spec):
                raise _refusal(
                    "the arguments' containers differ from the capture's (a type or a key inside them)"
                )
        for i, (leaf, constant) in enumerate(zip(leaves, self._constants, strict=True)):
            if i not in self._tensor_positions and not _same_value(leaf, constant):
                raise _refusal(
                    f"{self._leaf_name(args, kwargs, i)} is {leaf!r:.40}, and the graphs hold"
                    f" {constant!r:.40} as a constant"
                )
        if autocast_state() != self._autocast:
            raise _refusal(
                f"autocast {_autocast_text(self._autocast)} at capture,"
                f" {_autocast_text(autocast_state())} now (Note [Autocast])"
            )
        self._check_values()
        inputs = [*self._state(), *(leaves[i] for i in self._tensor_positions)]
        self._check(inputs)
        return self._compiled(inputs)

    def _match(self, spec: pytree.TreeSpec) -> bool:
        """The arguments are structured as those the graphs were saved for (compared as
        data, Note [Tree structure in a file]); remembered, so the next call compares
        ``TreeSpec`` s only."""
        try:
            same = dump_structure(spec, match_only=True) == self._spec
        except StoreError:
            same = False
        if same:
            self._matched = spec
        return same

    def _leaf_name(self, args: tuple[Any, ...], kwargs: dict[str, Any], i: int) -> str:
        names = named_leaves(self._layout.positional, args, kwargs)
        return f"argument {names[i]}" if i < len(names) else f"argument leaf {i}"

    def _check_values(self) -> None:
        """The module's flags and values (``training``) are the capture's (Note [Loaded
        module state]); read again at every call, compared when they changed."""
        if self._reader is None:
            return
        key = self._reader.read().key
        if key is self._checked:
            return
        now = dict(zip(key.labels, key.values, strict=True))
        for label, stored in self._values.items():
            if stored is None or label not in now:  # not kept as text, or not read now
                continue
            value = _value_data(now[label])
            if value != stored:
                change = f"{label}: {_shown(stored)} at capture, {_shown(value)} now"
                if label.endswith(".training"):
                    change = f"a module switched between train() and eval() ({change})"
                raise _refusal(change)
        self._checked = key

    def _state(self) -> list[torch.Tensor]:
        module = self._module
        if module is None:
            return []
        try:
            return [
                module.get_parameter(name) if kind is Param else module.get_buffer(name)
                for kind, name in self._state_names
            ]
        except AttributeError as e:
            raise CallError(
                f"the module passed to aotgrad.load lacks a tensor the graphs read: {e}"
            ) from None

    def _check(self, inputs: Sequence[Any]) -> None:
        descriptors = self.signature.forward_inputs
        for d, x, expected in zip(descriptors, inputs, self._expected, strict=True):
            got = _meta(x) if isinstance(x, torch.Tensor) else None
            if got != expected:
                raise _refusal(f"{d}: {_meta_change(expected, got)}")


def _refusal(what: str) -> CallError:
    return CallError(
        format_error(
            f"this call differs from the one these graphs were saved for: {what}. The graphs"
            " hold the capture's shapes, dtypes, flags and values as constants, and would not"
            " compute what eager computes for this call",
            user_frame_from_stack(),
            "Trace the function again with inputs like these (aotgrad.trace, then save), or"
            " use aotgrad.aot_function, which traces again for each specialization"
            " (Note [A Traced keeps to its capture]).",
        )
    )


_META_FIELDS = ("shape", "stride", "dtype", "device", "requires_grad")


def _meta_change(expected: TensorMeta | None, got: TensorMeta | None) -> str:
    """``dtype torch.float32 != torch.float64 (captured float32[3, 4], got float64[3, 4])``."""
    if expected is None or got is None:
        return f"captured {_meta_text(expected)}, got {_meta_text(got)}"
    field, a, b = next(
        (f, a, b) for f, a, b in zip(_META_FIELDS, expected, got, strict=True) if a != b
    )
    return f"{field} {a} != {b} (captured {_meta_text(expected)}, got {_meta_text(got)})"


def _meta_text(meta: TensorMeta | None) -> str:
    if meta is None:
        return "no tensor"
    shape, _, dtype, device, requires_grad = meta
    return tensor_text(dtype, shape, device, requires_grad)


def _autocast_of(value: Any) -> Any:
    """A file's autocast state, checked: ``(device, dtype)`` pairs (Note [Autocast])."""
    if not isinstance(value, tuple) or not all(
        isinstance(p, tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.dtype)
        for p in value
    ):
        raise StoreError(f"expected the autocast state as (device, dtype) pairs, got {value!r:.80}")
    return value


def _autocast_text(state: Any) -> str:
    if not state:
        return "off"
    return ", ".join(f"{device}/{str(dtype).removeprefix('torch.')}" for device, dtype in state)


def _values_data(state: StateKey) -> dict[str, Any]:
    """The values the capture read (``StateKey``), as data for a file; None where a value has
    no text that is the same in another process (compared nowhere)."""
    return {label: _value_data(v) for label, v in zip(state.labels, state.values, strict=True)}


def _value_data(value: Any) -> Any:
    try:
        return stable_text(value, set())
    except Unkeyable:
        return None


def _values_of_data(data: Any) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError("the values the capture read are not a dict by label")
    return data


def _shown(data: Any) -> str:
    """A value's stable text (``['type builtins.bool', True]``) as the value: ``True``."""
    if isinstance(data, list) and len(data) == 2 and str(data[0]).startswith("type builtins."):
        return repr(data[1])
    return f"{data!r:.60}"


def _check_call(spec: Any, constants: tuple[Any, ...], positions: tuple[int, ...]) -> None:
    """The call's structure has one leaf per constant; the tensors' positions are leaves."""
    if _leaves(spec, 0) != len(constants):
        raise StoreError("the call's structure and its constants do not match")
    if len(set(positions)) != len(positions) or not all(0 <= i < len(constants) for i in positions):
        raise StoreError("the call's tensor positions are not leaves of its structure")


def _leaves(structure: Any, depth: int) -> int:
    """How many leaves a stored structure has (Note [Tree structure in a file])."""
    if structure is None:
        return 1
    if depth > 200 or not (
        isinstance(structure, list) and len(structure) == 3 and isinstance(structure[2], list)
    ):
        raise StoreError(f"malformed stored structure {structure!r:.80}")
    return sum(_leaves(child, depth + 1) for child in structure[2])


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one type, floats bit for bit (Note [Keys of Python values]: ``-0.0``, ``True``)."""
    if type(a) is not type(b):
        return False
    return a.hex() == b.hex() if isinstance(a, float) else bool(a == b)


def _state_names(signature: Signature, num_lifted: int) -> list[tuple[type, str]]:
    names = []
    for d in signature.forward_inputs[:num_lifted]:
        if not isinstance(d, Param | Buffer):
            raise StoreError(f"a graph file's lifted input {d} is not a parameter or buffer")
        names.append((type(d), d.name))
    return names


def _expected(
    values: list[Any], steps: list[Step], call: dict[str, Any]
) -> list[TensorMeta | None]:
    """Each graph input's metadata; the graph's values hold no ``requires_grad``: the call's."""
    metas = [
        _stored_meta(decode(value))
        for value, step in zip(values, steps, strict=True)
        if step.op == "placeholder"
    ]
    requires_grad = call.get("requires_grad")
    if not isinstance(requires_grad, list) or len(requires_grad) != len(metas):
        raise StoreError("the graph file does not say which inputs require grad")
    return [
        None if m is None else (*m[:4], bool(needs))
        for m, needs in zip(metas, requires_grad, strict=True)
    ]


def _stored_meta(value: Any) -> TensorMeta | None:
    if not isinstance(value, list) or len(value) != 6:
        return None
    size, stride, _, dtype, device, requires_grad = value
    if not all(isinstance(x, list) and all(type(n) is int for n in x) for x in (size, stride)):
        raise StoreError(f"malformed tensor description {value!r:.80}")
    return (tuple(size), tuple(stride), dtype, device, requires_grad)


def _meta(t: Any) -> TensorMeta | None:
    if not isinstance(t, torch.Tensor):
        return None
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


def compile_stored(stored: Read, options: Options, driver: Driver) -> CompiledGraphs:
    """Hand loaded graphs to the compilers, as the pipeline's compile stage does. ``nop``
    makes its straight-line code from the steps, with no ``fx`` module (Note [Graphs read
    from a file]); a user's compiler gets the module, with fake values (Note [Values on
    demand]).

    The ``create_graph`` backward (Note [Differentiable backward]), captured by ``driver``
    (the pipeline's ``differentiable_backward_driver``), reads the forward's steps only;
    the ``fx`` modules, their fake values and the signature are built at the first
    ``create_graph`` backward, so a hit that never differentiates twice builds none.
    """
    forward, backward = stored.forward, stored.backward
    if only_nop(options):
        compiled = (
            straight_line(forward.steps),
            None if backward is None else straight_line(backward.steps),
        )
    else:
        compiled = compile_graphs(
            with_values(forward.module()),
            None if backward is None else with_values(backward.module()),
            *compilers(options),
            draws_as_inputs=options.draws_as_inputs,
        )
    higher_order = None
    if backward is not None:

        def prepare() -> tuple[fx.GraphModule, fx.GraphModule, Signature]:
            modules = forward.module(), backward.module()
            for module in modules:
                with_values(module)
            return (*modules, stored.signature)

        higher_order = higher_order_of(forward.steps, None, None, stored.plan, driver, prepare)
    return CompiledGraphs(None, *compiled, plan=stored.plan, higher_order=higher_order)
