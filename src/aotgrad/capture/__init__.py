"""Stage 2: capture. Fake tensors in, one functional joint graph of forward + backward out.

Entry point: :func:`capture`. See Note [One tracing pass] in ``tracing/joint.py`` and
Note [Choosing a tracer] in ``tracing/tracers.py``.

This package exports :func:`capture` and the types of what it returns: :class:`JointGraph`
(``graph``) and what every node of its graph carries (``provenance``: :class:`NodeInfo`, read
with :func:`node_info`; its :class:`Phase` (:func:`phase_of`) and :class:`Kind`). Every other
name is imported from the module that defines it: ``tracing/`` (the trace), ``analyses/``
(what the trace tells about the function) and ``user_state/`` (the user's state it watches).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from aotgrad.capture.analyses.collectives import check_same_on_ranks
from aotgrad.capture.analyses.random import faithful_decompositions
from aotgrad.capture.graph import JointGraph
from aotgrad.capture.provenance import Kind, NodeInfo, Phase, node_info, phase_of
from aotgrad.capture.tracing.assemble import fast_path, synthetic_bases, trace_joint_graph
from aotgrad.capture.tracing.joint import Body, TraceOptions
from aotgrad.capture.tracing.recorder import Recorder
from aotgrad.capture.tracing.session import capture_session
from aotgrad.capture.tracing.tracers import TracerChoice, check_tracer_choice
from aotgrad.capture.user_state.environ import recording_environ
from aotgrad.capture.user_state.side_effects import Watch
from aotgrad.errors import UserFrame
from aotgrad.signature import FlatInputs

__all__ = ["JointGraph", "Kind", "NodeInfo", "Phase", "capture", "node_info", "phase_of"]


def capture(
    body: Body,
    flat: FlatInputs,
    primals: Sequence[torch.Tensor],
    *,
    with_backward: bool,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    where: UserFrame | None = None,
    root: object = None,
    module_paths: Mapping[int, str] | None = None,
    dynamic_dims: Mapping[int, Sequence[int]] | None = None,
    tracer: TracerChoice = "auto",
    effects: Watch | None = None,
    fast: bool = True,
) -> JointGraph:
    """Trace ``body(primals)`` and, if ``with_backward``, its backward, into a :class:`JointGraph`.

    ``body`` receives the primals (lifted module state, then the user's
    tensors) as functional fake tensors and returns the user's result. ``root``
    (the user's function or module) names the provenance: ops outside any module
    carry its name. ``module_paths`` (by ``id`` of the module) names the modules the
    function reaches (Note [Module paths as the signature names them]); without it a
    module ``root``'s are relative to it, and every other module is named by its class. ``dynamic_dims``
    (by ``id`` of a primal) makes those dimensions symbolic (Note [Dynamic shapes]).
    ``tracer`` chooses the tracer (Note [Choosing a tracer]); the result's
    ``tracer`` field says which one made the graph. ``effects`` watches the user's
    objects for tensors the function stores there (Note [Side effects replayed]).
    ``fast=False`` leaves the fast path off (Note [The fast path as a layer]).
    """
    if not fast and tracer == "direct":
        raise ValueError(
            "tracer='direct' needs the fast path, which fast=False (or AOTGRAD_FAST=0) leaves"
            " off: pass tracer='auto' or 'full' (Note [The fast path as a layer])"
        )
    options = TraceOptions(
        with_backward=with_backward,
        decompositions=faithful_decompositions(decompositions),
        where=where,
        dynamic_dims=dynamic_dims,
        tracer=check_tracer_choice(tracer),
        effects=effects,
        fast=fast_path(fast),  # Note [Behaviour by torch release]
    )
    label = root if root is not None else body
    recorder = functools.partial(Recorder, label, module_paths)  # one per trace
    with capture_session(), recording_environ() as environ:  # Note [Capture sessions]
        joint = trace_joint_graph(body, flat, primals, (), options, recorder)
        bases = synthetic_bases(joint, primals, where)
        if bases:  # Note [Aliased inputs]: trace again, the members re-derived from their bases
            joint = trace_joint_graph(body, flat, primals, bases, options, recorder)
    reads = environ.reads()  # Note [Environment read at capture]
    if reads is not None:
        joint = replace(joint, environ=reads)
    # Note [Collectives]: the cross-rank check names the function (or the module's class)
    named = label if hasattr(label, "__qualname__") else type(label)
    function = f"{getattr(named, '__module__', '')}.{getattr(named, '__qualname__', repr(named))}"
    check_same_on_ranks(joint.gm.graph, function, where)
    return joint
