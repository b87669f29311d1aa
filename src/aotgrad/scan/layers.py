"""``scan_layers``: a stack of identical layers run as one scan over their stacked parameters.

Note [Stacked layer parameters]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each parameter of the layers is stacked across them (``torch.stack``, an
autograd op), and the stack is the scan's ``xs``; the body runs layer 0's code
on row ``i`` with ``torch.func.functional_call``. The gradient of the stack
comes back per row, and ``stack``'s backward hands row ``i`` to layer ``i``'s
own parameter, so every ``.grad`` lands where the unrolled loop puts it::

    layers = [L0, L1, L2]                xs = {"fc.weight": stack([L0.fc.weight, L1..., L2...])}
    h = L2(L1(L0(x)))                    h, _ = scan(lambda h, p: (call(L0, p, h), None), x, xs)
    L1.fc.weight.grad                    = grad of xs["fc.weight"][1]

Buffers are stacked too (they get no gradient); a layer that updates a buffer
in place (BatchNorm's running statistics in training) is refused, as any scan
body that mutates its inputs. Layer 0's other attributes (``training``, ``eps``)
are the body's: the layers must agree on them (the structure check compares
module types, names, shapes and dtypes; ``training`` keys the capture).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from aotgrad.api import PartitionArg
from aotgrad.errors import ScanError
from aotgrad.runtime.boxing import Compiler
from aotgrad.scan.loop import ScanFunction


def scan_layers(
    layers: Sequence[nn.Module],
    x: Any,
    *,
    partition: PartitionArg = "save_all",
    checkpoint: bool = False,
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
) -> Any:
    """``x`` through every layer in turn, as one scan over the layers' stacked parameters.

    The layers (an ``nn.ModuleList``) must have layer 0's structure: module types,
    parameter and buffer names, shapes and dtypes; each is called as ``layer(x)`` and
    returns the next ``x`` (same shape and dtype). Gradients land in each layer's
    own ``.grad`` (Note [Stacked layer parameters]). The body is captured once, for
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
    if not layers:
        raise ScanError("scan_layers got no layers\npass at least one layer")
    first = layers[0]
    _check_alike(layers)
    xs = {name: torch.stack([_tensor(layer, name) for layer in layers]) for name in _names(first)}
    options = (partition, checkpoint, fw_compiler, bw_compiler)
    run = _runner(first, options)
    carry, _ = run(x, xs)
    return carry


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    return module.get_parameter(name) if _is_parameter(module, name) else module.get_buffer(name)


def _is_parameter(module: nn.Module, name: str) -> bool:
    return name in dict(module.named_parameters())


def _structure(module: nn.Module) -> list[tuple[str, Any]]:
    """What must agree across layers, in the order a difference is reported."""
    modules = [
        (f"module {name or '(root)'}", type(m).__name__) for name, m in module.named_modules()
    ]
    tensors = [
        (f"{kind} {name}", (tuple(t.shape), t.dtype, t.device))
        for kind, items in (
            ("parameter", module.named_parameters()),
            ("buffer", module.named_buffers()),
        )
        for name, t in items
    ]
    return [*modules, *tensors, ("training", module.training)]


def _check_alike(layers: list[nn.Module]) -> None:
    """Every layer has layer 0's structure; else name the first layer and difference."""
    expected = _structure(layers[0])
    for i, layer in enumerate(layers[1:], start=1):
        got = _structure(layer)
        if got == expected:
            continue
        where = next(
            (
                f"{a[0]}: layer 0 has {a[1]}, layer {i} has {b[1]}"
                for a, b in zip(expected, got, strict=False)
                if a != b
            ),
            f"layer 0 has {len(expected)} modules and tensors, layer {i} has {len(got)}",
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


def _runner(first: nn.Module, options: tuple[Any, ...]) -> ScanFunction:
    """One ``ScanFunction`` per layer 0, options and mode, kept while layer 0 lives."""
    partition, checkpoint, fw_compiler, bw_compiler = options
    by_key = _RUNNERS.setdefault(first, {})
    key = (first.training, *options)
    run = by_key.get(key)
    if run is None:
        run = by_key[key] = ScanFunction(
            _LayerBody(first),
            partition=partition,
            checkpoint=checkpoint,
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            read_environment=False,  # every tensor comes in through xs
        )
    return run
