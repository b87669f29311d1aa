"""The fast path: the direct tracer and the fake-mode shortcuts, a layer capture can leave off.

Note [The fast path as a layer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Capture is right with PyTorch's own machinery alone: the full trace
(functionalization inside ``make_fx``) in PyTorch's ``FakeTensorMode``, with
eager's ``view`` strides (Note [Eager strides for views]). This package adds
speed only, and re-derives what PyTorch does; each part is checked against
what it skips:

- the direct tracer (``direct``, ``view_writes``): records ops without
  functionalization (Notes [Direct tracing], [Writes through views, directly]);
- the fake-mode shortcuts (``fake``, ``layouts``, ``meta_kernels``): layouts by
  rule, views on the meta device, ops straight on their meta kernels.

Per-op rules live in one table per kind, each entry registered beside its
rule: ``layouts.LAYOUTS``, ``view_writes.VIEWS`` (inverses and meta layouts),
``direct._UNANNOTATED_WRITES``; the private torch names they use sit in one
section of ``_torch_compat``. ``fast=False`` (``capture(..., fast=False)``,
``AOTGRAD_FAST=0``) leaves the layer off: the full trace only, in
:class:`~aotgrad.capture.fake.EagerViewsFakeMode`, and ``tracer="direct"`` is
a ValueError. The graphs are the same either way, node for node where the
direct tracer records them (Note [Two tracers]), values and provenance always::

    fast on:   tracer "direct"  mm = aten.mm.default(x, w)   seq_nr 3, module "lin"
    fast off:  tracer "full"    mm = aten.mm.default(x, w)   seq_nr 3, module "lin"

A new torch release that breaks a shortcut breaks ``fast=True`` only.
"""

from aotgrad.capture.fast.direct import DirectTracer
from aotgrad.capture.fast.fake import FastFakeMode

__all__ = ["DirectTracer", "FastFakeMode"]
