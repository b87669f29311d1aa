"""One interface over the two ways capture traces the joint function, and the choice between them.

Note [Two tracers]
~~~~~~~~~~~~~~~~~~
Capture runs one joint function, forward then backward, on fake tensors
(Note [One tracing pass]), under one of two tracers:

- :class:`~aotgrad.capture.tracing.fast.direct.DirectTracer` appends each aten op to a
  graph as it runs (Note [Direct tracing]): cheap, but it handles only
  static sizes, in-place ops recorded functionally (Note [In-place ops,
  directly]) and writes through the view ops it can scatter back (Note
  [Writes through views, directly]);
- :class:`~aotgrad.capture.tracing.full.FullTracer` runs the function under
  functionalization inside ``make_fx``: it handles everything capture does.

The joint function is the same code for both; what differs is owned by the
:class:`Tracer` each implements, and ``joint.py`` only calls its methods::

                                direct                    full
    run(joint, fakes)           record ops as they run    make_fx(joint)(*fakes)
    dispatch_mode()             none (run records)        functionalization
    graph_primals(fakes)        the fakes themselves      functional wrappers
    differentiate_at(primal)    the primal                its gradient edge
    traced(result leaf)         recorded by this trace    a functional tensor
    input_mutations(...)        inputs it gave new values read off functionalization
    sync(forward values)        scatter pending writes    torch._sync
                                through views (Note
                                [Writes through views,
                                directly])
    backward_checked(...)       it stops first            inputs the backward mutated
    unwrap(graph value)         itself, synced as above   from_functional

Both give the same graph, node for node, for a function both can trace
(``tests/test_direct_trace.py`` checks it). A *selective* checkpoint
(``create_selective_checkpoint_contexts``) is one the direct trace does not
take: torch's policy mode tags the nodes (MUST_SAVE, PREFER_RECOMPUTE) and
caches every value only under the full trace's proxy mode, so the two graphs
would differ in the tags the partitioner reads, and in the nodes::

    body(a) = (a @ w).sin().cos(), mm MUST_SAVE, the rest PREFER_RECOMPUTE
    direct:  sin = sin(mm); cos = cos(sin); sin_1 = sin(mm); sin_2 = sin(sin_1) ...
             (no tags: the strategy alone decides what is saved)
    full:    sin = sin(mm); cos = cos(sin);                  sin_1 = sin(sin) ...
             (mm tagged MUST_SAVE, sin and cos PREFER_RECOMPUTE)

The direct trace stops at the first op the policy's mode passes down (Note
[Selective checkpoints stop the direct trace]). One known difference remains:
a view of a base written through a view (timm's convnext: ``as_strided_backward``)
has the seq_nr of the op that first reads it in the full trace, which
regenerates it there (``is_functional_regenerated``), and of the op that made
it in the direct trace: ``as_strided`` at 80 (``mean``'s) against 81.

Note [Choosing a tracer]
~~~~~~~~~~~~~~~~~~~~~~~~
The ``tracer`` option of ``trace``/``aot_function``/``aot_module`` picks:

- ``"auto"`` (the default): the direct trace, then the full one if the
  direct trace was not tried or did not finish;
- ``"direct"``: the direct trace or a :class:`DirectTraceError` saying why not;
- ``"full"``: the full trace only.

The direct trace ends in one of four ways, and the capture result records
which (``JointGraph.tracer``, shown as ``traced.tracer`` and
``traced.fallback_reason``, and by ``aotgrad show``)::

    f(x) = x.sin()          made the graph    tracer "direct", fallback_reason None
    f(x) = x.t_().sin()     stopped           "full", "the direct trace stopped:
                                              aten.t_.default mutates an input's ..."
    checkpoint(f, x,        stopped           "full", "the direct trace stopped: an op ran
      context_fn=sac)                         under a selective checkpoint's policy ..."
    dynamic=True            not tried         "full", "the direct trace was not tried:
                                              dynamic shapes"
    a bug in direct.py      failed            "full", "the direct tracer failed: TypeError ..."

(``sac``: ``partial(create_selective_checkpoint_contexts, policy)``.)

"Stopped" is :class:`NeedsFullTrace`, which the direct tracer raises for
what it knowingly does not handle, with the reason. It derives from
``BaseException``: a function that guards an in-place op with ``except
Exception:`` would otherwise swallow the stop, and the direct trace would go
on without the op and return a graph that never mutates::

    try:                            eager: x.add_(1) runs; f returns 2 * (x + 1)
        x.add_(1)                   a swallowed stop: no add_ in the graph,
    except Exception:               f returns 2 * x and x is unchanged
        pass
    return x * 2

Any other exception is not caught as a stop: the full trace runs next, and

- if the full trace raises too, the exception was the function's own (a
  shape mismatch, a construct capture refuses): the caller gets the full
  trace's error, in the user's terms, as if the direct trace had not run;
- if the full trace succeeds, the direct tracer has a bug. The user is
  never worse off (the full trace's graph is right), but the bug is not
  hidden either: the reason records the exception, ``direct_tracer_bug`` is
  set, and a :class:`DirectTracerBugWarning` is issued. The test suite turns
  that warning into an error (``filterwarnings`` in ``pyproject.toml``), so
  any test model that meets such a bug fails.
"""

from __future__ import annotations

import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, cast, get_args

import torch
import torch.fx as fx
from torch.autograd.graph import GradientEdge

from aotgrad._torch_compat import REENTRANT_CHECKPOINT_GRAD
from aotgrad.capture.analyses.mutation import InputMutation, PrimalInfo
from aotgrad.capture.tracing.recorder import Recorder
from aotgrad.capture.tracing.state import TraceState
from aotgrad.errors import (
    CaptureError,
    DirectTraceError,
    UserFrame,
    format_error,
    user_frame_from_traceback,
)

TracerChoice = Literal["auto", "direct", "full"]
TracerName = Literal["direct", "full"]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=BaseException)


def check_tracer_choice(value: object) -> TracerChoice:
    """``value`` if it names a tracer choice, else a ValueError saying which ones exist.

    >>> check_tracer_choice("full")
    'full'
    >>> check_tracer_choice("fast")
    Traceback (most recent call last):
    ...
    ValueError: unknown tracer 'fast'; expected 'auto' (the default), 'direct' or 'full' (Note [Choosing a tracer])
    """
    if value not in get_args(TracerChoice):
        raise ValueError(
            f"unknown tracer {value!r}; expected 'auto' (the default), 'direct' or 'full'"
            " (Note [Choosing a tracer])"
        )
    return cast(TracerChoice, value)


class NeedsFullTrace(BaseException):
    """The direct trace stops: it met something only the full trace handles (Note [Choosing a tracer]).

    ``reason`` says what, e.g. ``"aten.t_.default mutates an input's size or strides"``.
    A ``BaseException``, as pytest's outcomes are, so that no ``except Exception:``
    between the op and capture (the user's, or a library's) can swallow it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FullTraceRefused(CaptureError):
    """The full trace cannot take these inputs at all (``full.refuse_untraceable``)."""


class DirectTracerBugWarning(UserWarning):
    """The direct tracer failed where the full trace succeeded: an aotgrad bug (Note [Choosing a tracer])."""


@dataclass(frozen=True)
class TracerReport:
    """Which tracer made a joint graph, and why not the direct one (Note [Choosing a tracer]).

    >>> print(TracerReport(name="direct"))
    direct
    >>> print(TracerReport(name="full", fallback_reason="tracer='full' was asked"))
    full (tracer='full' was asked)
    """

    # The tracer whose graph capture returned.
    name: TracerName
    # Why the full trace made it (the direct trace was not tried, stopped or failed); None
    # when the direct trace made it.
    fallback_reason: str | None = None
    # The direct trace failed with an exception the full trace did not meet: a bug.
    direct_tracer_bug: bool = False

    def __post_init__(self) -> None:
        if (self.name == "direct") != (self.fallback_reason is None):
            raise AssertionError(
                f"expected a fallback reason exactly for the full tracer, got {self.name!r}"
                f" with {self.fallback_reason!r}"
            )

    def __str__(self) -> str:
        return (
            self.name if self.fallback_reason is None else f"{self.name} ({self.fallback_reason})"
        )


class Tracer(ABC):
    """Runs the joint function on fake tensors and records its graph (Note [Two tracers]).

    ``joint.py`` calls only these methods; each implementation owns its differences.
    """

    # Which tracer this is, as TracerReport names it.
    name: ClassVar[TracerName]

    def __init__(
        self,
        recorder: Recorder,
        decompositions: Mapping[Any, Callable[..., Any]] | None,
        *,
        leaf_primals: bool = False,
    ) -> None:
        # Collects provenance (module paths, source lines, random ops) while the trace runs.
        self.recorder = recorder
        # Decomposition table: ops replaced by what they decompose into as they run.
        self.decompositions = decompositions
        # Differentiate with .backward() into leaf primals instead of autograd.grad
        # (Note [Reentrant checkpoints]).
        self.leaf_primals = leaf_primals

    @abstractmethod
    def run(
        self, joint: Callable[..., list[torch.Tensor | None]], fakes: Sequence[torch.Tensor]
    ) -> fx.GraphModule:
        """Call ``joint(*fakes)`` and return the graph of the ops it ran, its results as outputs."""

    def dispatch_mode(self) -> AbstractContextManager[Any]:
        """The mode the function's forward runs under (entered around the primals and the body)."""
        return nullcontext()  # the direct trace's recording mode spans the whole run

    @abstractmethod
    def graph_primals(
        self, fakes: Sequence[torch.Tensor], infos: Sequence[PrimalInfo]
    ) -> list[torch.Tensor]:
        """What the function sees for each graph input; a repeated input gets one tensor."""

    @abstractmethod
    def differentiate_at(self, primal: torch.Tensor) -> GradientEdge | torch.Tensor | None:
        """What ``autograd.grad`` differentiates with respect to for ``primal`` (None: nothing)."""

    @abstractmethod
    def traced(self, value: object) -> bool:
        """Is ``value`` (a leaf of the function's result) a tensor this trace computed?"""

    @abstractmethod
    def input_mutations(self, state: TraceState) -> list[InputMutation]:
        """The inputs the function mutated, after it ran (Note [Input mutation])."""

    @abstractmethod
    def sync(self, values: Sequence[torch.Tensor]) -> None:
        """Make the forward values final, so no forward op is recorded after the first cotangent."""

    def backward_checked(self, state: TraceState) -> AbstractContextManager[list[int]]:
        """Around the backward: the list it gives is filled, on exit, with the graph input
        positions the backward mutated (Note [State updated by the backward])."""
        return nullcontext([])  # the direct trace stops at an in-place op in the backward

    @abstractmethod
    def unwrap(self, value: torch.Tensor | None) -> torch.Tensor | None:
        """A result of the joint function as the graph's output holds it."""


def refuses_autograd_grad(e: BaseException) -> bool:
    """A reentrant checkpoint's refusal of ``autograd.grad`` (Note [Reentrant checkpoints])."""
    return isinstance(e, RuntimeError) and REENTRANT_CHECKPOINT_GRAD in str(e)


def trace_with(
    choice: TracerChoice,
    *,
    why_not_direct: str | None,
    direct: Callable[[], _T],
    full: Callable[[], _T],
    where: UserFrame | None,
) -> tuple[_T, TracerReport]:
    """Run the tracer ``choice`` asks for; the result and a report of which one made it.

    ``why_not_direct`` says why the direct trace cannot be tried (None: it can).
    See Note [Choosing a tracer].
    """
    if choice == "full":
        with _grad_mode_restored_on_error():
            return full(), TracerReport(name="full", fallback_reason="tracer='full' was asked")
    if why_not_direct is not None:
        if choice == "direct":
            raise _direct_refused(why_not_direct, where)
        reason = f"the direct trace was not tried: {why_not_direct}"
        with _grad_mode_restored_on_error():
            return full(), TracerReport(name="full", fallback_reason=reason)
    stopped = failed = None
    try:
        with _grad_mode_restored_on_error():  # Note [Each trace starts in the caller's grad mode]
            return direct(), TracerReport(name="direct")
    except NeedsFullTrace as e:
        if choice == "direct":
            raise _direct_refused(e.reason, _stop_site(e) or where) from e
        stopped = released(e)
    except Exception as e:
        if choice == "direct":
            raise
        failed = released(e)
    # Outside the except blocks: the full trace's own errors carry no direct-trace context.
    try:
        with _grad_mode_restored_on_error():
            traced = full()
    except FullTraceRefused:
        if failed is None:
            raise
        raise failed from None  # the full trace cannot tell: the direct trace's error stands
    if stopped is not None:
        return traced, TracerReport(name="full", fallback_reason=_stop_reason(stopped))
    assert failed is not None
    return traced, _direct_tracer_bug(failed, where)


# Note [Each trace starts in the caller's grad mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace that stops or fails partway through the function leaves grad mode as
# the function had set it at that point. A ``with torch.no_grad():`` block
# restores it as the exception passes; a bare ``torch.set_grad_enabled(False)``
# call does not, nor does Dynamo's graph, whose regions are straight-line calls
# (Note [Grad-mode regions in Dynamo's graph])::
#
#     v1 = a * 3                                 direct: runs with grad on
#     torch._C._set_grad_enabled(False)
#     v2 = F.dropout(a, 0.5)                     direct: stops here (bernoulli_)
#     torch._C._set_grad_enabled(True)           never runs
#
# The full trace would then run all of it with grad off, and ``v1`` would not
# require grad: silently no gradient. So each attempt that raises leaves the
# grad mode as it found it, for the next attempt and for the caller.


@contextmanager
def _grad_mode_restored_on_error() -> Iterator[None]:
    """On an exception, grad mode as it was on entry (Note [Each trace starts in the caller's
    grad mode])."""
    enabled = torch.is_grad_enabled()
    try:
        yield
    except BaseException:
        torch.set_grad_enabled(enabled)
        raise


# Note [The direct trace's frames are let go]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The direct trace's exception is kept while the full trace runs (its reason, or
# the error itself when the full trace refuses), and with it its traceback's
# frames and their locals. One of them can hold state the full trace must not
# see: a non-reentrant checkpoint whose function raised keeps its saved-tensor
# hooks pushed until its suspended generator, a local of ``checkpoint``'s frame,
# is closed (torch 2.11 and 2.12):
#
#     direct:  checkpoint(f) -> hooks pushed -> f raises NeedsFullTrace
#     full:    every tensor the forward saves goes to the stale hooks as well
#
# so the frames are cleared (``traceback.clear_frames``) as soon as the exception
# is caught: the generator closes and pops its hooks; the exception keeps its
# message and its lines (code and line numbers stay). A stop is let go earlier
# still, before the direct trace's recording mode exits (Note [Selective
# checkpoints stop the direct trace]).


def released(e: _E) -> _E:
    """``e`` with the locals of its traceback's frames (and its causes') let go (Note [The
    direct trace's frames are let go])."""
    seen: set[int] = set()
    chained: BaseException | None = e
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    return e


def _stop_site(e: NeedsFullTrace) -> UserFrame | None:
    """The user's line the direct trace stopped at (a stop raised for a torch error: its line)."""
    return user_frame_from_traceback((e.__cause__ or e).__traceback__)


def _stop_reason(e: NeedsFullTrace) -> str:
    site = _stop_site(e)
    at = f" at {site.filename}:{site.lineno}" if site is not None else ""
    return f"the direct trace stopped{at}: {e.reason}"


def _direct_refused(reason: str, where: UserFrame | None) -> DirectTraceError:
    return DirectTraceError(
        format_error(
            f"tracer='direct' cannot capture this function: {reason}",
            where,
            "Pass tracer='auto' (the default: the direct trace, then the full one when it"
            " stops) or tracer='full'.",
        )
    )


def _direct_tracer_bug(e: Exception, where: UserFrame | None) -> TracerReport:
    """The report, and a warning, for a direct-trace failure the full trace did not meet."""
    error = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    site = user_frame_from_traceback(e.__traceback__) or where
    warnings.warn(
        DirectTracerBugWarning(
            format_error(
                f"aotgrad's direct tracer failed with {error}, but the full trace captured the"
                " function: the graphs are right, the capture was slower. This is an aotgrad"
                " bug; please report it with this message",
                site,
                "Pass tracer='full' to skip the direct trace (Note [Choosing a tracer]).",
            )
        ),
        stacklevel=3,
    )
    return TracerReport(
        name="full",
        fallback_reason=f"the direct tracer failed: {error}",
        direct_tracer_bug=True,
    )


__all__ = [
    "DirectTracerBugWarning",
    "FullTraceRefused",
    "NeedsFullTrace",
    "Tracer",
    "TracerChoice",
    "TracerName",
    "TracerReport",
    "check_tracer_choice",
    "refuses_autograd_grad",
    "released",
    "trace_with",
]
