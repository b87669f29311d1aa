"""Which outputs' autograd paths reach which inputs: where a gradient is ``None``.

Note [Gradients no output reaches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eager's ``backward`` only visits the autograd graph upstream of the tensors it
is called on: a leaf no path reaches keeps ``.grad is None``; a leaf a path
reaches gets a tensor, zeros if that is what flows. A compiled function is one
``autograd.Function`` node whose backward must return a gradient per input,
so, without more, every input gets one (zeros where nothing flowed):

    def f(a, c):            # a pooler whose output the loss ignores, say
        return a * 2, c * 3
    out, unused = f(a, c)
    out.sum().backward()    # eager: a.grad = 2s, c.grad is None

Capture records, per graph input, the cotangents whose outputs have a path to
it in the autograd graph the trace built (the same graph eager builds: the
trace runs the user's code under autograd; an output's new value of a
mutated input counts like any output). At a call, the runtime's Function
learns which of its outputs got no gradient (``set_materialize_grads(False)``
hands it ``None`` for them), runs the backward graph with zeros in their
place, and returns ``None`` for every input that only those outputs reach
(Note [Missing cotangents] in ``runtime/function.py``). Above:

    a: reached by cotangent 0 (a * 2)     c: reached by cotangent 1 (c * 3)
    backward called with (g0, None)   ->  grads (2 * g0, None)

A path counts even where the values on it are zeros (``x.floor()``): eager
gives zeros there too. A reentrant checkpoint's node has edges only to the
region's inputs, yet its backward (its own ``autograd.backward``) reaches the
parameters the region uses; so an input also counts as reached by a cotangent
when the joint graph computes its gradient from that cotangent
(``computed_from``). One case still differs from eager: a path through a
custom ``autograd.Function`` whose backward returns ``None`` for an input,
when a second output also reaches that input and only the first gets a
gradient (eager: ``None``, aotgrad: zeros).

>>> a = torch.ones(2, requires_grad=True)
>>> c = torch.ones(2, requires_grad=True)
>>> [bin(m) for m in reaching_masks([a * 2, c.sin(), a + c], [a, c])]
['0b101', '0b110']
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.autograd.graph import GradientEdge


def reaching_masks(
    targets: Sequence[torch.Tensor], sources: Sequence[GradientEdge | torch.Tensor]
) -> list[int]:
    """Per source, a bitmask of the targets with an autograd path to it (bit ``j``: target ``j``).

    A source is a gradient edge, or a leaf tensor (its gradient accumulator).
    """
    edge_at = {_edge_key(s): k for k, s in enumerate(sources)}
    masks = [0] * len(sources)
    node_masks: dict[Any, int] = {}
    for j, t in enumerate(targets):
        if t.grad_fn is None:  # a leaf: the target is the source itself, or nothing
            k = edge_at.get(("leaf", id(t)))
        else:
            node_masks[t.grad_fn] = node_masks.get(t.grad_fn, 0) | 1 << j
            k = edge_at.get(_child_key(t.grad_fn, t.output_nr))
        if k is not None:
            masks[k] |= 1 << j
    for node in _upstream_first(list(node_masks)):
        mask = node_masks.get(node, 0)
        for child, output_nr in node.next_functions:
            if child is None:
                continue
            node_masks[child] = node_masks.get(child, 0) | mask
            k = edge_at.get(_child_key(child, output_nr))
            if k is not None:
                masks[k] |= mask
    return masks


def _edge_key(source: GradientEdge | torch.Tensor) -> tuple[Any, int]:
    if isinstance(source, torch.Tensor):
        return ("leaf", id(source))
    return _child_key(source.node, source.output_nr)


def _child_key(node: Any, output_nr: int) -> tuple[Any, int]:
    variable = getattr(node, "variable", None)  # a leaf's gradient accumulator
    return ("leaf", id(variable)) if variable is not None else (node, output_nr)


def _upstream_first(roots: list[Any]) -> list[Any]:
    """Autograd nodes reachable from ``roots``, each before every node it passes gradients to."""
    order: list[Any] = []
    seen: set[Any] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack: list[tuple[Any, Iterator[Any]]] = [(root, _children(root))]
        while stack:
            node, children = stack[-1]
            for child in children:
                if child not in seen:
                    seen.add(child)
                    stack.append((child, _children(child)))
                    break
            else:
                stack.pop()
                order.append(node)
    order.reverse()
    return order


def _children(node: Any) -> Iterator[Any]:
    return (child for child, _ in node.next_functions if child is not None)


def computed_from(
    graph: fx.Graph, sources: Sequence[fx.Node], results: Sequence[fx.Node | None]
) -> list[int]:
    """Per result, a bitmask of the sources it is computed from (bit ``k``: ``sources[k]``)."""
    masks = {node: 1 << k for k, node in enumerate(sources)}
    for node in graph.nodes:
        mask = masks.get(node, 0)
        for value in node.all_input_nodes:
            mask |= masks.get(value, 0)
        if mask:
            masks[node] = mask
    return [0 if r is None else masks.get(r, 0) for r in results]


__all__ = ["computed_from", "reaching_masks"]
