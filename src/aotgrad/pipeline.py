"""The stage sequence, once: signature → capture → partition → compile.

Every frontend (``trace``, ``aot_function``/``aot_module``, the Dynamo backend, ``scan``)
reads its call into a :class:`Traceable` with :func:`signature_stage` and hands it to
:func:`run`, which captures, partitions and compiles it as the :class:`Options` say. The
create_graph backward captures its ``G`` through the same driver (the runtime is handed
it), and ``aotgrad.load`` compiles stored graphs with the compilers and driver from here.

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

import contextlib
import dataclasses
import functools
import gc
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aotgrad.capture import JointGraph, capture
from aotgrad.capture.analyses.dynamic import DynamicDims
from aotgrad.capture.checks import check_joint
from aotgrad.capture.tracing.tracers import TracerChoice, check_tracer_choice
from aotgrad.capture.user_state.side_effects import Watch
from aotgrad.errors import (
    ConfigError,
    UnsupportedSubclassError,
    UserFrame,
    user_frame_of_function,
)
from aotgrad.ops.core_aten import check_decomposition_set, decomposition_set, refuse_non_core
from aotgrad.partition import Partitioned, Policy, Strategy, partition
from aotgrad.partition.checks import check_partitioned
from aotgrad.runtime import CompiledGraphs, compile_partitioned
from aotgrad.runtime.boxing import Compiler
from aotgrad.signature import FlatInputs, flatten_inputs
from aotgrad.signature.flatten import desugar
from aotgrad.signature.lifting import Arguments, Body, Lifted, State
from aotgrad.signature.subclasses import SubclassGradients, SubclassMeta

Decompositions = Mapping[Any, Callable[..., Any]]
PartitionFn = Policy
PartitionArg = Strategy

# Options whose default an environment variable gives (and None asks for): its name, default.
_FROM_ENVIRONMENT = {"check": ("AOTGRAD_CHECKS", False), "fast": ("AOTGRAD_FAST", True)}
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def switch(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """An ``AOTGRAD_*`` on/off variable: 1/true/on/yes, 0/false/off/no; unset or empty: ``default``;
    else a ConfigError naming it and the values it takes."""
    text = environ.get(name, "").strip().lower()
    if text and text not in _ON + _OFF:
        raise ConfigError(
            f"{name}={environ[name]!r} is neither on nor off: expected one of"
            f" {', '.join(_ON)} (on) or {', '.join(_OFF)} (off); unset, it is"
            f" {'on' if default else 'off'}"
        )
    return text in _ON if text else default


@dataclass(frozen=True, kw_only=True)
class Options:
    """How a frontend captures and compiles: the keyword options of ``aot_function``, in one place.

    >>> Options(partition="mincut", dynamic=True).cache_limit
    8
    """

    # Compile the forward graph, the backward graph, and the graph of a call without a
    # backward (default: ``fw_compiler``); ``nop`` when None.
    fw_compiler: Compiler | None = None
    bw_compiler: Compiler | None = None
    inference_compiler: Compiler | None = None
    # What the backward saves: "save_all", "mincut", ``aotgrad.budget(x)``, or a callable.
    partition: PartitionArg = "save_all"
    # Decompositions to apply while tracing, on top of aotgrad's own: a dict from op to
    # function, or the name of a set, "core_aten" (Note [Core ATen graphs]).
    decompositions: Decompositions | str | None = None
    # Inference graphs write input mutations themselves (Note [Mutations kept in the graph]).
    keep_inference_input_mutations: bool = False
    # Past this many specializations, new ones run eagerly.
    cache_limit: int = 8
    # Every dimension of size > 1 of the call's tensors is dynamic (Note [Dynamic shapes]).
    dynamic: bool = False
    # Which tracer captures (Note [Choosing a tracer]).
    tracer: TracerChoice = "auto"
    # Look specializations up in, and write them to, the disk cache (Note [The disk cache]).
    disk_cache: bool = True
    # Check each stage's artifact at capture (Note [Stage checks]); default: AOTGRAD_CHECKS=1.
    check: bool = field(default_factory=lambda: switch(*_FROM_ENVIRONMENT["check"]))
    # Capture with aotgrad's fast path (the direct tracer and its fake-mode shortcuts);
    # False: PyTorch's stock fake mode and the full trace only. Default: on unless AOTGRAD_FAST=0
    # (read, as AOTGRAD_CHECKS, when the options are made).
    fast: bool = field(default_factory=lambda: switch(*_FROM_ENVIRONMENT["fast"]))

    def __post_init__(self) -> None:
        for name, variable in _FROM_ENVIRONMENT.items():  # None: the variable's value
            if getattr(self, name) is None:
                object.__setattr__(self, name, switch(*variable))
        check_tracer_choice(self.tracer)
        if isinstance(self.decompositions, str):
            check_decomposition_set(self.decompositions)
        if self.tracer == "direct" and not self.fast:
            raise ValueError(
                "tracer='direct' needs the fast path, which fast=False (or AOTGRAD_FAST=0) leaves"
                " off: pass tracer='auto' or 'full' (Note [The fast path as a layer])"
            )


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def options_of(given: Mapping[str, Any], where: str) -> Options:
    """``Options(**given)``; a keyword ``Options`` lacks is a TypeError naming it.

    >>> options_of({"dynamc": True}, "aot_function")
    Traceback (most recent call last):
    ...
    TypeError: aot_function() got an unexpected keyword argument 'dynamc'; its options are fw_compiler, bw_compiler, inference_compiler, partition, decompositions, keep_inference_input_mutations, cache_limit, dynamic, tracer, disk_cache, check, fast
    """
    unknown = [name for name in given if name not in OPTION_NAMES]
    if unknown:
        raise TypeError(
            f"{where}() got an unexpected keyword argument {unknown[0]!r}; its options are"
            f" {', '.join(OPTION_NAMES)}"
        )
    return Options(**given)


def with_option_keywords(fn: Callable[..., Any]) -> None:
    """``fn(..., **options)``'s signature (``help()``, ``inspect``) shows ``Options``' fields."""
    params = inspect.signature(fn).parameters.values()
    kept = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in kept}
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for f in dataclasses.fields(Options)
        for default in [None if f.name in _FROM_ENVIRONMENT else f.default]
        if f.name not in names
    ]
    fn.__signature__ = inspect.Signature([*kept, *keywords])  # type: ignore[attr-defined]


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
        refuse_non_core(joint.gm.graph, options.decompositions)
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
        partitioned, *compilers(options), driver=differentiable_backward_driver(options)
    )


def compilers(options: Options) -> tuple[Compiler | None, Compiler | None, Compiler | None]:
    return options.fw_compiler, options.bw_compiler, options.inference_compiler


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


# Note [No garbage collection during capture]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A capture allocates some 10^5 short-lived Python objects (fake tensors, fx
# nodes, dispatch keys), and CPython's collector runs a generation-2 pass, which
# walks every object in the process (torch alone brings ~10^6), each time enough
# survivors pile up: several full passes per capture (bench/findings.md has the
# count and the seconds), for garbage that is mostly freed by reference counting
# anyway. The collector is paused while one capture runs and resumed as it was;
# cycles made meanwhile are collected by its next pass. Encoding or decoding a
# graph file makes as many objects, and the passes took most of a load: paused there too.
# (``torch.distributed.checkpoint`` does the same around its state-dict walks.)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for one capture, or one graph file's encoding or
    decoding (Note [No garbage collection during capture])."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
