"""``scan``: run a body captured once over the rows of ``xs``, with autograd through the loop.

Note [Random ops in a scan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compiled forward draws from the global generator exactly as the body's
eager code does (Note [Random fills keep their layout]), and the loop runs it
once per iteration, in order: iteration ``i`` draws what the ``i``-th body
call of the unrolled eager loop draws, from the same generator state. The
backward graph never draws (random ops are saved, never recomputed). With
``checkpoint=True`` the backward runs each body's forward again; so that it
sees its forward's draws, the loop keeps the CPU generator's state from
before each iteration and restores it around the recompute, as
``torch.utils.checkpoint`` does, then puts the generator back::

    forward:   state_0 -> body(c_0, x_0) draws m_0 -> state_1 -> body(c_1, x_1) draws m_1
    backward:  set state_1, recompute body(c_1, x_1): draws m_1 again; backward 1
               set state_0, recompute body(c_0, x_0): draws m_0 again; backward 0
               restore the state the backward started with
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import compiler_disabled
from aotgrad.api import Traced
from aotgrad.cache import CacheInfo, ambient_key
from aotgrad.capture.tracing.session import capturing
from aotgrad.errors import DoubleBackwardError, ScanError, format_error, user_frame_from_stack
from aotgrad.loops.body import ScanBody, capture_body, differentiable
from aotgrad.loops.peak import LoopShape, ScanPeak, predict_scan_peak
from aotgrad.partition import Budget
from aotgrad.runtime.function import reached_grads, run_forward, with_zeros
from aotgrad.runtime.transforms import transform_active
from aotgrad.settings import Options, options_of, with_option_keywords
from aotgrad.signature.lifting import NOTHING, Lifted, State, as_module


class ScanFunction:
    """``fn(carry, x) -> (carry, y)`` made a scan: call it as ``(init, xs) -> (carry, ys)``.

    The body is captured once per structure, shapes and dtypes of ``init`` and of
    one row of ``xs`` (whatever the length), and kept; ``traced`` is the last
    capture's :class:`aotgrad.Traced` (Note [Scan's calling convention]) and
    ``captures`` counts them.

    >>> import torch, aotgrad
    >>> def step(h, x):
    ...     h = torch.tanh(h + x)
    ...     return h, h * 2
    >>> run = aotgrad.scan_function(step)
    >>> h, ys = run(torch.zeros(3), torch.ones(5, 3))
    >>> ys.shape, run.captures
    (torch.Size([5, 3]), 1)
    >>> _ = run(torch.zeros(3), torch.ones(7, 3))  # another length: no new capture
    >>> run.captures
    1
    >>> [str(d) for d in run.traced.signature.forward_inputs]
    ['carry', 'x']
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        checkpoint: bool = False,
        read_environment: bool = True,
        options: Options | None = None,
        **keywords: Any,
    ) -> None:
        """``keywords``: ``aot_function``'s options (``partition``, ``fw_compiler``, ...)."""
        self._fn = as_module(fn)
        self._state = State(self._fn, read_environment)
        self._options = options or options_of(keywords, "ScanFunction")
        partition = self._options.partition
        # A peak budget bounds the whole loop's step (Note [Peak budgets over a scan]).
        self._peak_budget = (
            partition if isinstance(partition, Budget) and partition.peak is not None else None
        )
        self.checkpoint = checkpoint
        self._bodies: dict[Any, ScanBody] = {}
        self._last: ScanBody | None = None
        # The last call's loop (length, xs stacked or rows), and its predicted step peak.
        self._last_shape: LoopShape | None = None
        self._peaks: dict[tuple[int, LoopShape], ScanPeak] = {}
        # How many times the body was captured.
        self.captures = 0
        # Calls that reused a capture, captures and why (``aotgrad.cache_info``), and the
        # key of the last capture, which a miss is compared with.
        self.info = CacheInfo()
        self._last_key: tuple[Any, ...] | None = None

    @property
    def traced(self) -> Traced:
        """The body's graphs and convention, from the last capture."""
        if self._last is None:
            raise ScanError(self._not_captured())
        return self._last.traced

    @property
    def step_peak(self) -> ScanPeak:
        """The predicted peak of the last call's whole step: its N forwards, then the backward
        of its outputs with dense cotangents (Note [A scan's step peak]); under
        ``partition=aotgrad.budget(peak=BYTES)``, the one the body's plan was chosen for.

        >>> import torch, aotgrad
        >>> from aotgrad.testing import measure_peak
        >>> run = aotgrad.scan_function(lambda h, x: (torch.tanh(h * x), None))
        >>> h, xs = torch.ones(1000, requires_grad=True), torch.ones(3, 1000)
        >>> step = lambda: run(h, xs)[0].backward(torch.ones(1000))
        >>> step(); h.grad = None
        >>> run.step_peak.allocated, run.step_peak.where, measure_peak(step)
        (28000, 'backward iteration 1', 28000)
        """
        if self._last is None or self._last_shape is None:
            raise ScanError(self._not_captured())
        body, shape = self._last, self._last_shape
        if body.backward is None:
            raise ScanError(
                "this scan's last call ran without a gradient: its step has no backward to"
                " predict\ncall it with inputs that require grad (under torch.enable_grad())"
            )
        key = (id(body), shape)
        if key not in self._peaks:
            self._peaks[key] = body.peak or predict_scan_peak(body.traced.partitioned, shape)
        return self._peaks[key]

    def _not_captured(self) -> str:
        """Why ``traced`` has nothing to give yet."""
        return format_error(
            "this scan's body has not been captured: it is captured at the scan's first call",
            user_frame_from_stack(),
            "Call the scan once (run(init, xs)), then read .traced.",
        )

    @compiler_disabled
    def __call__(self, init: Any, xs: Any) -> tuple[Any, Any]:
        # Inside an aotgrad capture the loop is traced, unrolled; under a torch.func
        # transform it runs unrolled (Note [Transforms run the function]).
        if capturing() or transform_active():
            self._count_transform_run()
            return unrolled(self._fn, init, xs)
        xs_leaves, xs_spec = pytree.tree_flatten(xs)
        length = _length(xs_leaves)
        call = _Call(
            xs_spec=xs_spec,
            x_keys=tuple(_row_key(t) for t in xs_leaves),
            x_example=lambda: [_row(t) for t in xs_leaves],
            stacked=True,
        )
        return self._run(init, xs_leaves, length, call)

    def over_rows(self, init: Any, rows: Sequence[Any]) -> tuple[Any, Any]:
        """The scan over ``xs`` given as its rows, one pytree per iteration, never stacked.

        Each row's leaves are inputs of their own and get gradients of their own: no
        ``torch.stack`` in the forward, no ``cat`` or ``unbind`` in the backward
        (``scan_layers`` passes each layer's parameters so). Rows must agree in
        structure, shapes and dtypes.

        >>> import torch, aotgrad
        >>> run = aotgrad.scan_function(lambda c, w: (c * w, None))
        >>> ws = [torch.full((2,), 2.0, requires_grad=True), torch.full((2,), 3.0)]
        >>> c, _ = run.over_rows(torch.ones(2), ws)
        >>> c.sum().backward(); c, ws[0].grad
        (tensor([6., 6.], grad_fn=<ScanLoopBackward>), tensor([3., 3.]))
        """
        if capturing() or transform_active():  # Note [Transforms run the function]
            self._count_transform_run()
            return _unrolled_rows(self._fn, init, rows)
        flat = [pytree.tree_flatten(row) for row in rows]
        if not flat:
            raise ScanError("over_rows got no rows\npass at least one row")
        first, xs_spec = flat[0]
        grads = [
            any(t.requires_grad for t in column)
            for column in zip(*(f[0] for f in flat), strict=True)
        ]
        call = _Call(
            xs_spec=xs_spec,
            x_keys=tuple(
                (t.shape, t.dtype, t.device, g, t.layout) for t, g in zip(first, grads, strict=True)
            ),
            x_example=lambda: [
                t.detach().requires_grad_(g) for t, g in zip(first, grads, strict=True)
            ],
            stacked=False,
        )
        leaves = [t for row, _ in flat for t in row]
        return self._run(init, leaves, len(rows), call)

    def _count_transform_run(self) -> None:
        """A call under a transform runs the loop unrolled (Note [Transforms run the
        function]): counted as aot_function counts it; a call inside a capture is not."""
        if not capturing():
            self.info.transform_runs += 1

    def _run(
        self, init: Any, xs_leaves: list[torch.Tensor], length: int, call: _Call
    ) -> tuple[Any, Any]:
        init_leaves, carry_spec = pytree.tree_flatten(init)
        _check_init(init_leaves)
        lifted = self._state.read()
        with_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (*lifted.tensors, *init_leaves, *xs_leaves)
        )
        shape = LoopShape(
            num_lifted=len(lifted.tensors),
            num_carry=len(init_leaves),
            num_x=len(call.x_keys),
            length=length,
            checkpoint=self.checkpoint,
            stacked=call.stacked,
        )
        body = self._body(call, init_leaves, carry_spec, lifted, with_grad, shape)
        self._last_shape = shape
        if length == 0:  # as jax.lax.scan: init back, and empty ys
            empty = [torch.empty((0, *s), dtype=d, device=v) for s, d, v in body.y_examples]
            return init, body.y_of(empty)
        tensors = (*lifted.tensors, *init_leaves, *xs_leaves)
        if with_grad and body.backward is not None:
            results = ScanLoop.apply(body, self.checkpoint, length, call.stacked, *tensors)
        else:
            with torch.no_grad():
                results = _run_forward_only(body, tensors, length, call.stacked)
        carry = pytree.tree_unflatten(list(results[: body.num_carry]), carry_spec)
        ys = body.y_of(results[body.num_carry :])
        return carry, ys

    def _body(
        self,
        call: _Call,
        init: list[torch.Tensor],
        carry_spec: pytree.TreeSpec,
        lifted: Lifted,
        with_grad: bool,
        shape: LoopShape,
    ) -> ScanBody:
        key = (
            carry_spec,
            call.xs_spec,
            tuple(_tensor_key(t) for t in init),
            call.x_keys,
            lifted.key,
            with_grad,
            ambient_key(),
            # Note [Peak budgets over a scan]: the plan is the loop's, for this length.
            (shape.length, shape.stacked) if self._peak_budget and with_grad else None,
        )
        body = self._bodies.get(key)
        environ = None if body is None else body.traced.partitioned.joint.environ
        changed = None if environ is None else environ.changed()
        if body is not None and changed is None:
            self.info.hits += 1
        else:
            # Captured again when the environment it read changed (Note [Environment read
            # at capture]).
            body = capture_body(
                fn=self._fn,
                state=self._state,
                lifted=lifted,
                init=init,
                carry_spec=carry_spec,
                x=call.x_example(),
                x_spec=call.xs_spec,
                options=self._options,
                with_grad=with_grad,
                plan_for=shape if self._peak_budget and with_grad else None,
            )
            self.captures += 1
            settled = self._state.settle(lifted) if lifted is not NOTHING else lifted
            self._bodies[(*key[:4], settled.key, *key[5:])] = body
            self.info.misses += 1
            self.info.entries = len(self._bodies)
            self.info.reasons.append(
                _miss_reason(self._last_key, key) if changed is None else str(changed)
            )
            self._last_key = key
        self._last = body
        return body


# What each place of a body's key is, for a miss's reason.
_KEY_PARTS = (
    "the carry's structure",
    "xs's structure",
    "the carry's tensors",
    "a row of xs",
    "the module state and closed-over tensors",
    "whether a gradient is needed",
    "the torch state (grad mode, autocast, default dtype)",
    "the length and xs (stacked or rows) a peak budget plans for",
)


def _miss_reason(last: tuple[Any, ...] | None, key: tuple[Any, ...]) -> str:
    """Why a body was captured: the first call, or the first part of its key that differs
    from the last capture's (``aotgrad.cache_info`` of a scan)."""
    if last is None:
        return "first call"
    for part, old, new in zip(_KEY_PARTS, last, key, strict=True):
        if old != new:
            return f"{part}: {_short(old)} != {_short(new)}"
    return "the environment the body read changed"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True, kw_only=True)
class _Call:
    """How one call gives ``xs``: stacked leaves, or rows (``ScanFunction.over_rows``)."""

    xs_spec: pytree.TreeSpec
    # Per x leaf: its row's metadata, the key of the capture.
    x_keys: tuple[Any, ...]
    # Makes one row's leaves, for a capture.
    x_example: Callable[[], list[torch.Tensor]]
    # Leaves stacked on dim 0 (row i is ``t[i]``), or rows one after another.
    stacked: bool


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.dtype, t.device, t.requires_grad, t.layout)


def _row_key(t: torch.Tensor) -> tuple[Any, ...]:
    """An ``xs`` leaf's key: its row's metadata, not its length."""
    return (t.shape[1:], t.dtype, t.device, t.requires_grad, t.layout)


def _row(t: torch.Tensor) -> torch.Tensor:
    """One row of an ``xs`` leaf, for the capture (data never read; an empty leaf works)."""
    return torch.empty(t.shape[1:], dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def _check_init(leaves: Sequence[Any]) -> None:
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ScanError(
                f"scan's init holds {type(leaf).__name__} {leaf!r}; every leaf of the carry must"
                " be a tensor\nwrap numbers in tensors (torch.tensor(n)), or close over constants"
            )


def _length(leaves: Sequence[Any]) -> int:
    """The common leading size of the ``xs`` leaves."""
    if not leaves:
        raise ScanError(
            "scan's xs has no tensor leaves, so its length is unknown\npass xs with at least one"
            " tensor (torch.arange(n) for a plain loop of n iterations)"
        )
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ScanError(
                f"scan's xs holds {type(leaf).__name__} {leaf!r}; every leaf of xs must be a"
                " tensor with the scan's length as its first dimension\nclose over constants"
                " instead of passing them in xs"
            )
        if leaf.dim() == 0:
            raise ScanError("scan's xs holds a 0-d tensor; every leaf needs a leading dimension")
    sizes = [leaf.shape[0] for leaf in leaves]
    if len(set(sizes)) > 1:
        raise ScanError(
            f"scan's xs leaves have different leading sizes {sizes}; scan takes row i of every"
            " leaf at iteration i\ngive every xs leaf the same first dimension"
        )
    return int(sizes[0])


def unrolled(fn: Callable[..., Any], init: Any, xs: Any) -> tuple[Any, Any]:
    """The scan as a Python loop: what the compiled loop computes, and its reference.

    >>> import torch
    >>> carry, ys = unrolled(lambda c, x: (c + x, c * x), torch.zeros(2), torch.ones(3, 2))
    >>> carry, ys.shape
    (tensor([3., 3.]), torch.Size([3, 2]))
    """
    leaves, spec = pytree.tree_flatten(xs)
    rows = [pytree.tree_unflatten([t[i] for t in leaves], spec) for i in range(_length(leaves))]
    if not rows:
        raise ScanError("unrolled() needs at least one iteration to know y's structure")
    return _unrolled_rows(fn, init, rows)


def _unrolled_rows(fn: Callable[..., Any], init: Any, rows: Sequence[Any]) -> tuple[Any, Any]:
    carry, ys = init, []
    for row in rows:
        carry, y = fn(carry, row)
        ys.append(y)
    y_leaves, y_spec = zip(*(pytree.tree_flatten(y) for y in ys), strict=True)
    stacked = [
        None if column[0] is None else torch.stack(column) for column in zip(*y_leaves, strict=True)
    ]
    return carry, pytree.tree_unflatten(stacked, y_spec[0])


def _run_forward_only(
    body: ScanBody, tensors: Sequence[torch.Tensor], length: int, stacked: bool
) -> list[torch.Tensor]:
    lifted, carry, xs = _split(body, tensors)
    ys: list[list[torch.Tensor]] = []
    for i in range(length):
        results = run_forward(
            body.forward, body.plan, [*lifted, *carry, *_x_row(body, xs, i, stacked)]
        )
        carry = [results[p] for p in body.carry_in_forward]
        ys.append([results[p] for p in body.y_in_forward])
    return [*carry, *_stacked(ys, body.y_in_forward)]


def _split(
    body: ScanBody, tensors: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The Function's inputs as (closed-over, init, xs)."""
    carry_start = body.num_lifted
    x_start = carry_start + body.num_carry
    return list(tensors[:carry_start]), list(tensors[carry_start:x_start]), list(tensors[x_start:])


def _x_row(body: ScanBody, xs: Sequence[torch.Tensor], i: int, stacked: bool) -> list[torch.Tensor]:
    """Iteration ``i``'s x leaves: row ``i`` of each stacked leaf, or the ``i``-th row given."""
    if stacked:
        return [t[i] for t in xs]
    return list(xs[i * body.num_x : (i + 1) * body.num_x])


def _stacked(ys: list[list[torch.Tensor]], positions: Sequence[int]) -> list[torch.Tensor]:
    return [torch.stack([y[j] for y in ys]) for j in range(len(positions))]


class ScanLoop(torch.autograd.Function):
    """The loop under autograd: N forwards, then N backwards in reverse (Note [Saved per iteration]).

    Inputs: the body, checkpoint, the length, whether xs is stacked (else given as rows),
    then (closed-over, init, xs) tensors;
    outputs: the final carry's leaves, then the stacked ys.
    """

    @staticmethod
    def forward(
        ctx: Any, body: ScanBody, checkpoint: bool, length: int, stacked: bool, *tensors: Any
    ) -> Any:
        lifted, carry, xs = _split(body, tensors)
        kept: list[torch.Tensor] = []  # per iteration: its saved values, or its carry
        rng_states: list[torch.Tensor] = []
        ys: list[list[torch.Tensor]] = []
        for i in range(length):
            if checkpoint:
                kept.extend(carry)
                if body.random:
                    rng_states.append(torch.get_rng_state())
            x = _x_row(body, xs, i, stacked)
            carry = _forward_step(body, lifted, carry, x, ys, None if checkpoint else kept)
        outputs = (*carry, *_stacked(ys, body.y_in_forward))
        ctx.save_for_backward(*lifted, *xs, *kept)
        ctx.body, ctx.checkpoint, ctx.length, ctx.rng_states = body, checkpoint, length, rng_states
        ctx.stacked, ctx.num_xs = stacked, len(xs)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t in outputs if not differentiable(t)])
        return outputs

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[Any, ...]:
        body: ScanBody = ctx.body
        if torch.is_grad_enabled():
            raise DoubleBackwardError(_DOUBLE_BACKWARD)
        if body.backward is None:
            raise AssertionError("expected a backward graph: the body was traced with grad")
        saved = ctx.saved_tensors
        lifted = list(saved[: body.num_lifted])
        xs = list(saved[body.num_lifted : body.num_lifted + ctx.num_xs])
        kept = saved[body.num_lifted + ctx.num_xs :]
        grads = _Grads(body, ctx.length)
        carry_cotangent = list(cotangents[: body.num_carry])
        ys_cotangent = cotangents[body.num_carry :]
        with _rng_restored(ctx.checkpoint and body.random):
            for i in reversed(range(ctx.length)):
                carry_cotangent = _backward_step(
                    ctx, i, (carry_cotangent, ys_cotangent), (lifted, kept, xs), grads
                )
        x_grads = grads.stacked_xs() if ctx.stacked else grads.rows()
        return (None, None, None, None, *grads.lifted, *carry_cotangent, *x_grads)


_DOUBLE_BACKWARD = (
    "create_graph=True (double backward) through aotgrad.scan is not supported yet: the loop's"
    " backward runs each iteration's backward graph, which has no differentiable form here"
    " (aot_function, aot_module and torch.compile have one: docs/higher-order.md).\nCompute"
    " higher-order gradients through the unrolled loop (from aotgrad.loops import unrolled),"
    " or compile the whole loop with aot_function."
)


def _forward_step(
    body: ScanBody,
    lifted: list[torch.Tensor],
    carry: list[torch.Tensor],
    x: list[torch.Tensor],
    ys: list[list[torch.Tensor]],
    kept: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """One iteration's forward: ``y`` to ``ys``, its saved values to ``kept`` (None under
    checkpoint: dropped here, Note [A scan's step peak]); the new carry."""
    results = run_forward(body.forward, body.plan, [*lifted, *carry, *x])
    if kept is not None:
        kept.extend(results[body.saved_in_forward])
    ys.append([results[p] for p in body.y_in_forward])
    return [results[p] for p in body.carry_in_forward]


def _backward_step(
    ctx: Any,
    i: int,
    cotangents: tuple[list[torch.Tensor | None], Sequence[torch.Tensor | None]],
    saved: tuple[list[torch.Tensor], Sequence[torch.Tensor], list[torch.Tensor]],
    grads: _Grads,
) -> list[torch.Tensor | None]:
    """Iteration ``i``'s backward, its grads taken by ``grads``; the cotangent of the carry
    before it. Holds nothing past its return (Note [A scan's step peak])."""
    body: ScanBody = ctx.body
    carry_cotangent, ys_cotangent = cotangents
    y_rows = [None if t is None else t[i] for t in ys_cotangent]
    given = [carry_cotangent[j] if kind == "carry" else y_rows[j] for kind, j in body.cotangent_of]
    return grads.add(i, _iteration_grads(ctx, body, i, given, saved))


def _iteration_grads(
    ctx: Any,
    body: ScanBody,
    i: int,
    given: list[torch.Tensor | None],
    saved: tuple[list[torch.Tensor], Sequence[torch.Tensor], list[torch.Tensor]],
) -> Sequence[torch.Tensor | None]:
    """Iteration ``i``'s backward: None for inputs no given cotangent reaches, as eager.

    The body's backward graph takes zeros for the missing cotangents (Note [Missing
    cotangents]); an input only they reach gets None, not zeros, so a parameter the
    loss never reaches keeps ``.grad is None`` as in the unrolled loop.
    """
    incoming, received = with_zeros(ctx, given, body.plan.zeros)
    if not received:
        return [None] * len(body.plan.reached_by)
    assert body.backward is not None, "a scan body traced with grad has a backward graph"
    lifted, kept, xs = saved  # (closed-over, kept per iteration, xs)
    values = _saved_of(ctx, body, i, kept, lifted, _x_row(body, xs, i, ctx.stacked))
    return reached_grads(body.backward([*values, *incoming]), body.plan.reached_by, received)


def _saved_of(
    ctx: Any,
    body: ScanBody,
    i: int,
    kept: Sequence[torch.Tensor],
    lifted: list[torch.Tensor],
    x: list[torch.Tensor],
) -> list[Any]:
    """Iteration ``i``'s saved values: kept by the forward, or recomputed from its carry."""
    if not ctx.checkpoint:
        width = body.saved_in_forward.stop - body.saved_in_forward.start
        return list(kept[i * width : (i + 1) * width])
    carry = list(kept[i * body.num_carry : (i + 1) * body.num_carry])
    if body.random:  # Note [Random ops in a scan]
        torch.set_rng_state(ctx.rng_states[i])
    with torch.no_grad():
        results = run_forward(body.forward, body.plan, [*lifted, *carry, *x])
    return list(results[body.saved_in_forward])


@contextmanager
def _rng_restored(active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


class _Grads:
    """The backward's sums over iterations: closed-over tensors summed, x rows stacked."""

    def __init__(self, body: ScanBody, length: int) -> None:
        self.body = body
        self.lifted: list[torch.Tensor | None] = [None] * body.num_lifted
        self.xs: list[list[torch.Tensor | None]] = [[None] * length for _ in range(body.num_x)]

    def add(self, i: int, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take iteration ``i``'s grads; return the cotangent of the carry before it."""
        body = self.body
        carry_start = body.num_lifted
        x_start = carry_start + body.num_carry
        for k, g in enumerate(grads[:carry_start]):
            if g is not None:
                total = self.lifted[k]
                self.lifted[k] = g if total is None else total + g
        for k, g in enumerate(grads[x_start:]):
            self.xs[k][i] = g
        return list(grads[carry_start:x_start])

    def stacked_xs(self) -> list[torch.Tensor | None]:
        return [_stack_rows(rows) for rows in self.xs]

    def rows(self) -> list[torch.Tensor | None]:
        """Each row's grads, rows one after another (``ScanFunction.over_rows``)."""
        return [column[i] for i in range(len(self.xs[0]) if self.xs else 0) for column in self.xs]


def _stack_rows(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = next((r for r in rows if r is not None), None)
    if present is None:
        return None
    return torch.stack([torch.zeros_like(present) if r is None else r for r in rows])


# Note [Saved per iteration]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The forward keeps, per iteration, the body's saved values (``saved_in_forward``
# of its outputs), one after another in one list given to ``save_for_backward``;
# iteration ``i``'s are ``kept[i * width : (i + 1) * width]``. With
# ``checkpoint=True`` it keeps each iteration's incoming carry instead, and the
# backward runs that iteration's forward again to get them. For a body saving
# ``(x, tanh)`` over three iterations::
#
#     save_all:    kept = [x_0, tanh_0, x_1, tanh_1, x_2, tanh_2]
#     checkpoint:  kept = [c_0, c_1, c_2]     # recompute body(c_i, x_i) in backward i
#
# The backward walks ``i = N-1 .. 0``: the carry's cotangent enters iteration
# ``i`` and the grads of its carry inputs become iteration ``i-1``'s; closed-over
# tensors' grads are summed, x's are stacked row by row.

_FUNCTIONS: weakref.WeakKeyDictionary[Any, dict[Any, ScanFunction]] = weakref.WeakKeyDictionary()


def scan_function(
    fn: Callable[..., Any], *, checkpoint: bool = False, **options: Any
) -> ScanFunction:
    """A reusable scan of ``fn(carry, x) -> (carry, y)``; see :class:`ScanFunction`.

    The same object :func:`scan` runs for ``fn`` with these options, so after
    ``aotgrad.scan(fn, ...)``, ``aotgrad.scan_function(fn).traced`` is the body it captured.

    >>> import torch, aotgrad
    >>> def step(c, x):
    ...     return c * x, None
    >>> run = aotgrad.scan_function(step, checkpoint=True)
    >>> c, ys = run(torch.ones(2, requires_grad=True), torch.full((3, 2), 2.0))
    >>> c, ys
    (tensor([8., 8.], grad_fn=<ScanLoopBackward>), None)
    >>> _ = aotgrad.scan(step, torch.ones(2, requires_grad=True), torch.ones(5, 2), checkpoint=True)
    >>> run.captures, aotgrad.scan_function(step, checkpoint=True) is run
    (1, True)
    """
    return _function_for(fn, checkpoint, options_of(options, "scan_function"))


@compiler_disabled
def scan(
    fn: Callable[..., Any],
    init: Any,
    xs: Any,
    *,
    checkpoint: bool = False,
    **options: Any,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` for PyTorch: ``(carry, ys)`` of ``fn(carry, x) -> (carry, y)`` over ``xs``.

    ``init``, ``xs``, ``carry`` and ``y`` are pytrees of tensors (``y`` may be None);
    ``ys`` stacks each ``y`` leaf on a new dim 0. Gradients reach ``init``, ``xs`` and
    every tensor ``fn`` closes over or reads from a module, summed over iterations,
    as through the unrolled loop. The body is captured once per function, options,
    structure, shapes and dtypes, whatever the length (kept per ``fn`` object:
    a new lambda each call captures again; :func:`scan_function` keeps it explicitly).
    ``checkpoint=True`` saves only each iteration's carry and recomputes the body in
    the backward; ``partition`` ("save_all", "mincut", ``aotgrad.budget(x)``), the
    compilers and ``aot_function``'s other options apply to the body.

    >>> import torch, aotgrad
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> def rnn(h, x):
    ...     h = torch.tanh(h @ w + x)
    ...     return h, h.sum()
    >>> h, ys = aotgrad.scan(rnn, torch.zeros(3), torch.randn(4, 3))
    >>> ys.shape
    torch.Size([4])
    >>> ys.sum().backward(); w.grad.shape
    torch.Size([3, 3])
    """
    return _function_for(fn, checkpoint, options_of(options, "scan"))(init, xs)


def _function_for(fn: Callable[..., Any], checkpoint: bool, options: Options) -> ScanFunction:
    def make() -> ScanFunction:
        return ScanFunction(fn, checkpoint=checkpoint, options=options)

    try:  # TypeError: fn not weakly referenceable, or unhashable options: no reuse
        by_options = _FUNCTIONS.setdefault(fn, {})
        return by_options.get((checkpoint, options)) or by_options.setdefault(
            (checkpoint, options), make()
        )
    except TypeError:
        return make()


with_option_keywords(scan)
with_option_keywords(scan_function)
