"""Autocast around capture and the compiled graphs (Note [Autocast])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from aotgrad._torch_compat import any_autocast_enabled, autocast_supported_devices

__all__ = ["any_autocast", "autocast_off", "autocast_state"]

# Is autocast on for any device? (A C call: the runtime asks it on every call.)
any_autocast = any_autocast_enabled

# Note [Autocast]
# ~~~~~~~~~~~~~~~
# ``torch.autocast`` is dispatcher state, not an op: under it, ``x @ w`` on
# float32 tensors runs as a bfloat16 matmul. The trace runs under the caller's
# autocast, so the forward graph holds the casts autocast made, explicitly,
# and also every region the user turned it off in (HF's rotary embeddings
# compute in float32 under ``torch.autocast(enabled=False)``)::
#
#     def f(x, w):                              with torch.autocast("cpu", dtype=bfloat16):
#         y = x @ w                                 f(x, w)
#         with torch.autocast("cpu", enabled=False):
#             return y.float() @ w
#
#     forward graph:  y = mm(_to_copy(x, bf16), _to_copy(w, bf16))
#                     out = mm(_to_copy(y, f32), w)           # float32, as in eager
#
# Three consequences:
#
# - The graphs run with autocast off. Run under the caller's autocast, the
#   float32 ``mm`` above would be cast to bfloat16 again: a bfloat16 result,
#   silently, where eager returns float32.
# - Autocast is part of the cache key (Note [Ambient state] in ``cache/specializations.py``):
#   a graph captured without autocast has no casts, so a call under autocast
#   traces again; ``Traced`` objects, which never re-trace, refuse such a call.
# - The backward is traced with autocast off. Eager's backward runs under the
#   autocast of the ``.backward()`` call, which is outside the region in
#   ordinary use (PyTorch advises against backward under autocast): the
#   backward of the float32 ``mm`` above is a float32 ``mm``. A backward
#   called under autocast runs with it off when that changes nothing (its
#   matmuls already have autocast's dtype); otherwise it is refused
#   (``AutocastBackwardError``, naming the op and the forward line).

AutocastState = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The devices autocast is on for, with their dtypes; ``()`` when it is off (cheap then)."""
    if not any_autocast():
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in autocast_supported_devices()
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off for every device inside (Note [Autocast]); free when it is already off."""
    state = autocast_state()
    if not state:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device, _ in state:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield
