"""Checks of the joint graph, the artifact capture hands to partition (Note [Stage checks]).

Entry point: :func:`check_joint`. The graph-level checks (:func:`check_graph`) serve the
partition's checker too (``partition/checks.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NoReturn

import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad._torch_compat import FakeTensor, FunctionalTensor
from aotgrad.capture.analyses.collectives import COLLECTIVE_KEY
from aotgrad.capture.graph import JointGraph
from aotgrad.errors import InvariantError
from aotgrad.signature.printing import DESC_KEY

# Note [Stage checks]
# ~~~~~~~~~~~~~~~~~~~
# With ``check=True`` on the options (default: the environment variable
# ``AOTGRAD_CHECKS=1``, read when the options are made, i.e. once per call of
# a frontend), the pipeline (``aotgrad.pipeline``) walks each stage's artifact
# at its boundary, as JAX's
# ``check_jaxpr`` does after a pass. The per-call fast path runs no check: the
# checks run when a specialization is captured (the create_graph backward's
# capture too, under its first order's options). Compilation has no check of its
# own: it hands the checked graphs to the user's compilers as they are. A
# broken invariant is an aotgrad bug and raises ``InvariantError``, naming the
# stage, the node and the invariant. The invariants, after capture (the
# ``JointGraph``, ``check_joint``) and after partition (the ``Partitioned``,
# ``check_partitioned``):
#
#   lint         each graph passes ``torch.fx.Graph.lint()`` (uses after defs,
#                one output node, get_attr targets that exist);
#   descriptor   every placeholder and output has a descriptor (``meta["desc"]``);
#   signature    those descriptors are the ``Signature``'s, in number and order:
#                joint placeholders = forward inputs + backward inputs, joint
#                outputs = forward outputs + backward outputs (none without a
#                backward); the forward and backward graphs match their halves
#                one for one;
#   saved        the saved values are, by name and in one order, the forward's
#                outputs in ``saved_in_forward``, the backward's placeholders in
#                ``saved_in_backward`` and the signature's ``Saved`` descriptors;
#   constant     no fake or functional tensor is a constant of a graph (a
#                get_attr target or a tensor among a node's arguments): it would
#                leak the trace's tensors into the compiled code;
#   collectives  each collective of the joint graph is one node (no copy of its
#                call); the forward and backward run the joint's collectives each
#                once, in the joint's order (Note [Collectives], rule 2);
#   bytes        each saved value's ``nbytes`` is the bytes of its node's storage
#                and ``Partitioned.saved_bytes`` is the bytes of the saved nodes'
#                distinct storages (Note [Counting bytes]).
#
# Worked example: for ``(x @ w).sin().sum()`` the forward returns
# ``(sum_1, x, w, mm)`` and its signature says ``Output(path=''), Saved(name='x'),
# Saved(name='w'), Saved(name='mm')``. A partitioner that forgot to hand ``mm``
# to the backward (and its descriptor) makes a forward of three outputs, and the
# check reads
#
#   aotgrad check after partition: forward graph, output node output: signature:
#   expected 4 output descriptors, got 3. This is an aotgrad bug ...


def check_joint(joint: JointGraph) -> None:
    """Raise :class:`InvariantError` where ``joint`` breaks an invariant (Note [Stage checks]).

    >>> import torch, aotgrad
    >>> joint = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True)).partitioned.joint
    >>> check_joint(joint)
    >>> del next(iter(joint.gm.graph.nodes)).meta["desc"]
    >>> check_joint(joint)
    Traceback (most recent call last):
    ...
    aotgrad.errors.InvariantError: aotgrad check after capture: joint graph, placeholder x: descriptor: expected a descriptor, got none. ...
    """
    signature = joint.signature
    grads = signature.backward_outputs if signature.has_backward else ()  # none: no grads
    check_graph(
        "capture",
        "joint graph",
        joint.gm,
        [*signature.forward_inputs, *signature.backward_inputs],
        [*signature.forward_outputs, *grads],
    )
    seen: dict[int, str] = {}
    for node in joint.gm.graph.nodes:
        call = node.meta.get(COLLECTIVE_KEY)
        if node.op != "call_function" or call is None:
            continue
        if id(call) in seen:
            fail(
                "capture",
                f"joint graph, node {node.name}",
                "collectives",
                f"each collective call once (node {seen[id(call)]} runs it)",
                "a second node for it",
            )
        seen[id(call)] = node.name


def check_graph(
    stage: str,
    name: str,
    gm: fx.GraphModule,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
) -> None:
    """Lint, descriptors matching ``inputs`` and ``outputs``, no fake constant."""
    try:
        gm.graph.lint()
    except Exception as error:  # fx raises RuntimeError, or AssertionError for some cases
        fail(stage, name, "lint", "a graph torch.fx.Graph.lint() accepts", str(error))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        if node.meta.get(DESC_KEY) is None:
            fail(stage, f"{name}, placeholder {node.name}", "descriptor", "a descriptor", "none")
    got_inputs = [n.meta[DESC_KEY] for n in placeholders]
    _check_descriptors(stage, f"{name}, placeholders", "input", list(inputs), got_inputs)
    output = gm.graph.output_node()
    descs = output.meta.get(DESC_KEY)
    values = output.args[0]
    count = len(values) if isinstance(values, list | tuple) else 1
    where = f"{name}, output node {output.name}"
    if descs is None:
        fail(stage, where, "descriptor", f"{count} output descriptors", "none")
    if len(descs) != count:
        fail(stage, where, "descriptor", f"one descriptor per output ({count})", str(len(descs)))
    _check_descriptors(stage, where, "output", list(outputs), list(descs))
    for node in gm.graph.nodes:
        _check_constants(stage, name, gm, node)


def _check_descriptors(
    stage: str, where: str, what: str, expected: list[Any], got: list[Any]
) -> None:
    if len(expected) != len(got):
        fail(
            stage,
            where,
            "signature",
            f"{len(expected)} {what} descriptors",
            f"{len(got)}",
        )
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            fail(stage, where, "signature", f"{what} {i} to be {want!r}", repr(have))


def _check_constants(stage: str, name: str, gm: fx.GraphModule, node: fx.Node) -> None:
    values: list[Any] = list(pytree.tree_leaves((node.args, node.kwargs)))
    if node.op == "get_attr":
        parts = str(node.target).split(".")
        root: Any = gm
        values.append(functools.reduce(lambda v, part: getattr(v, part, None), parts, root))
    for value in values:
        if isinstance(value, FakeTensor | FunctionalTensor):
            fail(
                stage,
                f"{name}, node {node.name}",
                "constant",
                "no fake or functional tensor as a constant",
                f"a {type(value).__name__} {tuple(value.shape)}",
            )


def fail(stage: str, node: str, invariant: str, expected: str, got: str) -> NoReturn:
    raise InvariantError(stage, node, invariant, expected, got)


__all__ = ["check_graph", "check_joint", "fail"]
