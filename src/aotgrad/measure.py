"""Measured peak memory of a step: what the allocator saw, to check a plan's predicted peak.

:func:`measure_peak` runs a step (typically a compiled function's forward and its backward)
once and returns the most bytes of tensor storage it held at one time, above what was
allocated when it started (Note [Measured peak]).

>>> import torch
>>> from aotgrad.measure import measure_peak
>>> x = torch.randn(1000)                   # 4000 bytes, allocated before the step
>>> measure_peak(lambda: x.sin().cos())     # sin (4000) and cos (4000) live at once
8000
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from aotgrad import _torch_compat as compat

__all__ = ["measure_peak"]


# Note [Measured peak]
# ~~~~~~~~~~~~~~~~~~~~
# On CPU the step runs under ``torch.profiler`` with ``profile_memory=True``,
# which reports every allocation and free of the CPU allocator with its size in
# bytes (the storage's ``nbytes``, not rounded); the peak is the largest running
# sum. The profiler only knows the allocations it saw made, so what existed
# before the step (parameters, inputs, gradients of earlier steps) is not
# counted, and neither are its frees: the peak is of what the step allocated.
# On CUDA the caching allocator's own statistics are read: its peak of
# allocated bytes since a reset, minus what was allocated before (sizes there
# are rounded up to 512-byte blocks, and a free of an older tensor does lower
# the count). That resets the device's peak statistics
# (``torch.cuda.reset_peak_memory_stats``): a ``max_memory_allocated`` read
# across a call of this function, or across a predicted peak's first look at
# a CUDA op (Note [Measured scratch space]), reads from that reset on::
#
#     x = torch.randn(1000)              # before the step: not counted
#     step: y = x.sin()   +4000          # running sum 4000
#           z = y.cos()   +4000          # 8000  <- the peak
#           del y         -4000          # 4000
#
# The profiler's own bookkeeping allocates nothing on the allocator it watches,
# so the count is exact: a prediction can be held to it byte for byte. Each
# profiler run would print two "USDT: ... profiler_start/stop" lines to stderr
# (a predicted peak measures every op once: hundreds of lines), so
# ``KINETO_LOG_LEVEL`` is set above kineto's highest level unless the process
# set it already (``KINETO_LOG_LEVEL=5`` shows them again).

# Above kineto's highest log level (USDT, 5): none of its lines is printed.
_KINETO_QUIET = "6"


def measure_peak(step: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Run ``step()`` once; the peak bytes of tensor storage it held at one time on ``device``,
    above what was allocated when it started (Note [Measured peak]).

    The step's result is dropped before this returns, but counted while it lived.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak(step, device)
    if device.type != "cpu":
        raise ValueError(f"measure_peak reads the CPU or CUDA allocator, not {device.type!r}")
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)  # read when the profiler starts
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        step()
    peak = running = 0
    for _, nbytes, kind in compat.profiler_memory_events(prof):
        if kind == "cpu":
            running += nbytes
            peak = max(peak, running)
    return peak


def _cuda_peak(step: Callable[[], object], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
