"""How aotgrad runs, as data: the :class:`Options` every frontend takes, the ``AOTGRAD_*``
switches that give their defaults, and the collector's pause around captures and graph files.

The pipeline, the graph files and the disk cache (``store/``) all read these; they sit below
each of them (tests/test_layering.py).

>>> switch("AOTGRAD_CACHE", True, {"AOTGRAD_CACHE": "off"})
False
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aotgrad.capture.tracing.tracers import TracerChoice, check_tracer_choice
from aotgrad.errors import ConfigError
from aotgrad.ops.core_aten import check_decomposition_set
from aotgrad.partition import Policy, Strategy
from aotgrad.runtime.boxing import Compiler, nop

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
    # The forward's random draws: "ops", random ops in the compiled graph (torch draws eager's
    # numbers, a compiler its own); "inputs", the draws taken out as its last inputs, made by
    # torch before each call (Note [Random draws as inputs]). None: "inputs" with a named
    # decomposition set (no Core ATen op draws eager's numbers), "ops" otherwise.
    random: str | None = None

    @property
    def draws_as_inputs(self) -> bool:
        """Does the compiled forward take its random draws as inputs?

        >>> Options().draws_as_inputs, Options(decompositions="core_aten").draws_as_inputs
        (False, True)
        """
        if self.random is None:
            return isinstance(self.decompositions, str)
        return self.random == "inputs"

    def __post_init__(self) -> None:
        for name, variable in _FROM_ENVIRONMENT.items():  # None: the variable's value
            if getattr(self, name) is None:
                object.__setattr__(self, name, switch(*variable))
        check_tracer_choice(self.tracer)
        if isinstance(self.decompositions, str):
            check_decomposition_set(self.decompositions)
        if self.random not in (None, "ops", "inputs"):
            raise ConfigError(
                f"random={self.random!r} is not a choice: pass 'ops' (random ops in the compiled"
                " graphs) or 'inputs' (their draws made inputs, drawn by torch before each call:"
                " Note [Random draws as inputs])"
            )
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
    TypeError: aot_function() got an unexpected keyword argument 'dynamc'; its options are fw_compiler, bw_compiler, inference_compiler, partition, decompositions, keep_inference_input_mutations, cache_limit, dynamic, tracer, disk_cache, check, fast, random
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


def compilers(options: Options) -> tuple[Compiler | None, Compiler | None, Compiler | None]:
    return options.fw_compiler, options.bw_compiler, options.inference_compiler


def only_nop(options: Options) -> bool:
    """No compiler but ``nop``: graphs read from a file run as aotgrad's own straight-line code
    (Note [Graphs read from a file])."""
    return all(c is None or c is nop for c in compilers(options))


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
