"""The random generator while a trace runs: restored after it, and torch's RNG functions stood in for.

The trace draws no real numbers (fake tensors), but user code and
``torch.utils.checkpoint`` call torch's RNG functions, which are Python and would
run once, at capture. :func:`generator_restored` keeps the real generators as they
were (Note [Reseeds the trace cannot see]); :func:`rng_stand_ins` replaces
``torch.get_rng_state``/``set_rng_state`` (Note [Recomputed random ops]),
``torch.manual_seed`` (recorded as an op: Note [Reseeding inside the function]) and
``torch.seed`` (refused) for the capture's thread while a trace runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from aotgrad._torch_compat import disable_current_modes
from aotgrad.capture.analyses.random import MANUAL_SEED, seed_as_int64
from aotgrad.capture.user_state import closed_over
from aotgrad.errors import UnsupportedOpError, format_error, user_frame_from_stack


@contextlib.contextmanager
def generator_restored() -> Iterator[None]:
    """The real CPU generator during a trace, restored as it was when the trace ends, and the
    devices' generators too; a reseed the trace did not make is refused at the end (Note
    [Reseeds the trace cannot see]).

    :meth:`Recorder.note_random` steps the CPU generator (Note [Recomputed random ops]).
    """
    generator = torch.default_generator
    with disable_current_modes():
        state = generator.get_state()
    devices = _device_generators()
    device_states = [g.get_state() for g in devices]
    seeds = _SEEDS.begin(generator)  # Note [Reseeds the trace cannot see]
    for device in devices:
        device.manual_seed(_SENTINEL_SEED)
    outside = _OutsideReseeds.count
    try:
        yield
        kept = seeds.kept(generator) and all(g.initial_seed() == _SENTINEL_SEED for g in devices)
        if not kept and _OutsideReseeds.count == outside:
            _refuse_direct_reseed()
    finally:
        _SEEDS.end()
        for device, device_state in zip(devices, device_states, strict=True):
            device.set_state(device_state)
        with disable_current_modes():
            generator.set_state(state)


@contextlib.contextmanager
def rng_stand_ins() -> Iterator[None]:
    """torch's RNG functions replaced, in the capture's thread, while a trace runs.

    Inside a trace ``torch.get_rng_state()`` would build its tensor under the
    fake mode (fake storage: ``set_rng_state`` of it restores garbage), so
    ``torch.utils.checkpoint``'s save and restore around a recompute would not
    replay the stream (Note [Recomputed random ops]). Here both read and write
    the real generator, outside every mode. Reseeding records an op (Note
    [Reseeding inside the function]); a fresh seed is refused. Other threads
    keep torch's own functions, counted when they reseed (Note [Captures and
    other threads]).
    """
    generator = torch.default_generator

    def get_rng_state() -> torch.Tensor:
        with disable_current_modes():
            return generator.get_state()

    def set_rng_state(new_state: torch.Tensor) -> None:
        if _RESTORE.checks:  # the trace's recorder may refuse it
            _RESTORE.checks[-1]()
        with disable_current_modes():
            generator.set_state(new_state)

    patched: dict[tuple[Any, str], Callable[..., Any]] = {
        (torch, "get_rng_state"): get_rng_state,
        (torch.random, "get_rng_state"): get_rng_state,
        (torch, "set_rng_state"): set_rng_state,
        (torch.random, "set_rng_state"): set_rng_state,
        **{place: _reseeding(which, getattr(*place)) for place, which in _SEEDERS.items()},
        **{place: _refusing_fresh_seeds(getattr(*place)) for place in _FRESH_SEEDS},
    }
    saved = {place: getattr(*place) for place in patched}
    for (owner, name), value in patched.items():
        original = saved[owner, name]
        if (owner, name) in _SEEDERS or (owner, name) in _FRESH_SEEDS:
            original = _counted(original)
        setattr(owner, name, _in_capture(value, original))
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


# torch's seeding functions a trace records as an op, by the generator the op seeds.
_SEEDERS = {
    (torch, "manual_seed"): "default",
    (torch.random, "manual_seed"): "default",
    (torch.cuda, "manual_seed"): "cuda",
    (torch.cuda, "manual_seed_all"): "cuda_all",
}
# torch's functions that seed with a fresh seed: refused in a trace.
_FRESH_SEEDS = [
    (torch, "seed"),
    (torch.random, "seed"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
]


# Note [Reseeds the trace cannot see]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.manual_seed`` is replaced during a trace (Note [Reseeding inside the
# function]), but a generator's own method is not replaceable (a C type), and it
# would run once, at capture, silently::
#
#     def f(x):
#         torch.default_generator.manual_seed(0)   # not seen: eager reseeds every call
#         return F.dropout(x, 0.5)
#
# The trace draws no real numbers, so the generator's seed during it is free: the
# trace seeds it itself, with a fixed sentinel at the start and with each random
# op's stream position when it steps the stream (``Recorder.note_random``), and it
# remembers every seed it set. A seed it did not set, found before a step or at the
# end, means the function reseeded the generator some way the trace did not record,
# and the capture is refused::
#
#     trace seeds         0x5EEDA076AD                (sentinel)
#     user code           default_generator.manual_seed(0)   -> seed 0: not the trace's
#     dropout's step      finds seed 0 -> refused
#
# ``set_state`` restores the seed with the state, so the ``get_rng_state`` /
# ``set_rng_state`` pairs of a checkpoint or ``fork_rng`` bring back a seed the trace
# set. The CUDA devices' default generators (once CUDA is initialized) are seeded
# with the sentinel too, checked and restored the same way
# (``torch.cuda.default_generators[0].manual_seed(0)`` is refused as well). A reseed by another thread (torch's own function there, Note [Captures and
# other threads]) is counted, and the check is then left out: which thread reseeded
# cannot be told. The generator is restored when the trace ends, as before.
_SENTINEL_SEED = 0x5EED_A076AD


@dataclass
class _TraceSeeds:
    """The seeds the current trace set on the default generator, and whether it found
    another one (Note [Reseeds the trace cannot see])."""

    ours: set[int] = field(default_factory=set)
    foreign: bool = False

    def step(self, generator: torch.Generator, seed: int) -> None:
        self.check(generator)
        generator.manual_seed(seed)
        self.ours.add(generator.initial_seed())

    def check(self, generator: torch.Generator) -> None:
        self.foreign = self.foreign or generator.initial_seed() not in self.ours

    def kept(self, generator: torch.Generator) -> bool:
        self.check(generator)
        return not self.foreign


class _SeedStack(threading.local):
    """The traces running in this thread, innermost last."""

    def __init__(self) -> None:
        self.traces: list[_TraceSeeds] = []

    def begin(self, generator: torch.Generator) -> _TraceSeeds:
        seeds = _TraceSeeds()
        with disable_current_modes():
            generator.manual_seed(_SENTINEL_SEED)
        seeds.ours.add(generator.initial_seed())
        self.traces.append(seeds)
        return seeds

    def step(self, generator: torch.Generator, seed: int) -> None:
        if self.traces:
            self.traces[-1].step(generator, seed)
        else:
            generator.manual_seed(seed)

    def end(self) -> None:
        self.traces.pop()


_SEEDS = _SeedStack()


class _OutsideReseeds:
    """How often a thread outside a capture reseeded through ``torch.manual_seed``."""

    count = 0


def _device_generators() -> list[torch.Generator]:
    """The default generators of the CUDA devices, once CUDA is initialized (the trace
    neither draws from nor steps them: a seed of theirs it did not set is a reseed)."""
    return list(torch.cuda.default_generators) if torch.cuda.is_initialized() else []


def _counted(seed: Callable[..., Any]) -> Callable[..., Any]:
    """``seed``, counted in ``_OutsideReseeds``."""

    @functools.wraps(seed)
    def call(*args: Any, **kwargs: Any) -> Any:
        _OutsideReseeds.count += 1
        return seed(*args, **kwargs)

    return call


def _refuse_direct_reseed() -> None:
    raise UnsupportedOpError(
        "aotgrad: the function reseeded torch's default random generator directly"
        " (torch.default_generator.manual_seed, or a generator's manual_seed/set_state"
        " outside torch.manual_seed): that Python call ran once, at capture, where eager"
        " runs it on every call, so later calls would draw other numbers than eager's."
        " Reseed with torch.manual_seed(s) before every random op of the function (recorded"
        " and replayed at every call), or seed before calling the compiled function"
        " (Note [Reseeds the trace cannot see])."
    )


def _in_capture(patched: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``patched`` where the capture's code runs, ``original`` in every other thread."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return (patched if closed_over.in_capture() else original)(*args, **kwargs)

    return call


def _reseeding(which: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.manual_seed`` during a trace: records the reseed as an op (Note [Reseeding
    inside the function]); the recorder refuses it where it cannot be replayed. Another
    thread, not tracing, gets the original."""

    def manual_seed(seed: Any) -> Any:
        if not _RESTORE.checks:
            return original(seed)
        MANUAL_SEED(seed_as_int64(seed), which)
        return torch.default_generator if which == "default" else None

    return manual_seed


def _refusing_fresh_seeds(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.seed`` during a trace: refused (another thread, not tracing, gets the original)."""

    def seed(*args: Any, **kwargs: Any) -> Any:
        if not _RESTORE.checks:
            return original(*args, **kwargs)
        raise UnsupportedOpError(
            format_error(
                "the function reseeds a random generator with a fresh, non-deterministic seed"
                " (torch.seed, torch.cuda.seed): that Python call would run once, at capture,"
                " where eager draws a new seed on every call",
                user_frame_from_stack(),
                "Seed before calling the compiled function, or reseed with a fixed seed"
                " (torch.manual_seed(s)) before every random op of the function.",
            )
        )

    return seed


class _Restores(threading.local):
    """Per trace running now in this thread, innermost last, its recorder's check of a
    ``torch.set_rng_state`` (Note [Reseeding inside the function])."""

    def __init__(self) -> None:
        self.checks: list[Callable[[], None]] = []


_RESTORE = _Restores()


@contextlib.contextmanager
def restores_checked_by(check: Callable[[], None]) -> Iterator[None]:
    """Inside: ``torch.set_rng_state`` in this thread calls ``check`` first, which may refuse it;
    ``torch.manual_seed`` is recorded and ``torch.seed`` refused (the stand-ins act only while
    a trace's check is in)."""
    _RESTORE.checks.append(check)
    try:
        yield
    finally:
        _RESTORE.checks.remove(check)


def step_seed(generator: torch.Generator, seed: int) -> None:
    """Seed ``generator`` with ``seed``, remembered as the trace's own (Note [Reseeds the trace
    cannot see])."""
    _SEEDS.step(generator, seed)


__all__ = ["generator_restored", "restores_checked_by", "rng_stand_ins", "step_seed"]
