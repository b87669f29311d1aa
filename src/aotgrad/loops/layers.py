"""``scan_layers``: a stack of identical layers run as one scan over their parameters, as rows.

Note [Layer parameters as rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The layers' parameters and buffers are the scan's ``xs``, given as rows
(``ScanFunction.over_rows``): iteration ``i``'s ``x`` is layer ``i``'s own
tensors, by name, and the body runs layer 0's code on them with
``torch.func.functional_call``. Each layer's tensors are inputs of the loop's
``autograd.Function`` in their own right, so the backward of iteration ``i``
returns its grads to layer ``i``'s parameters directly, where the unrolled
loop puts them, with no ``torch.stack`` (a copy of every parameter per step,
then a ``cat`` of their grads and an ``unbind``) in between::

    layers = [L0, L1, L2]              rows = [{"fc.weight": L0.fc.weight, ...}, {L1's}, {L2's}]
    h = L2(L1(L0(x)))                  h = scan over rows of lambda h, p: (call(L0, p, h), None)
    L1.fc.weight.grad                  = the grad of x['fc.weight'] at iteration 1

Buffers are rows too (they get no gradient); a layer that updates a buffer
in place (BatchNorm's running statistics in training) is refused, as any scan
body that mutates its inputs. Layer 0's other attributes (``training``, ``eps``)
are the body's: the layers must agree on them (the structure check compares
module types, names, shapes and dtypes; ``training`` keys the capture; the plain
attributes layer 0's code reads are compared, Note [Layer settings read]).

Note [Extra arguments of the layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A decoder layer takes more than the hidden state: ``layer(h, attention_mask=m,
position_embeddings=(cos, sin), use_cache=False)``, the same for every layer.
``scan_layers(layers, h, *args, layer_kwargs={...})`` passes them so. Their
tensor leaves join every row, after the parameters: the same tensor objects in
each row, so each iteration reads them as inputs of its own, with no copy, and
autograd sums the N grads it gets for them (a tensor given to the loop N times)
into their ``.grad``, as the unrolled loop does. Their other leaves (``None``,
``bool``, numbers, strings) are constants of the body and key it: another value
is another capture; any other object (a ``DynamicCache``) is refused, since the
body could not see what the layer does to it::

    scan_layers(layers, h, layer_kwargs={"attention_mask": m, "use_cache": False})
    row i = ({"fc.weight": Li.fc.weight, ...}, {"attention_mask": m})
    body(h, row) = call(L0, row[0], h, attention_mask=row[1]["attention_mask"], use_cache=False)

The carry is what the layer returns when that has the carry's structure (a
tensor for a tensor); otherwise, for a tuple, a list or a transformers
``ModelOutput``, its first element, which must have the carry's structure, and
the rest (attention weights, a cache) is dropped: ``(h2, attn) -> h2``. The
scan checks the carry's shape and dtype against ``h``'s, so a layer whose first
output is not the next hidden state is refused, not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from aotgrad.errors import ScanError, format_error, user_frame_from_stack
from aotgrad.loops.loop import ScanFunction
from aotgrad.settings import OPTION_NAMES, Options, options_of, with_option_keywords


def scan_layers(
    layers: Sequence[nn.Module],
    x: Any,
    *args: Any,
    layer_kwargs: Mapping[str, Any] | None = None,
    checkpoint: bool = False,
    **options: Any,
) -> Any:
    """``x`` through every layer in turn, as one scan over the layers' parameters.

    The layers (an ``nn.ModuleList``) must have layer 0's structure: module types,
    parameter and buffer names, shapes and dtypes; each is called as
    ``layer(x, *args, **layer_kwargs)`` and returns the next ``x`` (same shape and
    dtype), or a tuple (or ``ModelOutput``) whose first element is the next ``x``
    (Note [Extra arguments of the layers]). ``args`` and ``layer_kwargs`` (an
    attention mask, position embeddings, ``use_cache=False``) are the same for every
    layer; the layers' keyword arguments go in ``layer_kwargs``, never as keywords of
    ``scan_layers``, whose own keywords are ``checkpoint`` and aotgrad's options
    (``partition``, ...). Gradients land in each layer's own ``.grad`` (Note [Layer
    parameters as rows]) and in the extra tensors that require grad. The body is
    captured once, for any number of layers.

    >>> import torch, aotgrad
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(aotgrad.scan_layers(layers, x), layers[2](layers[1](layers[0](x))))
    True
    >>> aotgrad.scan_layers(layers, x).sum().backward()
    >>> layers[1].weight.grad.shape
    torch.Size([4, 4])

    A layer with extra arguments, returning a tuple:

    >>> class Gated(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(4, 4)
    ...     def forward(self, h, gate, scale=1.0):
    ...         out = self.fc(h) * gate * scale
    ...         return out, out.abs().mean()  # (hidden state, dropped)
    >>> gated = torch.nn.ModuleList(Gated() for _ in range(3))
    >>> gate = torch.rand(4, requires_grad=True)
    >>> h = aotgrad.scan_layers(gated, x, gate, layer_kwargs={"scale": 0.5})
    >>> want = x
    >>> for layer in gated:
    ...     want = layer(want, gate, scale=0.5)[0]
    >>> torch.allclose(h, want)
    True
    >>> h.sum().backward(); gate.grad.shape
    torch.Size([4])
    """
    layers = list(layers)
    extras = _Extras.of(args, layer_kwargs)
    run, body = _function(layers, extras, checkpoint, options)
    read = [_Layer.of(layer) for layer in layers]
    _check_alike(layers, read)
    rows = [layer.row if extras.empty else (layer.row, extras.tensors) for layer in read]
    carry, _ = run.over_rows(x, rows)
    # After the run: the settings read by every capture so far, this call's included
    # (a refusal discards the run's results, which nothing else has seen).
    _check_settings(read, body.settings_read)
    return carry


def scan_layers_function(
    layers: Sequence[nn.Module],
    *args: Any,
    layer_kwargs: Mapping[str, Any] | None = None,
    checkpoint: bool = False,
    **options: Any,
) -> ScanFunction:
    """The :class:`ScanFunction` :func:`scan_layers` runs for ``layers`` with these
    extra arguments (their values that are not tensors) and options.

    Its ``traced`` is one layer's graphs, captured once for every layer; its inputs are
    the carry, then the layer's parameters and buffers as that iteration's ``x``
    (``x[0]['fc.weight']`` with extra arguments, whose tensors are ``x[1]['attention_mask']``,
    ``x[1]['position_embeddings[0]']``, ``x[1]['args[0]']``).

    >>> import torch, aotgrad
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    >>> _ = aotgrad.scan_layers(layers, torch.randn(2, 4))
    >>> body = aotgrad.scan_layers_function(layers)
    >>> body.captures, [str(d) for d in body.traced.signature.forward_inputs]
    (1, ['carry', "x['weight']", "x['bias']"])
    """
    return _function(list(layers), _Extras.of(args, layer_kwargs), checkpoint, options)[0]


def _function(
    layers: list[nn.Module], extras: _Extras, checkpoint: bool, options: dict[str, Any]
) -> tuple[ScanFunction, _LayerBody]:
    if not layers:
        raise ScanError("scan_layers got no layers\npass at least one layer")
    unknown = [name for name in options if name not in OPTION_NAMES]
    if unknown:
        raise TypeError(
            f"scan_layers() got an unexpected keyword argument {unknown[0]!r}; its keywords are"
            f" layer_kwargs, checkpoint and aotgrad's options ({', '.join(OPTION_NAMES)})\npass"
            f" the layers' own keyword arguments as layer_kwargs={{{unknown[0]!r}: ...}}"
        )
    return _runner(layers[0], extras, checkpoint, options_of(options, "scan_layers"))


# Values an extra argument may hold besides tensors: constants of the body, keying it.
_CONSTANTS = (
    type(None),
    bool,
    int,
    float,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


@dataclass(frozen=True, kw_only=True)
class _Extras:
    """The arguments every layer gets besides the carry (Note [Extra arguments of the layers])."""

    # The tensor leaves of ``(args, kwargs)`` by name (``attention_mask``,
    # ``position_embeddings[0]``, ``args[1]``): a part of every row, naming its inputs.
    tensors: dict[str, torch.Tensor]
    # The other leaves, by position among all leaves: constants of the body.
    constants: tuple[tuple[int, type, Any], ...]
    spec: pytree.TreeSpec
    # No extra arguments: rows are the layers' tensors alone, as before.
    empty: bool

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> _Extras:
        kwargs = dict(kwargs or {})
        if not all(isinstance(k, str) for k in kwargs):
            raise ScanError("scan_layers' layer_kwargs must have string keys (argument names)")
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
        tensors: dict[str, torch.Tensor] = {}
        constants = []
        for i, (path, leaf) in enumerate(with_paths):
            if isinstance(leaf, torch.Tensor):
                name = _name(path)
                if name in tensors:
                    raise ScanError(
                        f"scan_layers' extra arguments name two tensors {name}: a positional"
                        " one and a keyword one\nrename the keyword argument"
                    )
                tensors[name] = leaf
            elif isinstance(leaf, _CONSTANTS):
                constants.append((i, type(leaf), leaf))
            else:
                where = _where(path)
                raise ScanError(
                    f"scan_layers' extra argument {where} is a {type(leaf).__name__}; the"
                    " layers' extra arguments may hold tensors, None, booleans, numbers and"
                    " strings only, as the same value for every layer, since the scanned body"
                    f" cannot see what a layer does to another object\npass {where}=None (for a"
                    " cache: use_cache=False), or run the layers in a Python loop"
                )
        return _Extras(tensors=tensors, constants=tuple(constants), spec=spec, empty=not with_paths)

    @property
    def key(self) -> Any:
        """What the body closes over: another key, another body."""
        return (self.spec, self.constants)

    def describe(self) -> str:
        """``(gate, scale=0.5)``: the tensors by name, the constants with their values."""
        count = len(self.constants) + len(self.tensors)
        paths = [
            p
            for p, _ in pytree.tree_flatten_with_path(
                pytree.tree_unflatten(list(range(count)), self.spec)
            )[0]
        ]
        constants = {i: value for i, _, value in self.constants}
        parts = [
            f"{_name(path)}={constants[i]!r}" if i in constants else _name(path)
            for i, path in enumerate(paths)
        ]
        return f"({', '.join(parts)})"

    def call_arguments(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with ``tensors`` where the tensor leaves of these names were."""
        constants = {i: value for i, _, value in self.constants}
        given = iter([tensors[name] for name in self.tensors])
        leaves = [
            constants[i] if i in constants else next(given)
            for i in range(len(self.constants) + len(self.tensors))
        ]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), kwargs


def _name(path: tuple[Any, ...]) -> str:
    """``args[1]``, ``attention_mask`` or ``position_embeddings[0]``: a row entry's name."""
    if path[0] == pytree.SequenceKey(0):
        return f"args{pytree.keystr(path[1:])}"
    return f"{path[1].key}{pytree.keystr(path[2:])}"


def _where(path: tuple[Any, ...]) -> str:
    """``args[1]`` or ``layer_kwargs['past_key_values']``, from a flattening path."""
    head, rest = path[0], pytree.keystr(path[1:])
    return f"args{rest}" if head == pytree.SequenceKey(0) else f"layer_kwargs{rest}"


@dataclass(frozen=True, kw_only=True)
class _Layer:
    """One layer, read in one walk: its row of tensors and what must agree across layers."""

    # The layer's parameters, then its buffers, by qualified name: one row of the scan.
    row: dict[str, torch.Tensor]
    # What must agree with layer 0, in the order a difference is reported.
    structure: list[tuple[str, Any]]
    # The layer's modules by path, itself as "": where its settings are read.
    modules: dict[str, nn.Module]

    @staticmethod
    def of(layer: nn.Module) -> _Layer:
        modules, params, buffers, by_path = [], [], [], {}
        for prefix, m in layer.named_modules():
            by_path[prefix] = m
            modules.append((f"module {prefix or '(root)'}", type(m).__name__))
            params += [
                (f"{prefix}.{n}" if prefix else n, t) for n, t in m.named_parameters(recurse=False)
            ]
            buffers += [
                (f"{prefix}.{n}" if prefix else n, t) for n, t in m.named_buffers(recurse=False)
            ]
        tensors = [(f"parameter {n}", _meta(t)) for n, t in params]
        tensors += [(f"buffer {n}", _meta(t)) for n, t in buffers]
        return _Layer(
            row=dict([*params, *buffers]),
            structure=[*modules, *tensors, ("training", layer.training)],
            modules=by_path,
        )


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


def _check_alike(layers: list[nn.Module], read: list[_Layer]) -> None:
    """Every layer has layer 0's structure; else name the first layer and difference."""
    expected = read[0].structure
    for i, (layer, got) in enumerate(zip(layers, read, strict=True)):
        if got.structure == expected:
            continue
        where = next(
            (
                f"{a[0]}: layer 0 has {a[1]}, layer {i} has {b[1]}"
                for a, b in zip(expected, got.structure, strict=False)
                if a != b
            ),
            f"layer 0 has {len(expected)} modules and tensors, layer {i} has {len(got.structure)}",
        )
        raise ScanError(
            f"scan_layers needs layers with identical structure; layer {i}"
            f" ({type(layer).__name__}) differs from layer 0: {where}\nrun the differing layers"
            " outside scan_layers, or make them alike"
        )


class _LayerBody:
    """``(h, row) -> carry of (layer0 with row's tensors)(h, *extras), None``; holds the
    layer weakly (Note [Extra arguments of the layers])."""

    def __init__(self, layer: nn.Module, extras: _Extras) -> None:
        self._layer = weakref.ref(layer)
        self.extras = extras
        self.__name__ = f"{type(layer).__name__}_layer"
        # The plain attributes of layer 0's modules its captures read, as (module, name)
        # (Note [Layer settings read]).
        self.settings_read: set[tuple[str, str]] = set()

    def __call__(self, h: Any, row: Any) -> tuple[Any, None]:
        layer = self._layer()
        if layer is None:
            raise AssertionError("expected the layer of a live scan_layers call, got a dead one")
        params: dict[str, torch.Tensor] = row
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if not self.extras.empty:
            params, tensors = row
            args, kwargs = self.extras.call_arguments(tensors)
        with _settings_recorded(layer, self.settings_read):
            out = torch.func.functional_call(layer, params, (h, *args), kwargs)
        return _carry_of(out, h, layer), None


def _carry_of(out: Any, h: Any, layer: nn.Module) -> Any:
    """The layer's result if it has ``h``'s structure, else its first element (Note [Extra
    arguments of the layers])."""
    structure = pytree.tree_structure(h)
    if pytree.tree_structure(out) == structure:
        return out
    first: Any = None
    if isinstance(out, (tuple, list)) and out:
        first = out[0]
    elif callable(getattr(out, "to_tuple", None)):  # a transformers ModelOutput
        values = out.to_tuple()
        first = values[0] if values else None
    if first is not None and pytree.tree_structure(first) == structure:
        return first
    raise ScanError(
        f"scan_layers' layer {type(layer).__name__} returned {type(out).__name__}, which is"
        " neither the next hidden state (the structure of the x given to scan_layers) nor a"
        " tuple whose first element is\nmake the layer return the next hidden state first"
    )


# Note [Layer settings read]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The body runs layer 0's code for every layer, so a plain attribute that differs
# between layers (an ``eps``, a per-layer ``sliding_window``, GPT-2's
# ``attn.scaling``, which ``scale_attn_by_inverse_layer_idx`` divides by
# ``layer_idx + 1``) would
# silently be layer 0's everywhere. Comparing every attribute would refuse every
# transformers stack, whose ``self_attn.layer_idx`` differs by design but is read
# only with a cache. So the capture records which plain attributes (numbers,
# booleans, strings, None, tuples of them) of layer 0's modules the layer's code
# reads (their classes are swapped, during the capture only, for subclasses whose
# ``__getattribute__`` records), and every call compares those across the layers:
#
#     Llama, no cache: reads self_attn.scaling, .num_key_value_groups, ... (equal): runs
#     GPT2, scale_attn_by_inverse_layer_idx: reads attn.scaling (0.25, 0.125, ...): refused
#
# The capture is the only run of the layer's Python code, so what it did not read
# no iteration reads.

_PLAIN = (type(None), bool, int, float, complex, str)


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


_RECORDING: dict[type, type] = {}
# Per module being recorded: its path in layer 0 and the sets its reads go to, one per
# capture under way (two threads may capture the same layer 0 at once).
_RECORDED: dict[int, list[tuple[str, set[tuple[str, str]]]]] = {}


def _recording(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` recording reads of plain instance attributes."""
    if cls not in _RECORDING:
        base: Any = cls

        def __getattribute__(self: Any, name: str) -> Any:
            value = base.__getattribute__(self, name)
            if not name.startswith("_") and name != "training":
                own = object.__getattribute__(self, "__dict__")
                if name in own and _plain(value):
                    for prefix, into in _RECORDED.get(id(self), ()):
                        into.add((prefix, name))
            return value

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
        sub.__qualname__, sub.__module__ = cls.__qualname__, cls.__module__
        _RECORDING[cls] = sub
    return _RECORDING[cls]


@contextlib.contextmanager
def _settings_recorded(layer: nn.Module, into: set[tuple[str, str]]) -> Iterator[None]:
    """Records into ``into`` the plain attributes ``layer``'s modules read meanwhile."""
    modules = list(layer.named_modules())
    for prefix, m in modules:
        _RECORDED.setdefault(id(m), []).append((prefix, into))
        m.__class__ = _recording(type(m))
    try:
        yield
    finally:
        for _, m in modules:
            m.__class__ = m.__class__.__mro__[1]
            recording = _RECORDED[id(m)]  # this capture's entry, by identity of its set
            del recording[next(i for i, (_, s) in enumerate(recording) if s is into)]
            if not recording:
                del _RECORDED[id(m)]


def _check_settings(layers: list[_Layer], read: set[tuple[str, str]]) -> None:
    """Every plain attribute layer 0's code read is the same on every layer."""
    missing = object()
    for prefix, name in sorted(read):
        first = vars(layers[0].modules[prefix]).get(name, missing)
        for i, layer in enumerate(layers[1:], start=1):
            value = vars(layer.modules[prefix]).get(name, missing)
            if value is missing or type(value) is not type(first) or value != first:
                where = f"{prefix}.{name}" if prefix else name
                got = "nothing" if value is missing else repr(value)
                raise ScanError(
                    f"scan_layers runs layer 0's code for every layer, and that code reads"
                    f" {where}, which is {first!r} on layer 0 but {got} on layer {i}"
                    f" ({type(layer.modules['']).__name__}) (Note [Layer settings read])\nrun the layers"
                    " in a Python loop, or give them equal settings"
                )


_RUNNERS: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[ScanFunction, _LayerBody]]] = (
    weakref.WeakKeyDictionary()
)


def _runner(
    first: nn.Module, extras: _Extras, checkpoint: bool, options: Options
) -> tuple[ScanFunction, _LayerBody]:
    """One ``ScanFunction`` (and its body) per layer 0, extras' constants, options and mode,
    kept while layer 0 lives."""

    key = (first.training, extras.key, checkpoint, options)

    def make() -> tuple[ScanFunction, _LayerBody]:  # every tensor comes in through xs
        body = _LayerBody(first, extras)
        run = _LayerScan(body, first, key, checkpoint=checkpoint, options=options)
        return run, body

    try:
        by_key = _RUNNERS.setdefault(first, {})
        return by_key.get(key) or by_key.setdefault(key, make())
    except TypeError:  # unhashable options: no reuse
        return make()


class _LayerScan(ScanFunction):
    """The scan of one layer 0, extras, checkpoint, options and mode: says, before its first
    run, which runs of that layer 0 there were and how they differ."""

    def __init__(
        self, body: _LayerBody, first: nn.Module, key: Any, *, checkpoint: bool, options: Options
    ) -> None:
        super().__init__(body, checkpoint=checkpoint, read_environment=False, options=options)
        self._first, self._key, self._extras = weakref.ref(first), key, body.extras

    def _not_captured(self) -> str:
        first = self._first()
        runs = [] if first is None else list(_RUNNERS.get(first, {}).items())
        ran = [(key, body.extras) for key, (run, body) in runs if run.captures]
        if not ran:
            return format_error(
                "scan_layers has not run these layers yet: one layer's graphs are captured at"
                " the first scan_layers call",
                user_frame_from_stack(),
                "Call aotgrad.scan_layers(layers, x, ...) first (or call this ScanFunction),"
                " then read .traced.",
            )
        differences = "; ".join(self._differences(key, extras) for key, extras in ran[:3])
        return format_error(
            "scan_layers ran these layers, but not with what scan_layers_function was given:"
            f" {differences}",
            user_frame_from_stack(),
            "Give scan_layers_function the extra arguments (the same structure and non-tensor"
            " values), checkpoint and options the scan_layers call had, with the layers in the"
            " same training mode.",
        )

    def _differences(self, ran: Any, extras: _Extras) -> str:
        """How this scan's key differs from a run's: ``(training, extras, checkpoint, options)``."""
        (training, extras_key, checkpoint, options), (t, e, c, o) = self._key, ran
        parts = []
        if training != t:
            mode = {True: "training", False: "eval"}
            parts.append(f"the layers are in {mode[training]} mode here, {mode[t]} in the scan")
        if extras_key != e:
            parts.append(
                f"extra arguments {self._extras.describe()} here, {extras.describe()} in the scan"
            )
        if checkpoint != c:
            parts.append(f"checkpoint={checkpoint} here, {c} in the scan")
        if options != o:
            names = [
                f.name
                for f in dataclasses.fields(options)
                if getattr(options, f.name) != getattr(o, f.name)
            ]
            parts.append(f"options differ from the scan's: {', '.join(names)}")
        return ", ".join(parts)


with_option_keywords(scan_layers)
with_option_keywords(scan_layers_function)
