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
module types, names, shapes and dtypes; ``training`` keys the capture).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from aotgrad.errors import ScanError
from aotgrad.loops.loop import ScanFunction
from aotgrad.pipeline import Options, options_of, with_option_keywords


def scan_layers(
    layers: Sequence[nn.Module],
    x: Any,
    *,
    checkpoint: bool = False,
    **options: Any,
) -> Any:
    """``x`` through every layer in turn, as one scan over the layers' parameters.

    The layers (an ``nn.ModuleList``) must have layer 0's structure: module types,
    parameter and buffer names, shapes and dtypes; each is called as ``layer(x)`` and
    returns the next ``x`` (same shape and dtype). Gradients land in each layer's
    own ``.grad`` (Note [Layer parameters as rows]). The body is captured once, for
    any number of layers.

    >>> import torch, aotgrad
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(aotgrad.scan_layers(layers, x), layers[2](layers[1](layers[0](x))))
    True
    >>> aotgrad.scan_layers(layers, x).sum().backward()
    >>> layers[1].weight.grad.shape
    torch.Size([4, 4])
    """
    layers = list(layers)
    run = scan_layers_function(layers, checkpoint=checkpoint, **options)
    read = [_Layer.of(layer) for layer in layers]
    _check_alike(layers, read)
    carry, _ = run.over_rows(x, [layer.row for layer in read])
    return carry


def scan_layers_function(
    layers: Sequence[nn.Module], *, checkpoint: bool = False, **options: Any
) -> ScanFunction:
    """The :class:`ScanFunction` :func:`scan_layers` runs for ``layers`` with these options.

    Its ``traced`` is one layer's graphs, captured once for every layer; its inputs are
    the carry, then the layer's parameters and buffers as that iteration's ``x``.

    >>> import torch, aotgrad
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    >>> _ = aotgrad.scan_layers(layers, torch.randn(2, 4))
    >>> body = aotgrad.scan_layers_function(layers)
    >>> body.captures, [str(d) for d in body.traced.signature.forward_inputs]
    (1, ['carry', "x['weight']", "x['bias']"])
    """
    layers = list(layers)
    if not layers:
        raise ScanError("scan_layers got no layers\npass at least one layer")
    return _runner(layers[0], checkpoint, options_of(options, "scan_layers"))


@dataclass(frozen=True, kw_only=True)
class _Layer:
    """One layer, read in one walk: its row of tensors and what must agree across layers."""

    # The layer's parameters, then its buffers, by qualified name: one row of the scan.
    row: dict[str, torch.Tensor]
    # What must agree with layer 0, in the order a difference is reported.
    structure: list[tuple[str, Any]]

    @staticmethod
    def of(layer: nn.Module) -> _Layer:
        modules, params, buffers = [], [], []
        for prefix, m in layer.named_modules():
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
    """``(h, row) -> (layer0 with row's tensors)(h), None``; holds the layer weakly."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = weakref.ref(layer)
        self.__name__ = f"{type(layer).__name__}_layer"

    def __call__(self, h: Any, row: dict[str, torch.Tensor]) -> tuple[Any, None]:
        layer = self._layer()
        if layer is None:
            raise AssertionError("expected the layer of a live scan_layers call, got a dead one")
        return torch.func.functional_call(layer, row, (h,)), None


_RUNNERS: weakref.WeakKeyDictionary[nn.Module, dict[Any, ScanFunction]] = (
    weakref.WeakKeyDictionary()
)


def _runner(first: nn.Module, checkpoint: bool, options: Options) -> ScanFunction:
    """One ``ScanFunction`` per layer 0, options and mode, kept while layer 0 lives."""

    def make() -> ScanFunction:  # every tensor comes in through xs: read nothing else
        body = _LayerBody(first)
        return ScanFunction(body, checkpoint=checkpoint, read_environment=False, options=options)

    key = (first.training, checkpoint, options)
    try:
        by_key = _RUNNERS.setdefault(first, {})
        return by_key.get(key) or by_key.setdefault(key, make())
    except TypeError:  # unhashable options: no reuse
        return make()


with_option_keywords(scan_layers)
with_option_keywords(scan_layers_function)
