"""Record aten ops straight into a graph when the function mutates nothing.

Note [Direct tracing]
~~~~~~~~~~~~~~~~~~~~~
``make_fx`` with functionalization runs every op through three Python
layers: functionalization (unwrap, redispatch, rewrap), the proxy mode
(pytree over the arguments, a ``Proxy`` per value, a snapshot of each
output) and the fake tensor mode. Most functions never mutate anything, and
for them the first two layers only copy: the functional graph holds exactly
the ops that ran. capture therefore first traces with one light mode above
the fake tensor mode that appends each op to an ``fx.Graph`` as it runs::

    user code:      y = (x @ w).relu()
    dispatched:     aten.mm(x, w) -> mm;  aten.relu(mm) -> relu
    recorded:       mm = aten.mm.default(x, w); relu = aten.relu.default(mm)

with the same node names and metadata the proxy mode gives (``val``,
``tensor_meta``, ``seq_nr``, ``original_aten``, the ``custom`` annotations).
The moment anything needs more than recording, the direct trace stops and
the function is traced again the full way (functionalization + ``make_fx``):
a mutable op (``add_``, ``copy_``, ``out=``: only functionalization can turn
those into values), symbolic sizes, a tensor the trace did not create (a
constant closed over), data-dependent ops (``.item()``), or any error (the
full trace reports it in the user's terms). Inputs that share memory skip
the direct trace: which of them an output view comes from (so where its
gradient goes: ``fn(b[0], b)`` returning ``b.t()``) only functionalization
tells, with one storage per input's wrapper. On gpt4 this halves the cost
of tracing; the graphs are identical, which a test checks op by op. The
price of stopping is that the function's Python runs twice (PyTorch's
AOTAutograd always runs it at least twice); it stops early in practice,
at the first in-place op (a BatchNorm's ``num_batches_tracked.add_``).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import set_original_aten_op

from aotgrad._torch_compat import (
    COPY_META_FIELDS,
    OpOverload,
    TorchDispatchMode,
    autograd_would_have_decomposed,
    op_node_name,
    seq_nr_of,
    tensor_metadata,
)
from aotgrad.capture.graph import lazy_module
from aotgrad.capture.recorder import Recorder

_PASS_THROUGH = (torch.ops.prim.device.default,)
_CONSTANTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class NeedsFunctionalization(Exception):
    """The direct trace met something only the full trace handles (Note [Direct tracing])."""


class DirectTracer(TorchDispatchMode):
    """Appends every aten op that runs below autograd to a graph (Note [Direct tracing])."""

    def __init__(
        self,
        recorder: Recorder,
        decompositions: Mapping[Any, Callable[..., Any]] | None,
    ) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.recorder = recorder
        self.decompositions = decompositions or {}
        self._nodes: dict[int, fx.Node] = {}
        self._alive: list[torch.Tensor] = []  # keeps every traced tensor's id unique

    def input(self, t: torch.Tensor) -> None:
        node = self.graph.placeholder(f"arg{len(self._alive)}_1")
        self._copy_context(node)
        self._describe(node, t)
        self._track(t, node)

    def traced(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._nodes

    def finish(self, values: Sequence[torch.Tensor | None], name: str) -> fx.GraphModule:
        node = self.graph.output([self._nodes[id(v)] if v is not None else None for v in values])
        self._copy_context(node)
        return lazy_module(torch.nn.Module(), self.graph, name)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _PASS_THROUGH:
            return func(*args, **kwargs)
        with set_original_aten_op(func):
            return self._record(func, args, kwargs)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not isinstance(func, OpOverload) or func._schema.is_mutable or func in _CONSTANTS:
            raise NeedsFunctionalization(f"{func} is not a functional aten op")
        if torch.Tag.data_dependent_output in func.tags:
            raise NeedsFunctionalization(f"{func} reads tensor data")
        if func in self.decompositions:
            with self:
                out = self.decompositions[func](*args, **kwargs)
            if out is not NotImplemented:  # Note [Random fills keep their layout]
                return out
        if autograd_would_have_decomposed(func, pytree.arg_tree_leaves(*args, **kwargs)):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        node_args, node_kwargs = self._arg(args), self._arg(_without_defaults(func, kwargs))
        self.recorder.note_source()
        self.recorder.note_random(func, args, kwargs)
        out = func(*args, **kwargs)
        name = op_node_name(self.graph, func.overloadpacket.__name__)
        node = self.graph.create_node("call_function", func, node_args, node_kwargs, name=name)
        self._copy_context(node)
        self._output(out, node)
        return out

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self._nodes.get(id(value))
            if node is None:
                raise NeedsFunctionalization("a tensor the trace did not create (a constant)")
            return node
        if isinstance(value, list | tuple):
            return type(value)(self._arg(v) for v in value)
        if isinstance(value, dict):
            return {k: self._arg(v) for k, v in value.items()}
        if isinstance(value, _SYMBOLIC):
            raise NeedsFunctionalization("symbolic sizes")
        return value

    def _output(self, out: Any, node: fx.Node) -> None:
        if isinstance(out, torch.Tensor):
            self._describe(node, out)
            self._track(out, node)
            return
        if not isinstance(out, list | tuple):
            if isinstance(out, _SYMBOLIC):
                raise NeedsFunctionalization("symbolic sizes")
            node.meta["val"] = out
            return
        node.meta["val"] = out
        for i, item in enumerate(out):
            if isinstance(item, torch.Tensor):
                getitem = self.graph.create_node(
                    "call_function", operator.getitem, (node, i), {}, name="getitem"
                )
                self._copy_context(getitem)
                self._describe(getitem, item)
                self._track(item, getitem)
            elif isinstance(item, _SYMBOLIC):
                raise NeedsFunctionalization("symbolic sizes")

    def _describe(self, node: fx.Node, t: torch.Tensor) -> None:
        node.meta["val"] = t
        node.meta["tensor_meta"] = tensor_metadata(t)

    def _track(self, t: torch.Tensor, node: fx.Node) -> None:
        self._nodes[id(t)] = node
        self._alive.append(t)

    def _copy_context(self, node: fx.Node) -> None:
        """The metadata ``torch.fx``'s tracer copies from the current node context."""
        if not fx_traceback.has_preserved_node_meta():
            return
        current = fx_traceback.get_current_meta()
        for key in COPY_META_FIELDS:
            if key in current:
                node.meta[key] = copy.copy(current[key])
        seq_nr = seq_nr_of(node.name)
        if seq_nr is not None:
            node.meta["seq_nr"] = seq_nr


def _without_defaults(func: OpOverload, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword-only arguments equal to their default are left out, as ``make_fx`` records them.

    (An op called from C++, as the backward's are, passes every argument.)
    """
    if not kwargs:
        return kwargs
    defaults = {
        a.name: a.default_value
        for a in func._schema.arguments
        if a.kwarg_only and a.has_default_value()
    }
    return {
        k: v for k, v in kwargs.items() if not (k in defaults and _same_constant(v, defaults[k]))
    }


def _same_constant(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    return type(value) in (bool, int, float, str) and value == default


__all__ = ["DirectTracer", "NeedsFunctionalization"]
