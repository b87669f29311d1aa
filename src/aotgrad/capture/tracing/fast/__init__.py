"""The fast path: the direct tracer and the fake-mode shortcuts, a layer capture can leave off.

Note [The fast path as a layer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Capture is right with PyTorch's machinery alone: the full trace
(functionalization inside ``make_fx``) in PyTorch's ``FakeTensorMode``, with
eager's ``view`` strides (``capture.tracing.fake``, Note [Eager strides for views]).
This package adds speed only, re-deriving what PyTorch does: the direct tracer
(``direct``, ``view_writes``: Notes [Direct tracing], [Writes through views,
directly]) and the fake mode's shortcuts (``fake``, ``layouts``,
``meta_kernels``). Its per-op rules sit in one table per kind, each entry
beside its rule (``layouts.LAYOUTS``, ``view_writes.VIEWS``,
``direct._UNANNOTATED_WRITES``), its private torch names in one section of
``_torch_compat``. ``fast=False`` (``AOTGRAD_FAST=0``) leaves it off: the full
trace only, in ``EagerViewsFakeMode``; ``tracer="direct"`` is then a
ValueError, a sparse input that requires grad is refused (the full trace
cannot differentiate it), and an aten op whose meta kernel raises (Note [Ops
without a meta kernel]) runs on zeros, PyTorch's fallback. The graphs are the same either way (Note [Two
tracers]), and a torch release that breaks a shortcut breaks ``fast=True`` only::

    fast on:   tracer "direct"   mm = aten.mm.default(x, w)   seq_nr 3, module "lin"
    fast off:  tracer "full"     mm = aten.mm.default(x, w)   seq_nr 3, module "lin"
"""

from aotgrad.capture.tracing.fast.direct import DirectTracer
from aotgrad.capture.tracing.fast.fake import FastFakeMode

__all__ = ["DirectTracer", "FastFakeMode"]
