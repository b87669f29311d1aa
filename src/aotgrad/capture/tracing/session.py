"""One capture at a time, and what the process looks like while one runs.

Note [Capture sessions]
~~~~~~~~~~~~~~~~~~~~~~~
Tracing borrows process-wide state from torch: ``make_fx`` installs a global
patcher (``torch.fx._symbolic_trace.CURRENT_PATCHER``) and restores the
previous one when it ends. Two threads that trace at once restore each
other's patcher and one fails (``CURRENT_PATCHER is None``). Every capture
therefore runs under one process-wide lock: the *first* calls of a compiled
function from several threads capture one after another; later calls (cache
hits) never take it.

While a capture runs, :func:`capturing` is true in its thread. A compiled
function called from the traced code (``aot_function(g)`` called inside
``aot_function(f)``, an ``aot_module`` inside another one) then runs its
original function, so its ops are traced into the outer graph like any other
Python code::

    inner = aot_function(g); outer = aot_function(lambda x: inner(x).cos())
    outer(x)   capture of the lambda: inner(fake x) runs g(fake x) -> sin, mul
               outer graph: sin, mul, cos (one graph pair; inner is not compiled)

Note [Captures and other threads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Another thread may call the same model eagerly, or through its compiled
function, while one thread captures. What the capture changes must not reach
it:

- the module's parameters and buffers stay in place; the swap for the traced
  primals is a torch-function mode, which is per thread (Note [Module state in
  a trace]);
- what the capture must install process-wide (the global module hooks that
  record module paths, and its ``torch.manual_seed`` / ``get_rng_state``
  stand-ins, ``rng.rng_stand_ins``: Note [Reseeding inside the function]) acts only where that mode is
  active: in the capturing thread while it runs the function or its backward,
  and in an autograd worker running that backward (the engine hands its
  workers the caller's modes, not its Python thread-locals: on CUDA a
  checkpoint's recompute runs there). Elsewhere the hooks do nothing and the
  stand-ins call torch's own functions. :func:`capturing` is true there too,
  so a compiled function called by the recompute is traced through, as in the
  forward, instead of waiting for the capture lock its own capture holds;
- Dynamo, compiling a frame in another thread meanwhile, would read the
  global hook dicts while the capture adds and removes its hooks (it raised a
  ``KeyError`` building a guard on one that was gone): a capture also holds
  Dynamo's compile lock, when Dynamo is loaded. Every thread takes Dynamo's
  lock first, then the capture lock. (A ``torch.compile``'d module called
  meanwhile still sees the hooks, and warns about global hooks);
- concurrent first calls of one compiled function trace one specialization
  once (Note [Concurrent calls]).

Left shared, as torch's own compilers leave them: ``torch.compiler.is_compiling()``
is true in every thread while a capture runs (Note [Capture is compiling]),
and the CPU generator is stepped by the capture and put back after it (Note
[Recomputed random ops]): another thread drawing meanwhile draws from the
stepped stream.

Note [The caller's saved-tensor hooks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Hooks the caller set with ``torch.autograd.graph.saved_tensors_hooks`` around
a call are the caller's, not the function's: eager runs them on whatever each
call saves. A capture under them would run their pack/unpack on fake tensors
and trace their ops into the backward graph, so a function first called under
``pack = to(bfloat16)`` computed every later gradient from bfloat16-rounded
values, hooks or not (0.016 off eager on an 8x8 matmul). The outermost session
takes the caller's hooks off the stack while it traces and puts them back
after; at run time the compiled Function's saved values pass through whatever
hooks are active at that call, as any ``autograd.Function``'s do::

    with saved_tensors_hooks(to_bf16, to_f32):
        f(x, w).backward()    capture: no hooks in the graph; the call's saved values packed
    f(x, w).backward()        no hooks: eager's gradients

Hooks the traced function sets itself are part of it, traced like its other code.

A user error inside the traced code (a shape mismatch) makes the fake tensor
mode log the failed meta kernel with a traceback, once per trace attempt, before
aotgrad raises its own error: that logger is silenced for the session.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from aotgrad._torch_compat import (
    FAKE_TENSOR_LOGGER,
    dynamo_compile_lock,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    top_saved_tensors_hooks,
)
from aotgrad.capture.user_state.closed_over import in_capture

_LOCK = threading.RLock()


class _Depth(threading.local):
    """Per thread: how many capture sessions are open (0 unless set: read on every call)."""

    depth = 0


# ``SESSIONS.depth == 0`` and no function mode active: not ``capturing()`` (the last entry's
# check, Note [The common state, checked fast] in cache/specializations.py).
SESSIONS = _STATE = _Depth()


def capturing() -> bool:
    """Is a capture running in this thread (Note [Capture sessions])? Also in autograd's
    worker running the capture's backward (Note [Captures and other threads])."""
    return _STATE.depth > 0 or in_capture()


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Hold the capture lock and mark this thread as capturing (Note [Capture sessions])."""
    outermost = not capturing()
    # Dynamo's lock first, then ours, in every thread (Note [Captures and other threads]).
    with dynamo_compile_lock(), _LOCK, _logger_silenced(FAKE_TENSOR_LOGGER):
        hooks = _callers_hooks_suspended() if outermost else contextlib.nullcontext()
        with hooks:  # Note [The caller's saved-tensor hooks]
            _STATE.depth += 1
            try:
                yield
            finally:
                _STATE.depth -= 1


@contextlib.contextmanager
def _callers_hooks_suspended() -> Iterator[None]:
    """No saved-tensor hooks while inside; the caller's stack as it was after."""
    suspended = []
    while (hooks := top_saved_tensors_hooks(True)) is not None:
        suspended.append(hooks)
        pop_saved_tensors_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(suspended):
            push_saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def _logger_silenced(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was
