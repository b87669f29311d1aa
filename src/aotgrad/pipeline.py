"""The stage sequence, once: signature → capture → partition → compile.

Every frontend (``trace``, ``aot_function``/``aot_module``, the Dynamo backend, ``scan``)
reads its call into a :class:`Traceable` with :func:`signature_stage` and hands it to
:func:`run`, which captures, partitions and compiles it as the ``Options`` say
(``settings.py``). The create_graph backward captures its ``G`` through the same driver
(the runtime is handed it), and ``aotgrad.load`` and the disk cache hand stored graphs the
driver from here (:func:`differentiable_backward_driver`).

>>> import torch
>>> from aotgrad.signature.lifting import State
>>> fn, x = (lambda x: x.sin()), torch.ones(2, requires_grad=True)
>>> state = State(fn)
>>> traceable = signature_stage(fn, fn, (x,), {}, state, state.read(), dims=None)
>>> partitioned, compiled = run(traceable, Options())
>>> [str(d) for d in partitioned.signature.backward_outputs], torch.equal(compiled([x]), x.sin())
(['grad of x'], True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad.capture import JointGraph, capture
from aotgrad.capture.analyses.dynamic import DynamicDims
from aotgrad.capture.checks import check_joint
from aotgrad.capture.user_state.side_effects import Watch
from aotgrad.errors import UnsupportedSubclassError, UserFrame, user_frame_of_function
from aotgrad.ops.core_aten import decomposition_set, refuse_non_core
from aotgrad.partition import Partitioned, partition
from aotgrad.partition.checks import check_partitioned
from aotgrad.partition.draws import lifted_draws
from aotgrad.runtime import CompiledGraphs, compile_partitioned
from aotgrad.settings import Decompositions, Options, collector_paused, compilers
from aotgrad.signature import FlatInputs, flatten_inputs
from aotgrad.signature.flatten import desugar
from aotgrad.signature.lifting import Arguments, Body, Lifted, State
from aotgrad.signature.subclasses import SubclassGradients, SubclassMeta


@dataclass(frozen=True, kw_only=True)
class Traceable:
    """What the capture stage traces: the signature stage's result."""

    # The user's function or module: names the provenance and the user's frames.
    fn: object
    # Runs ``fn`` on the primals (Note [Module state in a trace]).
    body: Body
    flat: FlatInputs
    # The lifted state, then the call's tensors.
    primals: list[torch.Tensor]
    # Symbolic dimensions by ``id`` of the primal (Note [Dynamic shapes]).
    dynamic_dims: Mapping[int, Sequence[int]] | None = None
    # Watches the user's objects (Note [Side effects replayed]).
    effects: Watch | None = None
    # The user's line errors name.
    where: UserFrame | None = None
    # Module paths by ``id`` of the module, as the signature names them (Note [Module paths
    # as the signature names them]); None: relative to ``fn`` when it is a module.
    module_paths: Mapping[int, str] | None = None


def signature_stage(
    fn: Callable[..., Any],
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    state: State,
    lifted: Lifted,
    *,
    dims: DynamicDims | None,
    names: Sequence[str] | None = None,
    effects: Watch | None = None,
    arguments: Arguments = (),
) -> Traceable:
    """The call ``target(*args, **kwargs)`` as capture traces it: flat inputs named after
    ``target``'s parameters (or ``names``), primals, and the body that runs ``fn``.

    ``dims``: per leaf of the call, its dynamic dimensions (Note [Marking dimensions dynamic]).
    ``arguments``: the modules among the call's arguments (Note [Module arguments]), which
    name the modules' paths with the state's roots.
    """
    flat, tensors = flatten_inputs(target, args, kwargs, lifted.descriptors)
    if names is not None:
        flat = flat.renamed(names)
    by_tensor = None
    if dims is not None and any(dims[i] for i in flat.tensor_positions):
        by_tensor = {id(t): dims[i] for i, t in zip(flat.tensor_positions, tensors, strict=True)}
    return Traceable(
        fn=fn,
        body=state.body(fn, lifted, flat),
        flat=flat,
        primals=[*lifted.tensors, *tensors],
        dynamic_dims=by_tensor,
        effects=effects,
        where=user_frame_of_function(fn),
        module_paths=state.module_paths(arguments),
    )


def watch_of(fn: object, arguments: Sequence[tuple[str, Any]] = ()) -> Watch:
    """What watches the user's objects while ``fn`` is captured (Note [Side effects replayed]):
    the function (or module) and the modules among its arguments."""
    root = "self" if isinstance(fn, torch.nn.Module) else "function"
    return Watch([(root, fn), *arguments], where=user_frame_of_function(fn))


def capture_stage(
    traceable: Traceable,
    options: Options,
    on_joint: Callable[[JointGraph], None] | None = None,
) -> JointGraph:
    """Capture the joint graph (tensor subclass primals taken apart first: Note [Tensor
    subclasses]), shown to ``on_joint``, then checked when ``options.check`` (Note [Stage
    checks])."""
    try:
        joint = _capture_desugared(traceable, options, None)
    except SubclassGradients as e:  # Note [Subclass gradients of plain inputs]
        try:
            joint = _capture_desugared(traceable, options, e.layouts)
        except SubclassGradients as again:
            raise UnsupportedSubclassError(str(again)) from None
    if isinstance(options.decompositions, str):  # Note [Core ATen graphs]
        # Note [Random draws as inputs]: the draws leave the compiled forward
        drawn = lifted_draws(joint.gm.graph) if options.draws_as_inputs else set()
        refuse_non_core(joint.gm.graph, options.decompositions, ignore=drawn)
    if on_joint is not None:
        on_joint(joint)
    if options.check:
        check_joint(joint)
    return joint


def _capture_desugared(
    t: Traceable, options: Options, split_grads: Mapping[Any, SubclassMeta] | None
) -> JointGraph:
    """Capture with subclass inputs taken apart, and plain inputs with subclass gradients
    split (Note [Subclass gradients of plain inputs])."""
    flat, primals, body = desugar(t.flat, t.primals, t.body, t.dynamic_dims, split_grads)
    return capture(
        body,
        flat,
        primals,
        # Under no_grad too: an enable_grad() region inside the function makes outputs that
        # require grad (Note [Grad mode regions]); the trace tells, from the outputs.
        with_backward=any(isinstance(p, torch.Tensor) and p.requires_grad for p in primals),
        decompositions=decomposition_table(options),
        where=t.where,
        root=t.fn,
        module_paths=t.module_paths,
        dynamic_dims=t.dynamic_dims,
        tracer=options.tracer,
        effects=t.effects,
        fast=options.fast,
    )


def decomposition_table(options: Options) -> Decompositions | None:
    """The table ``options.decompositions`` gives: a set's, by its name, or the dict itself."""
    named = options.decompositions
    return decomposition_set(named) if isinstance(named, str) else named


def partition_stage(joint: JointGraph, options: Options) -> Partitioned:
    """Choose what the backward saves; checked when ``options.check``."""
    keep = options.keep_inference_input_mutations
    partitioned = partition(joint, options.partition, keep_input_mutations=keep)
    if options.check:
        check_partitioned(partitioned)
    return partitioned


def compile_stage(partitioned: Partitioned, options: Options) -> CompiledGraphs:
    """Hand the graphs to ``options``' compilers; their create_graph backward captures
    through :func:`run` (Note [Differentiable backward])."""
    return compile_partitioned(
        partitioned,
        *compilers(options),
        driver=differentiable_backward_driver(options),
        draws_as_inputs=options.draws_as_inputs,
    )


def differentiable_backward_driver(options: Options) -> Callable[..., CompiledGraphs]:
    """What captures a create_graph backward's ``G`` (Note [Differentiable backward]): the
    driver, under the first order's compilers, tracer, fast path and checks, saving all."""
    g_options = dataclasses.replace(
        options,
        inference_compiler=None,
        partition="save_all",
        # A named set holds for every graph of the call (Note [Core ATen graphs]); a dict
        # was written for the first order's ops.
        decompositions=options.decompositions if isinstance(options.decompositions, str) else None,
        keep_inference_input_mutations=False,
    )
    return functools.partial(_differentiable_backward, g_options)


def _differentiable_backward(
    options: Options,
    body: Body,
    flat: FlatInputs,
    values: list[Any],
    root: object,
    on_joint: Callable[[JointGraph], None],
) -> CompiledGraphs:
    traceable = Traceable(fn=root, body=body, flat=flat, primals=values)
    _, compiled = run(traceable, options, on_joint=on_joint)
    return compiled


@collector_paused()
def capture_and_partition(
    traceable: Traceable,
    options: Options,
    on_joint: Callable[[JointGraph], None] | None = None,
) -> Partitioned:
    """The capture and partition stages: what :func:`run` compiles, and what a report of a
    disk hit traces again without compiling (Note [Reports after a disk hit])."""
    return partition_stage(capture_stage(traceable, options, on_joint), options)


def run(
    traceable: Traceable,
    options: Options,
    on_joint: Callable[[JointGraph], None] | None = None,
) -> tuple[Partitioned, CompiledGraphs]:
    """The driver: capture, partition and compile ``traceable`` as ``options`` say.

    ``on_joint`` sees the joint graph before it is partitioned (the create_graph backward
    marks each node's derivative order there).
    """
    partitioned = capture_and_partition(traceable, options, on_joint)
    return partitioned, compile_stage(partitioned, options)
