"""Random draws as inputs: a forward graph that draws, rewritten as pure tensor math over draws
the host makes with torch, and the program that makes them.

Note [Random draws as inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training step draws: dropout's masks, stochastic depth's keep decisions, attention
dropout. A graph that holds the random op draws from whatever generator runs it; ONNX
Runtime's and IREE's are not torch's, and CPU ``bernoulli`` has no Core ATen decomposition
that draws eager's numbers. So every draw of the forward leaves the graph and becomes an
input, described by a ``Draw`` descriptor, and a small *draw program* of the random ops
alone, run by torch on the host, makes those inputs in eager's order::

    forward(x, w):                                  forward(x, w, bernoulli):   # Draw
        h = mm(x, w)                                    h = mm(x, w)
        e = empty_like(h)                   ->          d = div(bernoulli, 0.9)
        bernoulli = bernoulli.p(e, 0.9)                 return mul(h, d), ...
        d = div(bernoulli, 0.9)
        return mul(h, d), ...                       draws():
                                                        e = empty_strided([4, 8], [8, 1])
                                                        return (bernoulli.p(e, 0.9),)

The draw program runs the very ops the graph held, on empty tensors laid out as their
inputs, in graph order, with the default generator: under ``torch.manual_seed(s)`` a step
uses eager's masks and leaves the generator where eager leaves it (draws do not depend on
when the compute between them runs). A reseed recorded in the function
(Note [Reseeding inside the function]) moves into the draw program, in place. The backward never draws: a
checkpoint's recompute reads the forward's draw (Note [Recomputed random ops]), now an
input the forward saves like any other.

A draw can leave only when its numbers depend on nothing the graph computes: every input
of the random op, through the ops that make it, is read for its layout alone
(``ops/draws.METADATA_ONLY``: ``empty_like``, ``bernoulli.p``'s ``self``, ``rand_like``...).
``bernoulli(probs)``, ``multinomial(softmax(h))`` or ``rrelu``'s noise (drawn only where its
input is negative) read values the graph computes, and are refused, naming the op and the
user's line. An op that draws and computes at once is first split into the two
(``ops/draws.SPLIT_DRAWS``: Note [Dropout split into its draw]).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import ExpandedCodeGen
from aotgrad.capture.analyses.random import MANUAL_SEED
from aotgrad.capture.provenance import node_info
from aotgrad.errors import UnsupportedOpError, format_error
from aotgrad.ops.draws import SPLIT_DRAWS, metadata_only
from aotgrad.ops.table import draws_random, op_name, remove_dead_code
from aotgrad.partition.sizes import is_static
from aotgrad.signature.descriptors import Draw
from aotgrad.signature.printing import DESC_KEY

__all__ = ["Draws", "lift_draws", "lifted_draws"]


@dataclass(frozen=True)
class Draws:
    """The draws a graph takes as its last inputs, and the program that makes them.

    >>> import torch, aotgrad
    >>> from aotgrad.partition.draws import lift_draws
    >>> t = aotgrad.trace(lambda x: torch.nn.functional.dropout(x, 0.5), torch.ones(4, requires_grad=True))
    >>> forward, draws = lift_draws(t.partitioned.forward)
    >>> [str(d) for d in draws.descriptors]
    ['draw bernoulli: aten.bernoulli.p in <lambda>']
    >>> _ = torch.manual_seed(0); mask, = draws()
    >>> _ = torch.manual_seed(0); expected = torch.empty(4).bernoulli_(0.5)
    >>> torch.equal(mask, expected)
    True
    """

    # () -> (*draws,): the random ops alone, on empty tensors laid out as their inputs.
    program: fx.GraphModule
    # What each draw is, in the order of the program's outputs and the graph's last inputs.
    descriptors: tuple[Draw, ...]

    def __call__(self) -> list[torch.Tensor]:
        """Draw, with torch's default generator, what the graph would have drawn."""
        with torch.no_grad():
            return list(self.program())


def lifted_draws(graph: fx.Graph) -> set[fx.Node]:
    """The random nodes of ``graph`` that :func:`lift_draws` takes out; an UnsupportedOpError
    names the first draw that cannot leave it (it reads a value the graph computes)."""
    independent = _independent(graph)
    lifted = set()
    for node in graph.nodes:
        if _draws(node):
            if node.target not in SPLIT_DRAWS:
                _check_liftable(node, independent)
            lifted.add(node)
    return lifted


def lift_draws(gm: fx.GraphModule) -> tuple[fx.GraphModule, Draws | None]:
    """``gm`` with each draw a placeholder after its others, and the program making them; ``gm``
    itself, and None, when it draws nothing (Note [Random draws as inputs])."""
    if not any(_draws(n) or n.target is MANUAL_SEED for n in gm.graph.nodes):
        return gm, None
    graph = _copy(gm.graph)
    for node in list(graph.nodes):
        if _draws(node) and node.target in SPLIT_DRAWS:
            SPLIT_DRAWS[node.target](node)
    independent = _independent(graph)
    program = _Program(gm)
    values: list[fx.Node] = []  # what the graph reads of each draw, in order
    taken: list[fx.Node] = []  # nodes the program now runs, erased from the graph
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is MANUAL_SEED:
            program.copy(node)
            taken.append(node)
        elif _draws(node):
            _check_liftable(node, independent)
            program.copy(node)
            taken.append(node)
            if isinstance(node.meta.get("val"), torch.Tensor):
                values.append(node)
            else:  # several results: the ones read
                for user in node.users:
                    if user.target is operator.getitem:
                        program.copy(user)
                        values.append(user)
    placeholders = []
    last = list(graph.find_nodes(op="placeholder"))[-1:]
    for value in values:
        with graph.inserting_after(last[0]) if last else graph.inserting_before(None):
            placeholder = graph.placeholder(f"drawn_{value.name}")
        placeholder.meta = dict(value.meta)
        value.replace_all_uses_with(placeholder)
        placeholders.append(placeholder)
        last = [placeholder]
    descriptors = [_descriptor(value) for value in values]
    for value in reversed(values):
        if value not in taken:
            graph.erase_node(value)
    for node in reversed(taken):
        graph.erase_node(node)
    kept = []
    for value, placeholder, desc in zip(values, placeholders, descriptors, strict=True):
        if placeholder.users:
            program.output(value)
            placeholder.meta[DESC_KEY] = desc
            kept.append(desc)
        else:  # only another draw read it: the program draws it, the graph does not take it
            graph.erase_node(placeholder)
    for placeholder in placeholders:
        if placeholder.graph is graph:
            _copies_into_empty_dropped(placeholder)
    remove_dead_code(graph)
    result = fx.GraphModule(gm, graph)
    return result, Draws(program.module(), tuple(kept))


# Buffers made only to be written whole: their values are never read.
_EMPTY = frozenset(
    [
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.empty.memory_format,
    ]
)


def _copies_into_empty_dropped(draw: fx.Node) -> None:
    """``copy(empty_like(y), draw)`` read as ``draw`` where both are laid out alike: a strided
    fill (Note [Random fills keep their layout]) copies its draw into a fresh buffer, which the
    draw input already is (and ``empty_strided`` is an op backends refuse)."""
    for user in list(draw.users):
        if (
            user.target is torch.ops.aten.copy.default
            and user.args[1] is draw
            and getattr(user.args[0], "target", None) in _EMPTY
            and _layout(user) == _layout(draw)
        ):
            user.replace_all_uses_with(draw)
            draw.graph.erase_node(user)


def _layout(node: fx.Node) -> tuple[Any, ...] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return (val.shape, val.stride(), val.storage_offset(), val.dtype, val.device)


def _draws(node: fx.Node) -> bool:
    return node.op == "call_function" and draws_random(node.target, node.args, node.kwargs)


def _nodes(value: Any) -> Iterable[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _independent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values depend on no value of the graph's inputs (only on their layouts)."""
    independent: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            independent.add(node)
        elif node.op == "call_function":
            layout_only = metadata_only(node.target)
            read = [a for i, a in enumerate(node.args) if i not in layout_only]
            if all(n in independent for n in _nodes((read, node.kwargs))):
                independent.add(node)
    return independent


def _check_liftable(node: fx.Node, independent: set[fx.Node]) -> None:
    """An UnsupportedOpError unless the host can draw ``node`` before the graph runs."""
    keep = " or keep the random ops in the graph (random='ops'), where only torch draws them."
    if node.kwargs.get("generator") is not None:
        why = "draws from a torch.Generator of its own, which the draw program cannot hand it"
        todo = "Draw from the default generator," + keep
    elif node not in independent:
        layout_only = metadata_only(node.target)
        read = [a for i, a in enumerate(node.args) if i not in layout_only]
        reads = sorted({n.name for n in _nodes((read, node.kwargs)) if n not in independent})
        why = (
            f"draws numbers that depend on values the graph computes ({', '.join(reads)}),"
            " which the host cannot draw before the graph runs"
        )
        todo = (
            "Draw on a tensor's layout alone and compute with the draw (torch.rand_like(probs)"
            " < probs for torch.bernoulli(probs): other numbers than eager's bernoulli)," + keep
        )
    elif any(
        isinstance(v, torch.Tensor) and not is_static(v)
        for n in (node, *_nodes(node.args))
        for v in [n.meta.get("val")]
    ):
        why = "draws a tensor of symbolic size, which the draw program cannot lay out"
        todo = "Trace with static sizes (no dynamic=True or aotgrad.dynamic marks)," + keep
    else:
        return
    raise UnsupportedOpError(
        format_error(
            f"random draws as inputs (Note [Random draws as inputs]): {op_name(node.target)} {why}",
            node_info(node).source if "aotgrad" in node.meta else None,
            todo,
        )
    )


def _descriptor(value: fx.Node) -> Draw:
    drawn = value.args[0] if value.target is operator.getitem else value
    assert isinstance(drawn, fx.Node)
    module = node_info(drawn).module if "aotgrad" in drawn.meta else ""
    return Draw(name=value.name, op=op_name(drawn.target), module=module)


def _copy(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = copied.output(copied.graph_copy(graph, env))
    output.meta = dict(graph.output_node().meta)  # the outputs' descriptors
    copied.set_codegen(ExpandedCodeGen())  # descriptors printed (signature/printing.py)
    return copied


class _Program:
    """The draw program, built node by node: each draw with the ops that make its inputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.graph = gm, fx.Graph()
        self.root = torch.nn.Module()
        self.copies: dict[Any, fx.Node] = {}
        self.results: list[fx.Node] = []

    def copy(self, node: fx.Node) -> fx.Node:
        if node in self.copies:
            return self.copies[node]
        if node.op == "get_attr":
            setattr(self.root, str(node.target), getattr(self.gm, str(node.target)))
            new = self.graph.get_attr(str(node.target))
        else:
            layout_only = metadata_only(node.target)
            args = tuple(
                fx.node.map_arg(a, self._layout if i in layout_only else self.copy)
                for i, a in enumerate(node.args)
            )
            kwargs = fx.node.map_arg(dict(node.kwargs), self.copy)
            new = self.graph.call_function(node.target, args, kwargs)  # type: ignore[arg-type]
        new.meta = dict(node.meta)
        self.copies[node] = new
        return new

    def _layout(self, node: fx.Node) -> fx.Node:
        """An empty tensor laid out as ``node``'s value: what a layout-only argument reads."""
        key = ("layout", node)
        if key not in self.copies:
            val = node.meta["val"]
            new = self.graph.call_function(
                torch.ops.aten.empty_strided.default,
                (list(val.shape), list(val.stride())),
                {"dtype": val.dtype, "device": val.device},
            )
            new.meta = {"val": val}
            self.copies[key] = new
        return self.copies[key]

    def output(self, value: fx.Node) -> None:
        self.results.append(self.copy(value))

    def module(self) -> fx.GraphModule:
        self.graph.output(tuple(self.results))
        return fx.GraphModule(self.root, self.graph)
