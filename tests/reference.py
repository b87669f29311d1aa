"""PyTorch's AOTAutograd partitioners, measured the way aotgrad reports its own plans.

Shared by the tests and ``bench/remat.py``. A backward graph's saved values are
its non-cotangent placeholders (unique storages, inputs included, like
``Partitioned.saved_bytes``); its recomputed ops are the nodes that do not
depend on a cotangent, costed with aotgrad's per-op FLOP table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from functorch.compile import aot_function, aot_module, make_boxed_func
from torch.multiprocessing.reductions import StorageWeakRef

from aotgrad.ops.table import flops


def backward_stats(gm: fx.GraphModule) -> tuple[int, int]:
    """(saved bytes over unique storages, recompute FLOPs) of a PyTorch backward graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = {n for n in placeholders if n.name.startswith("tangents")}
    storages: dict[Any, int] = {}
    for node in placeholders:
        val = node.meta.get("val")
        if node not in tangents and isinstance(val, torch.Tensor):
            storages[StorageWeakRef(val.untyped_storage())] = val.untyped_storage().nbytes()
    downstream = set(tangents)
    recompute = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
            continue
        args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
        recompute += flops(node.target, args, node.meta.get("val"))
    return sum(storages.values()), recompute


def pytorch_stats(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    partition: Callable[..., Any],
    budget: float = 1.0,
) -> tuple[int, int]:
    """(saved bytes, recompute FLOPs) of PyTorch's ``aot_module`` with ``partition`` at ``budget``."""
    found: list[tuple[int, int]] = []

    def bw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        found.append(backward_stats(gm))
        return make_boxed_func(gm)

    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_module(
            copy.deepcopy(model),
            fw_compiler=lambda gm, example_inputs: make_boxed_func(gm),
            bw_compiler=bw_compiler,
            partition_fn=partition,
        )
        out = compiled(*args)
        (out[0] if isinstance(out, tuple) else out).backward()
    return found[-1]


class WithLoss(torch.nn.Module):
    """``loss(model(*args, **kwargs))`` as one module: what both partitioners are given."""

    def __init__(self, model: Callable[..., Any], loss: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss(self.model(*args, **kwargs))


def pytorch_loss_stats(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    partition: Callable[..., Any],
) -> tuple[int, int]:
    """(saved bytes, recompute FLOPs) of PyTorch's ``aot_function`` with ``partition`` on
    ``model(*args, **kwargs)``, its first output differentiated with a ones cotangent.

    Parameters and buffers are inputs (as aotgrad's), and the model runs as if compiled, as
    aotgrad's capture runs it (transformers' mask code takes its traceable branch only then:
    Note [Capture is compiling])."""
    from aotgrad.capture.tracing.joint import compiling

    found: list[tuple[int, int]] = []

    def bw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        found.append(backward_stats(gm))
        return make_boxed_func(gm)

    model = copy.deepcopy(model)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def fn(state: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        return torch.func.functional_call(model, state, args, kwargs)

    compiled = aot_function(
        fn,
        fw_compiler=lambda gm, example_inputs: make_boxed_func(gm),
        bw_compiler=bw_compiler,
        partition_fn=partition,
    )
    with compiling():
        out = compiled(state, args, kwargs)
    first = out[0] if isinstance(out, tuple | list) else out
    first.backward(torch.ones_like(first))
    return found[-1]


def mincut_saved_bytes(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[int, int]:
    """(aotgrad's ``"mincut"`` saved bytes, PyTorch's ``min_cut_rematerialization_partition``
    saved bytes) on ``model(*args, **kwargs)``: unique storages the backward receives, inputs
    and parameters included, on both sides."""
    from functorch.compile import min_cut_rematerialization_partition

    import aotgrad

    kwargs = kwargs or {}
    theirs, _ = pytorch_loss_stats(model, args, kwargs, min_cut_rematerialization_partition)
    ours = aotgrad.trace(model, *args, partition="mincut", **kwargs).partitioned
    return ours.saved_bytes, theirs
