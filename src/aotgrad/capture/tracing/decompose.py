"""A captured graph decomposed after the fact, its provenance kept (Note [Decomposing a
captured graph]).

>>> import torch, aotgrad
>>> from aotgrad.ops.core_aten import decomposition_set
>>> t = aotgrad.trace(torch.nn.functional.silu, torch.ones(2, requires_grad=True))
>>> gm = decompose_graph(t.backward, decomposition_set("core_aten"))
>>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
['aten.sigmoid.default', 'aten.mul.Tensor', 'aten.sub.Tensor', 'aten.mul.Tensor', 'aten.add.Tensor', 'aten.mul.Tensor']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from aotgrad._torch_compat import OpOverload
from aotgrad.capture.analyses.random import faithful_decompositions
from aotgrad.capture.tracing.fake import EagerViewsFakeMode
from aotgrad.errors import ConfigError, UnsupportedOpError
from aotgrad.ops.table import reads_strides

__all__ = ["decompose_graph"]

# Note [Decomposing a captured graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``traced.export(decompositions="core_aten")`` gives Core ATen programs of a trace captured
# with the default table: each graph (forward, backward, joint) is run again, node by node,
# by an ``fx.Interpreter`` under ``make_fx(decomposition_table=table)`` on fake tensors of its
# placeholders' sizes, strides and dtypes. Every node ``make_fx`` creates while one original
# node runs is that node's decomposition, and takes its metadata (``meta["aotgrad"]``: phase,
# ``seq_nr``, module, source line; everything but the new ``val``)::
#
#     forward, captured:     silu = aten.silu(x)                    seq_nr 0, "silu", line 3
#     forward, decomposed:   sigmoid = aten.sigmoid(x)              seq_nr 0, "silu", line 3
#                            mul = aten.mul(x, sigmoid)             seq_nr 0, "silu", line 3
#     backward, captured:    silu_backward = aten.silu_backward(g, x)             seq_nr 0
#     backward, decomposed:  sigmoid, mul, sub, mul, add, mul                     seq_nr 0
#
# Placeholders keep their names, order and metadata (descriptors included), and the output
# node its own, so the Signature still names every input and output by position: the graphs'
# calling convention is the captured one. The re-trace runs on fake tensors (no data is read)
# of static sizes (export refuses symbolic ones before).
#
# Every original node's decomposed value must be what the captured graph assumed of it,
# since the ops after it (and the other graph, for a saved value) were captured against
# that: its size and dtype (else a ConfigError naming the table's entry), and its layout. A
# decomposition may lay out its result otherwise than eager's kernel (GPT's attention:
# ``_scaled_dot_product_flash_attention_for_cpu``'s decomposition; a later ``view`` of such a
# value fails, an ``as_strided`` would read other elements), so such a value is copied into
# a tensor of the captured strides (``empty_strided`` + ``copy``, both core).
# A layout no such copy gives (overlapping strides: an ``expand``), and a value at another
# storage offset when the graph has an ``as_strided``, are refused.
#
# Random ops keep what they draw: the table goes through ``faithful_decompositions``, so a
# random op that draws stays as it is (Note [Core ATen graphs]: ``bernoulli.p`` on CPU is then
# refused by name). A decomposition that writes in place would make the graph non-functional;
# there is no functionalization in this re-trace, so such a graph is refused, never returned.


def decompose_graph(gm: fx.GraphModule, table: Mapping[Any, Callable[..., Any]]) -> fx.GraphModule:
    """``gm`` with every op ``table`` decomposes replaced by its decomposition (Note
    [Decomposing a captured graph]); ``gm``'s placeholders need static sizes."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    interpreter = _Retrace(gm)
    with EagerViewsFakeMode(allow_non_fake_inputs=True):  # capture's: eager's view strides
        inputs = [_fake_like(node) for node in placeholders]
        traced = make_fx(interpreter.run_flat, decomposition_table=faithful_decompositions(table))(
            *inputs
        )
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new_placeholders = list(traced.graph.find_nodes(op="placeholder"))
    for old, new in zip(placeholders, new_placeholders, strict=True):
        placeholder = graph.placeholder(old.name, type_expr=old.type)
        _inherit(placeholder, old, new.meta)
        env[new] = placeholder
    graph.output(graph.graph_copy(traced.graph, env))
    graph.output_node().meta = dict(gm.graph.output_node().meta)
    graph.eliminate_dead_code()
    _refuse_writes(graph)
    graph.lint()
    return fx.GraphModule(traced, graph)


class _Retrace(fx.Interpreter):
    """Runs ``gm`` under ``make_fx``; each node the tracer creates while an original node
    runs inherits that node's metadata."""

    def run_flat(self, *args: Any) -> Any:
        return self.run(*args)

    def run_node(self, n: fx.Node) -> Any:
        mode = get_proxy_mode()
        if mode is None:
            raise AssertionError("expected the re-trace to run under make_fx, got no proxy mode")
        graph = mode.tracer.graph
        last = _last(graph)
        result = super().run_node(n)
        if n.op == "call_function":  # Note [Decomposing a captured graph]: eager's layouts
            captured = n.meta.get("val")
            if isinstance(captured, list | tuple) and isinstance(result, list | tuple):
                kept = [_keep_layout(c, r, n) for c, r in zip(captured, result, strict=True)]
                result = type(result)(kept)
            else:
                result = _keep_layout(captured, result, n)
        for node in _created_after(graph, last):
            _inherit(node, n, node.meta)
        return result


def _keep_layout(captured: Any, value: Any, node: fx.Node) -> Any:
    """``value`` (``node``'s result, decomposed) laid out as ``captured`` (its value at
    capture): copied into a tensor of the captured strides where a decomposition made other
    strides, so every op after it runs on the layout the captured graph assumed."""
    if not isinstance(captured, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    if (value.shape, value.dtype) != (captured.shape, captured.dtype):
        raise ConfigError(
            f"the decomposition of {node.target} in the table gives a tensor of size"
            f" {tuple(value.shape)} and {value.dtype} where the op gives {tuple(captured.shape)}"
            f" and {captured.dtype} (node {node.name}, {_where(node)}); a decomposition must"
            " compute what its op computes: fix or drop that entry of the table"
        )
    if _strides_matter(captured) != _strides_matter(value):
        laid_out = torch.ops.aten.empty_strided.default(
            captured.shape, captured.stride(), dtype=value.dtype, device=value.device
        )
        copied = torch.ops.aten.copy.default(laid_out, value)
        if _strides_matter(copied) != _strides_matter(captured):
            raise UnsupportedOpError(
                f"the decomposition of {node.target} (node {node.name}, {_where(node)}) lays"
                f" its result out with strides {value.stride()}, the captured graph assumed"
                f" {captured.stride()}, and no copy gives that layout; export without"
                " decompositions, or capture with them"
            )
        return copied
    if value.storage_offset() != captured.storage_offset() and _reads_layout(node):
        raise UnsupportedOpError(
            f"the decomposition of {node.target} (node {node.name}, {_where(node)}) gives a"
            " tensor at another storage offset than the captured graph's, and an as_strided"
            " op reads that offset; export without decompositions, or capture with them"
        )
    return value


def _strides_matter(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``t``'s dimensions longer than 1 (the others move nothing)."""
    if t.numel() == 0:
        return ()
    return tuple(s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)


def _reads_layout(node: fx.Node) -> bool:
    return any(reads_strides(n.target) for n in node.graph.nodes)


def _last(graph: fx.Graph) -> fx.Node | None:
    return next(iter(reversed(graph.nodes)), None)


def _created_after(graph: fx.Graph, last: fx.Node | None) -> Iterator[fx.Node]:
    """The nodes appended to ``graph`` after ``last`` (``make_fx`` appends at the end)."""
    for node in reversed(graph.nodes):
        if node is last:
            return
        yield node


# Metadata the re-trace computes for each node; the rest comes from the original node.
_OWN_META = ("val", "tensor_meta")


def _inherit(node: fx.Node, original: fx.Node, traced_meta: Mapping[str, Any]) -> None:
    own = {k: traced_meta[k] for k in _OWN_META if k in traced_meta}
    node.meta = {**{k: v for k, v in original.meta.items() if k not in _OWN_META}, **own}


def _fake_like(node: fx.Node) -> torch.Tensor:
    """A fake tensor of ``node``'s ``meta["val"]`` size, strides, offset, dtype and device."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise AssertionError(f"expected a tensor as {node.name}'s meta['val'], got {val!r}")
    size, stride, offset = tuple(val.shape), val.stride(), val.storage_offset()
    if val.numel() == 0:
        return torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    storage = torch.empty(extent, dtype=val.dtype, device=val.device)
    return storage.as_strided(size, stride, offset)


def _refuse_writes(graph: fx.Graph) -> None:
    """An UnsupportedOpError if a decomposition wrote in place (Note [Decomposing a captured
    graph]): the graphs must stay functional."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            continue
        if target.namespace != "aten" or not target._schema.is_mutable:
            continue
        raise UnsupportedOpError(
            f"a decomposition wrote in place with {target} (node {node.name}, {_where(node)});"
            " the decomposed graph would not be functional. Export without that op's"
            " decomposition, or capture with the table (decompositions= on the trace)"
        )


def _where(node: fx.Node) -> str:
    """The user's line ``node`` came from, as the error messages name it."""
    source = getattr(node.meta.get("aotgrad"), "source", None)
    return f"from {source}" if source is not None else "no user source line"
