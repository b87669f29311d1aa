"""G's slice: the part of the backward graph the gradients asked for need, and what it reads.

``HigherOrder`` (``higher_order.py``) builds one ``Slice`` per pair of masks (which primals
require grad, which gradients the engine will use) and captures ``G`` from it: the kept
gradients' nodes, the ops that must run, what ``G`` recomputes from the primals or takes as
saved (Note [Primals in the backward]), and the forward inputs that get zeros through saved
values read as masks (Notes [Only the gradients asked for], [Saved values read as masks]).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad.capture.provenance import META_KEY
from aotgrad.errors import DoubleBackwardError, UserFrame, format_error
from aotgrad.ops.table import (
    draws_random,
    must_run,
    op_name,
    outputs_reached,
    passes_gradient_through,
    passes_no_gradient,
)
from aotgrad.runtime.straight_line import Step
from aotgrad.signature import Signature, storage_key


@dataclass(frozen=True)
class ZeroLink:
    """Forward inputs eager's double backward reaches from one gradient of ``G`` only
    through saved values read as masks (Note [Saved values read as masks])."""

    # The gradient's forward-input position (a position among ``G``'s outputs).
    grad: int
    # Forward inputs ``G`` sends no gradient to from it: they get zeros.
    zeros: tuple[int, ...]
    # Every forward input the masks came from: under ``create_graph`` the zeros are a
    # function of them, as eager's are.
    reached: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Slice:
    """What ``G`` reads and computes for one set of primals requiring grad and one set of
    gradients asked for (Note [Only the gradients asked for])."""

    # Forward-input positions whose gradient ``G`` computes; None for every other input.
    grads: tuple[int, ...]
    # Per gradient, the forward inputs that get zeros from it besides (Note [Saved values
    # read as masks]).
    zero_links: tuple[ZeroLink, ...]
    # Forward-input positions ``G`` takes, in order.
    primals: tuple[int, ...]
    # Saved positions ``G`` recomputes from the primals; the others it takes as saved.
    recomputed: tuple[int, ...]
    constants: tuple[int, ...]
    # Forward inputs changed in place that ``G`` reads but whose value reaches none of its
    # outputs: zeros stand in for them (Note [Primals in the backward]).
    stand_ins: tuple[int, ...]
    graph: fx.GraphModule

    @functools.cached_property
    def linked(self) -> tuple[tuple[int, ...], tuple[ZeroLink, ...]]:
        """The forward inputs ``zero_links`` name, and the links by their positions there."""
        inputs = tuple(sorted({i for link in self.zero_links for i in link.reached}))
        at = {i: k for k, i in enumerate(inputs)}.__getitem__
        local = tuple(
            ZeroLink(n, tuple(map(at, link.zeros)), tuple(map(at, link.reached)))
            for n, link in enumerate(self.zero_links)
        )
        return inputs, local

    def zeros(self, i: int) -> torch.Tensor:
        """The stand-in for forward input ``i``."""
        node = graph_placeholders(self.graph)[self.primals.index(i)]
        val = node.meta["val"]
        return torch.zeros(tuple(val.shape), dtype=val.dtype, device=val.device)


def changed_input(what: str) -> DoubleBackwardError:
    return DoubleBackwardError(
        format_error(
            f"create_graph=True needs the value input {what} had when the compiled function"
            " was called, to differentiate its gradient again, but the function changed that"
            " input in place (Note [Primals in the backward]).",
            None,
            f"Clone {what} before changing it inside the function first, or change"
            " it outside the compiled function, after the backward.",
        )
    )


def value_meta(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    return (
        tuple(v.shape),
        tuple(v.stride()),
        v.storage_offset(),
        v.dtype,
        v.device,
        v.requires_grad,
        v.is_leaf,
    )


def storage_sharing(values: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """Per value, the first value that is it and the first sharing its memory: a capture
    specializes on both (one cotangent passed for two outputs, a saved view of a primal)."""
    same: dict[int, int] = {}
    storages: dict[Any, int] = {}
    found = []
    for k, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            found.append((k, k))
            continue
        found.append((same.setdefault(id(v), k), storages.setdefault(storage_key(v), k)))
    return tuple(found)


def _nodes(graph: fx.GraphModule | Sequence[Step]) -> Iterable[Any]:
    """An fx module's nodes, or the steps of a graph read from a file (the same fields)."""
    return graph.graph.nodes if isinstance(graph, fx.GraphModule) else graph


def graph_placeholders(graph: fx.GraphModule | Sequence[Step]) -> list[Any]:
    return [n for n in _nodes(graph) if n.op == "placeholder"]


def num_forward_inputs(forward: fx.GraphModule | Sequence[Step]) -> int:
    """How many inputs the forward graph takes."""
    return len(graph_placeholders(forward))


def graph_outputs(graph: fx.GraphModule | Sequence[Step]) -> list[Any]:
    (output,) = [n for n in _nodes(graph) if n.op == "output"]
    return list(output.args[0])


def ancestors(targets: Sequence[Any], stop: Container[Any] = ()) -> list[Any]:
    """Every node the targets need, themselves included, in no set order; ``stop`` nodes
    and what only they need are left out."""
    seen: dict[Any, None] = {}
    stack = [t for t in targets if isinstance(t, fx.Node | Step)]
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen[node] = None
        stack.extend(node.all_input_nodes)
    return list(seen)


# Note [Primals in the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``G`` recomputes dependent saved values from the primals, so the forward
# keeps the primals the saved values are computed from. Most are saved
# already (a matmul saves its weight): those are not kept twice. The others
# (``extra``) are kept on ``ctx`` with their version counters, not saved:
# a first-order backward never unpacks them, ``saved_tensors_hooks`` (offloading)
# never move them, and the memory report, which counts the saved values, does
# not count them: they are the caller's own tensors (mostly parameters, kept
# alive by the module anyway; an input activation lives as long as the
# outputs' ``grad_fn``).
# ``G`` checks their versions, as autograd checks saved tensors, and refuses an
# input changed in place since the call. For ``f(x) = (x * 2).sin()`` the
# forward saves ``mul``; ``extra = (x,)``.
#
# An input the function changes in place is not kept: the epilogue's
# ``copy_`` would fail the version check of every backward. ``G`` needs one
# only when a saved value that depends on a primal requiring grad is computed
# from it; then there is no faithful value to recompute from, and the
# backward raises ``DoubleBackwardError`` naming the input. For
# ``f(x, n) = x * n.add_(1)`` (``n`` a counter), the saved ``n + 1`` depends
# on no primal requiring grad: ``G`` takes it as saved, and nothing is needed.
# BatchNorm's running statistics are the same: the saved mean and inverse
# standard deviation are computed from the input, not from them.


def build_slice(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    signature: Signature,
    needs_grad: Sequence[bool],
    changed: frozenset[int] = frozenset(),
    wanted: Sequence[bool] | None = None,
) -> Slice:
    """``G``'s graph for these primals requiring grad (Note [Differentiable backward]),
    computing the gradients of the forward inputs in ``wanted`` only (all those requiring grad
    when None: Note [Only the gradients asked for]).

    ``changed``: forward inputs the function changes in place (Note [Primals in the backward]).
    """
    wanted = needs_grad if wanted is None else wanted
    placeholders = graph_placeholders(forward)
    saved = graph_outputs(forward)[signature.saved_in_forward]
    bw_placeholders = graph_placeholders(backward)
    grads = [
        g if w and n else None
        for g, w, n in zip(
            graph_outputs(backward)[signature.grads_in_backward], wanted, needs_grad, strict=True
        )
    ]
    saved_inputs = bw_placeholders[signature.saved_in_backward]
    live = _live(backward, grads)
    read = [n in live for n in saved_inputs]
    seeds = {n: 1 << j for j, n in enumerate(saved_inputs)}
    differentiated = _reaching(_carried(backward, seeds, through_zeros=False), grads)
    depends = _depends_on(
        forward, [p for p, needed in zip(placeholders, needs_grad, strict=True) if needed]
    )
    tensors = [
        isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in saved
    ]
    recomputed = tuple(
        j
        for j in range(len(saved))
        if read[j] and (not tensors[j] or (saved[j] in depends and differentiated >> j & 1))
    )
    # The recompute stops at the saved values no primal requiring grad reaches: ``G`` takes
    # them as saved (a dropout mask).
    boundary = {
        saved[j]: j for j in reversed(range(len(saved))) if tensors[j] and saved[j] not in depends
    }
    needed = ancestors([saved[j] for j in recomputed], stop=boundary)
    _refuse_random(needed)
    reached = {boundary[a] for n in needed for a in n.all_input_nodes if a in boundary}
    constants = tuple(
        j for j in range(len(saved)) if j not in recomputed and (read[j] or j in reached)
    )
    masks = [j for j in constants if saved[j] in depends]  # Note [Saved values read as masks]
    links = _zero_links(forward, backward, signature, needs_grad, grads, masks)
    primals = tuple(i for i, p in enumerate(placeholders) if p in needed)
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for i in primals:
        env[placeholders[i]] = _placeholder(
            graph, f"primal_{placeholders[i].name}", placeholders[i]
        )
    saved_nodes: dict[int, fx.Node] = {}
    for j in constants:
        saved_nodes[j] = _placeholder(graph, f"saved_{bw_placeholders[j].name}", bw_placeholders[j])
    for node, j in boundary.items():
        if j in saved_nodes:
            env[node] = saved_nodes[j]
    cotangents = [
        _placeholder(graph, f"cotangent_{n.name}", n)
        for n in bw_placeholders[signature.cotangents_in_backward]
    ]
    wanted_nodes = set(needed)
    for node in forward.graph.nodes:
        if node in wanted_nodes and node.op != "placeholder":
            env[node] = _copy(graph, root, forward, node, env)
    for j in recomputed:
        saved_nodes[j] = env[saved[j]]
    # The backward's inputs: the saved values, then the cotangents (Note [Positions]).
    env.update((bw_placeholders[j], node) for j, node in saved_nodes.items())
    env.update(zip(bw_placeholders[signature.cotangents_in_backward], cotangents, strict=True))
    # Inputs the backward changes, as they are when it runs: read, never written, by ``G``
    # (Note [State updated by the backward] in ``capture/analyses/backward_state.py``).
    for n in bw_placeholders[signature.state_in_backward]:
        env[n] = _placeholder(graph, f"state_{n.name}", n)
    for node in backward.graph.nodes:
        if node.op != "placeholder" and node.op != "output" and node in live:
            env[node] = _copy(graph, root, backward, node, env)
    graph.output(fx.map_arg(tuple(grads), lambda n: env[n]))
    gm = fx.GraphModule(root, graph, "differentiable_backward")
    links = _without_real_gradients(links, gm, primals)
    stand_ins = tuple(i for i in primals if i in changed)
    for i in stand_ins:
        if needs_grad[i] or _reaches_outputs(gm, primals.index(i)):
            raise changed_input(str(signature.forward_inputs[i]))
    for i in sorted({i for link in links for i in link.reached} & changed):
        raise changed_input(str(signature.forward_inputs[i]))
    return Slice(
        grads=tuple(i for i, g in enumerate(grads) if g is not None),
        zero_links=links,
        primals=primals,
        recomputed=recomputed,
        constants=constants,
        stand_ins=stand_ins,
        graph=gm,
    )


def _reaching(carried: dict[fx.Node, int], grads: Sequence[Any]) -> int:
    """The bits ``carried`` to any of ``grads``."""
    bits = 0
    for g in grads:
        bits |= carried.get(g, 0) if isinstance(g, fx.Node) else 0
    return bits


def _zero_links(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    signature: Signature,
    needs_grad: Sequence[bool],
    grads: Sequence[Any],
    masks: Sequence[int],
) -> tuple[ZeroLink, ...]:
    """Per gradient ``G`` computes, the forward inputs requiring grad that eager's double
    backward reaches through the saved values ``masks`` only: they get zeros (Note [Saved
    values read as masks])."""
    if not masks:
        return ()
    saved = graph_outputs(forward)[signature.saved_in_forward]
    saved_inputs = graph_placeholders(backward)[signature.saved_in_backward]
    edges = _carried(backward, {saved_inputs[j]: 1 << j for j in masks}, through_zeros=True)
    inputs = {p: 1 << i for i, p in enumerate(graph_placeholders(forward)) if needs_grad[i]}
    reached_by = _carried(forward, inputs, through_zeros=True)
    links = []
    for k, g in enumerate(grads):
        read = _reaching(edges, [g])
        bits = 0
        for j in masks:
            if read >> j & 1:
                bits |= reached_by.get(saved[j], 0)
        if bits:
            reached = tuple(i for i in range(len(needs_grad)) if bits >> i & 1)
            links.append(ZeroLink(k, reached, reached))
    return tuple(links)


def _without_real_gradients(
    links: tuple[ZeroLink, ...], gm: fx.GraphModule, primals: tuple[int, ...]
) -> tuple[ZeroLink, ...]:
    """``links`` whose zeros leave out the inputs ``G`` itself sends a gradient to from that
    gradient; those left with none dropped."""
    inputs = {p: 1 << i for i, p in zip(primals, graph_placeholders(gm), strict=False)}
    carried = _carried(gm, inputs, through_zeros=True)
    outputs = graph_outputs(gm)
    kept = []
    for link in links:
        real = _reaching(carried, [outputs[link.grad]])
        zeros = tuple(i for i in link.zeros if not real >> i & 1)
        if zeros:
            kept.append(replace(link, zeros=zeros))
    return tuple(kept)


def _live(backward: fx.GraphModule, grads: Sequence[Any]) -> set[fx.Node]:
    """The backward's nodes the kept ``grads`` need, with every op that must run though
    nothing reads it (an error check, a collective) and what it needs."""
    effects = [n for n in backward.graph.nodes if n.op == "call_function" and must_run(n)]
    return set(ancestors([*grads, *effects]))


def _reaches_outputs(gm: fx.GraphModule, position: int) -> bool:
    """Does placeholder ``position``'s value reach an output (Note [Inputs only some outputs read])?"""
    reached: dict[fx.Node, tuple[int, ...] | None] = {graph_placeholders(gm)[position]: None}
    for node in gm.graph.nodes:
        if node.op == "output":
            return any(n in reached for n in node.all_input_nodes)
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in reached:
            outputs = reached[node.args[0]]
            if outputs is None or node.args[1] in outputs:
                reached[node] = None
            continue
        positions = [k for k, a in enumerate(node.args) if _reads(a, reached)]
        if any(_reads(v, reached) for v in node.kwargs.values()):
            reached[node] = None
        elif positions:
            reached[node] = _outputs_of(node, positions)
    return False


def _reads(arg: Any, reached: dict[fx.Node, Any]) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return any(n in reached for n in found)


def _outputs_of(node: fx.Node, positions: Sequence[int]) -> tuple[int, ...] | None:
    found: set[int] = set()
    for k in positions:
        outputs = outputs_reached(node.target, node.args, k)
        if outputs is None:
            return None
        found.update(outputs)
    return tuple(sorted(found))


def _depends_on(forward: fx.GraphModule, sources: Sequence[fx.Node]) -> set[fx.Node]:
    """Forward nodes a gradient can flow from to one of ``sources`` (themselves included):
    for ``dropout``, the mask is a constant (``_carried``)."""
    return set(_carried(forward, dict.fromkeys(sources, 1), through_zeros=True))


def _carried(
    graph: fx.GraphModule, seeds: dict[fx.Node, int], *, through_zeros: bool
) -> dict[fx.Node, int]:
    """Per node, the bits of the ``seeds`` whose gradient can flow from it (seeds included;
    nodes carrying none left out).

    Not through values that hold no floating point (a mask, indices), nor ops that pass no
    gradient (``empty_like``, ``bernoulli``); without ``through_zeros``, nor arguments PyTorch
    differentiates as zero (``threshold_backward``'s ``self``: ``passes_gradient_through``),
    where autograd's graph still has an edge, which carries zeros.
    """
    carried = dict(seeds)
    for node in graph.graph.nodes:
        if node.op != "call_function" or passes_no_gradient(node.target):
            continue
        bits = 0
        for where, arg in [*enumerate(node.args), *node.kwargs.items()]:
            if through_zeros or passes_gradient_through(node.target, where):
                for read in _nodes_in(arg):
                    bits |= carried.get(read, 0)
        if bits and _can_hold_gradient(node):
            carried[node] = carried.get(node, 0) | bits
    return carried


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found


def _can_hold_gradient(node: fx.Node) -> bool:
    values = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    if not values:  # sizes (a recompute reads them), or no value known: assume it can
        return True
    return any(v.is_floating_point() or v.is_complex() for v in values)


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node


def _copy(
    graph: fx.Graph,
    root: torch.nn.Module,
    source: fx.GraphModule,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
) -> fx.Node:
    if node.op == "get_attr":  # a constant of the graph: the new root holds it too
        name = f"{source.__class__.__name__}_{node.target}".replace(".", "_")
        if not hasattr(root, name):
            setattr(root, name, getattr(source, node.target))  # type: ignore[arg-type]
        copied = graph.get_attr(name)
        copied.meta = dict(node.meta)
        return copied
    return graph.node_copy(node, lambda n: env[n])


def _refuse_random(nodes: Sequence[fx.Node]) -> None:
    """A random op recomputed in ``G`` would draw other numbers: refuse it."""
    for node in nodes:
        if node.op == "call_function" and draws_random(node.target, node.args, node.kwargs):
            raise DoubleBackwardError(
                format_error(
                    f"create_graph=True through a compiled function would recompute the random"
                    f" op {op_name(node.target)}, whose result the gradient depends on through"
                    " a primal requiring grad; it would draw other numbers than the forward"
                    " did (Note [Differentiable backward]).",
                    source_of(node),
                    "Make the random draw outside the compiled function and pass its result in"
                    " (a dropout mask).",
                )
            )


def source_of(node: fx.Node) -> UserFrame | None:
    return getattr(node.meta.get(META_KEY), "source", None)
