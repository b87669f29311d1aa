"""Which inputs the function changed in place, and how the runtime replays that on the caller's.

Note [Input mutation]
~~~~~~~~~~~~~~~~~~~~~
The graphs are functional: an in-place op on an input becomes an
out-of-place op whose result is the input's *new value*, a forward output
(``MutatedInput``). After the call the runtime writes it back into the
caller's tensor. Worked example::

    def f(x, w):           # x = a * 1 (not a leaf), w requires grad
        x.mul_(w)           # data mutation, recorded by autograd
        x.t_()              # metadata mutation
        return x.sum()

    forward(x, w) -> (sum, mul, ...)   # mul: new value of x (shape as before t_)
    epilogue:  x.as_strided_(size=(3, 2), stride=(1, 3), offset=0)   # metadata first
               x.copy_(new value)       # under grad mode: new value requires grad

The copy-back runs outside the ``autograd.Function``, with grad mode on
exactly when the new value requires grad, so autograd records it as eager
would have recorded the in-place op: gradients flow from whatever later
uses ``x`` into the Function's new-value output, and through its cotangent
into ``w`` and the old ``x``. The backward differentiates with respect to
each input's value *before* the call (capture takes the inputs' gradient
edges before running the function). An input the backward needs that the
function then changes in place fails as in eager ("modified by an inplace
operation", raised by capture's own backward); an input the backward needs
whose size or strides the epilogue changes is saved as an alias of it
(Note [Replayed metadata keeps the version] in ``runtime/function.py``).

Eager's rules still apply: an in-place op with grad mode on, on a leaf
that requires grad (or a view of one), raises eager's error at the
user's line. Mutations autograd does not see — under ``torch.no_grad()``
(running statistics, optimizer-style updates) or through ``x.detach()`` and
``x.data`` — are copied back under ``no_grad``. An input ``set_()`` gives another
storage (or whose storage the function resizes) is replayed as Note [set_() on
an input] and Note [Storage resizes of an input] say (``capture/analyses/set_storage.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from aotgrad._torch_compat import (
    has_data_mutation,
    has_metadata_mutation,
    was_storage_changed,
)
from aotgrad.capture.analyses.aliasing import ViewMeta
from aotgrad.capture.analyses.set_storage import NewStorage
from aotgrad.errors import (
    InPlaceOnLeafError,
    UnsupportedMutationError,
    UserFrame,
    format_error,
    user_frame_from_stack,
)
from aotgrad.signature import Descriptor
from aotgrad.signature.storage import storage_key

aten = torch.ops.aten


@dataclass(frozen=True)
class PrimalInfo:
    """What capture needs to know about a real input beyond its fake twin."""

    is_leaf: bool
    requires_grad: bool
    # Position of the first input that is the very same tensor, if this one repeats it.
    duplicate_of: int | None

    @staticmethod
    def of_all(primals: Sequence[torch.Tensor]) -> tuple[PrimalInfo, ...]:
        first: dict[int, int] = {}
        duplicates = [first.setdefault(id(p), i) for i, p in enumerate(primals)]
        return tuple(
            PrimalInfo(p.is_leaf, p.requires_grad, None if d == i else d)
            for i, (p, d) in enumerate(zip(primals, duplicates, strict=True))
        )


@dataclass(frozen=True)
class InputMutation:
    """How the function changed one input in place (Note [Input mutation])."""

    # Primal position of the input.
    index: int
    # Its values changed: the new value is a forward output, copied back after the call.
    data: bool
    # Its size, stride and storage offset after the call, if they changed.
    metadata: ViewMeta | None
    # The mutation ran with grad mode on: the runtime replays it with grad mode on.
    with_grad: bool
    # The new value requires grad: copied back under grad mode, and it gets a cotangent.
    requires_grad: bool
    # ``set_()`` gave it another storage (Note [set_() on an input]); ``data`` then says
    # whether the forward returns its new value (a storage the function made).
    storage: NewStorage | None = None
    # The bytes the caller's storage ends with, when the function resized it (Note [Storage
    # resizes of an input] in ``capture/analyses/set_storage.py``): 0 means no copy-back.
    resized: Any = None

    @property
    def written_in_graph(self) -> bool:
        """With ``keep_inference_input_mutations``, the forward graph itself writes the new
        value: a data mutation only (Note [Mutations kept in the graph])."""
        return self.data and self.metadata is None and self.storage is None and self.resized is None


def analyze_mutations(
    primals: Sequence[torch.Tensor],
    grad_fns_before: Sequence[object],
    infos: Sequence[PrimalInfo],
    descriptors: Sequence[Descriptor],
    where: UserFrame | None,
    sites: Mapping[int, UserFrame | None],
    storages: Mapping[int, NewStorage] | None = None,
    resized: Mapping[int, Any] | None = None,
) -> list[InputMutation]:
    """Read each functional primal's mutation flags after the function ran.

    ``sites`` (by ``id`` of a primal) gives the user's line of its first
    in-place op, for errors; ``where`` (the function) otherwise. ``storages``:
    the inputs ``set_()`` moved, by position (Note [set_() on an input]);
    ``resized``: the bytes their storages end with, for the inputs whose storage
    the function resized (Note [Storage resizes of an input]).

    A mutation ran "with grad" when autograd recorded it: the primal's
    ``grad_fn`` changed. Mutations under ``no_grad`` or through ``.detach()``
    and ``.data`` leave it as it was.
    """
    mutations = _mutations(primals, grad_fns_before, infos, descriptors, where, sites, storages)
    resized = resized or {}
    by_index = {m.index: replace(m, resized=resized.get(m.index)) for m in mutations}
    for i, nbytes in resized.items():
        by_index.setdefault(i, InputMutation(i, False, None, False, False, resized=nbytes))
    return [by_index[i] for i in sorted(by_index)]


def _mutations(
    primals: Sequence[torch.Tensor],
    grad_fns_before: Sequence[object],
    infos: Sequence[PrimalInfo],
    descriptors: Sequence[Descriptor],
    where: UserFrame | None,
    sites: Mapping[int, UserFrame | None],
    storages: Mapping[int, NewStorage] | None,
) -> list[InputMutation]:
    mutations = []
    for i, (p, info) in enumerate(zip(primals, infos, strict=True)):
        if info.duplicate_of is not None:
            continue  # the first occurrence carries the mutation
        elem = p.elem  # type: ignore[attr-defined]
        if storages and i in storages:  # its data flag is the new storage's: not copied back
            new = storages[i]
            mutations.append(InputMutation(i, new.source is None, None, False, False, new))
            continue
        data = bool(has_data_mutation(elem))
        metadata = bool(has_metadata_mutation(elem))
        if not (data or metadata):
            continue
        with_grad = p.grad_fn is not grad_fns_before[i]
        if with_grad and info.is_leaf and info.requires_grad:
            where = sites.get(id(p)) or where
            raise InPlaceOnLeafError(
                format_error(
                    f"a leaf Variable that requires grad ({descriptors[i]}) is being used in"
                    " an in-place operation (eager PyTorch raises the same error)",
                    where,
                    "Mutate a copy (x = x.clone(); x.mul_(2)), or wrap the update in"
                    " torch.no_grad() if it must not be differentiated.",
                )
            )
        mutations.append(
            InputMutation(
                index=i,
                data=data,
                metadata=ViewMeta.of(p) if metadata else None,
                with_grad=with_grad,
                requires_grad=data and with_grad and p.requires_grad,
            )
        )
    return mutations


# Note [resize_() to the same size]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager's ``t.resize_(size)`` does nothing when ``size`` is already ``t``'s
# size (and no ``memory_format`` is given): the strides, the offset, the
# storage and the version all stay. Only a new size makes ``t`` contiguous.
# Functionalization's ``resize_`` always gives the tensor contiguous strides
# over its storage, so a strided tensor would be read as if it were
# contiguous, silently::
#
#     b = torch.randn(4, 3).t()        # (3, 4), strides (1, 3)
#     row = b[0]                       # (4,), stride (3,): elements 0, 3, 6, 9
#     row.resize_(4)                   # eager: no-op, still elements 0, 3, 6, 9
#                                      # functionalized: as_strided((4,), (1,)):
#                                      #   elements 0, 1, 2, 3
#
# So the full trace skips such a ``resize_`` (``resize_keeps_layout``), as
# eager's kernel returns early; it is the same for inputs, inputs sharing
# memory (Note [Aliased inputs]) and the function's own tensors. Autograd's
# check ("cannot resize variables that require grad") runs before dispatch,
# as in eager.
RESIZE_OPS = frozenset({aten.resize_.default, aten.resize_as_.default})


def resize_keeps_layout(func: object, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Is ``func`` a ``resize_`` (or ``resize_as_``) to the tensor's own size, with no memory
    format: a no-op in eager (Note [resize_() to the same size])?"""
    if func not in RESIZE_OPS or len(args) > 2 or kwargs.get("memory_format") is not None:
        return False
    target, size = args[0], args[1]
    if func is aten.resize_as_.default:
        size = size.shape
    return isinstance(target, torch.Tensor) and tuple(target.shape) == tuple(size)


# Note [Inputs a kernel resizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some in-place kernels resize an argument before writing it:
# ``fused_moving_avg_obs_fake_quant`` (QAT's ``FusedMovingAvgObsFakeQuantize``)
# resizes a per-channel observer's ``scale`` and ``zero_point`` from size
# (1,) to one entry per channel at its first call. Functionalization replaces
# the input with the kernel's functional result, so the input reports a data
# mutation and no metadata mutation, yet its size changed. Replayed as data
# alone, the new value would be copied into the old size::
#
#     scale: (1,) -> kernel writes (4,)     flags: data yes, metadata no
#     epilogue: scale.copy_(new (4,))       "doesn't match the broadcast shape"
#
# So a written input whose functional value's size differs from the size its
# wrapper came with carries its new layout as a metadata mutation: the epilogue resizes
# (restrides) the caller's tensor, growing its storage when needed, then
# copies the new value in, as the kernel did in eager.
def with_kernel_resizes(
    mutations: Sequence[InputMutation], graph_primals: Sequence[torch.Tensor]
) -> list[InputMutation]:
    """``mutations``, a written input whose functional value changed size without a metadata
    flag given its new layout (Note [Inputs a kernel resizes])."""
    resized = []
    for m in mutations:
        primal = graph_primals[m.index]
        inner = primal.elem  # type: ignore[attr-defined]  # the Python wrapper keeps its size
        if m.data and m.metadata is None and m.storage is None and inner.shape != primal.shape:
            m = replace(m, metadata=ViewMeta.of(inner))
        resized.append(m)
    return resized


def member_metadata_mutations(
    primals: Sequence[torch.Tensor],
    grad_fns_before: Sequence[object],
    sources: Sequence[tuple[int, ViewMeta | None]],
) -> list[InputMutation]:
    """Size, stride or offset changes of inputs traced as views of a synthetic base.

    Note [Aliased inputs]: the base carries the members' data mutations; a
    member's ``a.t_()`` changes only the view, so it is read off the view
    and replayed on the caller's tensor (``index`` is the user input position).
    """
    mutations = []
    seen: set[int] = set()
    for i, (p, (_, view)) in enumerate(zip(primals, sources, strict=True)):
        if view is None or id(p) in seen:
            continue
        seen.add(id(p))
        if was_storage_changed(getattr(p, "elem", p)):  # Note [set_() on an input]
            raise UnsupportedMutationError(
                format_error(
                    f"the function gives input {i} a new storage (set_()) while it shares memory"
                    " with another input; aotgrad replays set_() only on inputs that share"
                    " memory with no other input",
                    None,
                    "Pass inputs that do not share memory (clone one of them).",
                )
            )
        after = ViewMeta.of(p)
        if after == view:
            continue
        mutations.append(
            InputMutation(
                index=i,
                data=False,
                metadata=after,
                with_grad=p.grad_fn is not grad_fns_before[i],
                requires_grad=False,
            )
        )
    return mutations


def check_member_mutations(
    members: Sequence[InputMutation],
    mutations: Sequence[InputMutation],
    primals: Sequence[torch.Tensor],
    where: UserFrame | None,
) -> None:
    """Refuse a metadata mutation of a member that requires grad when the base's data changes.

    Autograd re-derives such a view from the base after a data mutation by
    replaying the view ops that made it, without the in-place ``t_()``
    that followed: the gradient would come back transposed (wrong, silently).
    """
    if not any(m.data for m in mutations):
        return
    for m in members:
        if primals[m.index].requires_grad:
            raise UnsupportedMutationError(
                format_error(
                    "the function changes the shape or strides of an input in place"
                    " (t_(), unsqueeze_(), as_strided_()) and the data of an input sharing its"
                    " memory, and the input requires grad; aotgrad cannot differentiate that"
                    " faithfully yet",
                    where,
                    "Use the out-of-place op (a = a.t()), or pass inputs that do not share"
                    " memory (clone one of them).",
                )
            )


# Note [Data mutation of a restrided input]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The epilogue replays an input's new size and strides first, then copies the
# new value, which has the new layout (Note [Input mutation]). That writes
# every element the function changed only if the new layout still reaches all
# of the old one's elements: ``t_()``, ``unsqueeze_()`` or a ``resize_()``
# that grows keep them, an ``as_strided_()`` onto fewer elements does not
# (functionalization does not tell which came first, so either order is refused)::
#
#     def f(x):                           # x: size (2,)
#         x.add_(1.5)                     # both elements change
#         x.as_strided_((1, 1), (0, 0), 0)
#     epilogue: x.as_strided_(...); x.copy_(new value)   # writes element 0 only
#
# Capture refuses that case.


def check_restrided_data(
    mutations: Sequence[InputMutation],
    originals: Sequence[torch.Tensor],
    descriptors: Sequence[Descriptor],
    where: UserFrame | None,
) -> None:
    """Refuse a data mutation the new layout cannot write back (Note above)."""
    for m in mutations:
        if m.data and m.metadata and not _reaches(m.metadata, ViewMeta.of(originals[m.index])):
            raise UnsupportedMutationError(
                format_error(
                    f"the function changes the values of input {descriptors[m.index]} and"
                    " its size or strides in place (as_strided_(), resize_()), so that it no"
                    " longer covers every element it had; aotgrad writes the new values back"
                    " through the new layout and could miss some",
                    where,
                    "Change the layout out of place (x = x.as_strided(...)), or return the new"
                    " values instead of writing them into the input.",
                )
            )


def _reaches(new: ViewMeta, old: ViewMeta) -> bool:
    """Does layout ``new`` reach every storage element ``old`` does?"""
    if new.is_symbolic or old.is_symbolic:
        return _same_elements(new, old)
    if _same_elements(new, old):
        return True
    if _contiguous(new) and _contiguous(old) and new.storage_offset == old.storage_offset:
        return math.prod(new.size) >= math.prod(old.size)  # resize_() that grows
    return _elements(old) <= _elements(new)


def _contiguous(layout: ViewMeta) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(layout.size, layout.stride, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _same_elements(new: ViewMeta, old: ViewMeta) -> bool:
    """A permutation, or size-1 dims added or dropped: the same elements (no guards needed)."""

    def dims(layout: ViewMeta) -> list[tuple[Any, Any]]:
        pairs = zip(layout.size, layout.stride, strict=True)
        return sorted((str(n), str(s)) for n, s in pairs if str(n) != "1")

    return str(new.storage_offset) == str(old.storage_offset) and dims(new) == dims(old)


def _elements(layout: ViewMeta) -> set[int]:
    offsets = {layout.storage_offset}
    for size, stride in zip(layout.size, layout.stride, strict=True):
        offsets = {o + i * stride for o in offsets for i in range(size)}
    return offsets if all(layout.size) else set()


# Note [Writes through overlapping views]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Functionalization writes an in-place op on a view back into the view's base
# through the inverse of each view op. ``expand``'s inverse adds up, over the
# expanded dimension, how much each copy changed: right for no op, since in
# eager every copy *is* the same element. Worked example::
#
#     def f(a):                               # a: (3, 4)
#         v = a.expand(2, 3, 4)               # stride 0 on dim 0
#         v.zero_()                           # eager: a is all zeros
#     functional:  a + sum(zero(v) - a, 0)    # = a - 2a = -a   (silently wrong)
#
# Eager refuses most such writes itself ("more than one element of the
# written-to tensor refers to a single memory location"), but not fills
# (``fill_``, ``zero_``, ``masked_fill_``), and the functional graph never runs
# eager's check. So capture refuses every in-place op whose target may overlap
# itself (a stride-0 dimension, or ``as_strided``/``unfold`` steps shorter than
# what the inner dimensions span).


def check_writable(
    func: object,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    where: UserFrame | None,
) -> None:
    """Refuse an in-place op that writes through a self-overlapping view (Note above).

    ``where``: the user's line of the first in-place op on the target.
    """
    name, written, _ = _tensor_arguments(func, args, kwargs)
    for target in written:
        if may_overlap(target):
            raise UnsupportedMutationError(
                format_error(
                    f"an in-place op ({name}) writes through a view in which several"
                    f" elements share one memory location (size {tuple(target.shape)}, stride"
                    f" {tuple(target.stride())}: made by expand(), as_strided() or unfold());"
                    " aotgrad's functional graph cannot replay that write faithfully",
                    where,
                    "Write to the tensor before expanding it, or write to a copy"
                    " (v = a.expand(...).clone()).",
                )
            )


def _tensor_arguments(
    func: object, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """The op's name, the strided tensors it writes, and all the strided tensors it gets.

    Nothing written for an op without a schema or an in-place view op (``t_()``,
    ``unsqueeze_()``, ``as_strided_()``: they change the view, not the data).
    """
    schema = getattr(func, "_schema", None)
    if schema is None or torch.Tag.inplace_view in getattr(func, "tags", ()):
        return "", [], []
    written: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    for position, argument in enumerate(schema.arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        found = [
            v
            for v in (value if isinstance(value, list | tuple) else [value])
            if isinstance(v, torch.Tensor) and v.layout is torch.strided
        ]
        tensors.extend(found)
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.extend(found)
    return schema.name, written, tensors


# Note [Writes that read overlapping memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An in-place op whose written-to tensor shares some, but not all, of its memory
# with a tensor the op reads is refused by eager before it runs::
#
#     base = torch.arange(10.)
#     a, b = base[0:4], base[2:6]         # elements 2 and 3 are in both
#     a.add_(b)   # eager: RuntimeError: unsupported operation: some elements of the
#                 # input tensor and the written-to tensor refer to a single memory location
#
# The functional graph computes ``a + b`` from the values before the write and writes
# it back into ``base``: a result (``[2, 4, 6, 8, 4, ...]``) where eager has none.
# Neither the fake tensors' meta kernels nor functionalization run eager's check, so
# capture runs it on every mutable op, with eager's rule (``get_overlap_status``): a
# read tensor over the written one's exact memory (``x.mul_(x)``) or over disjoint
# memory (``x[:, 0].add_(x[:, 1])``) is fine; two dense tensors over intersecting,
# unequal memory raise eager's RuntimeError, as an ``OpRuntimeError`` at the user's
# line. Eager skips the check when a tensor is not dense ("too hard") and then runs
# the kernel over the shared elements in its own order of reads and writes, which the
# functional graph cannot promise to match: capture compares the elements themselves
# there, and refuses when some are shared. Under dynamic shapes the comparisons of
# sizes are guards (the element comparison specializes them): a later call whose
# overlap differs fails them and is traced again. It runs on whatever tensors the op gets:
# inputs that overlap (traced over one synthetic base, Note [Aliased inputs]) and views
# of the function's own intermediates alike. Two calls whose inputs overlap differently
# have different storage offsets, hence different cache keys (``cache/specializations.py``): each call's
# overlap is the one its graph was checked for.

EAGER_PARTIAL_OVERLAP = (
    "unsupported operation: some elements of the input tensor and the written-to tensor"
    " refer to a single memory location. Please clone() the tensor before performing"
    " the operation."
)
_ELEMENTS_COMPARED = 1 << 20  # elements per tensor compared one by one, at most


def check_no_partial_overlap(
    func: object, args: Sequence[object], kwargs: Mapping[str, object]
) -> None:
    """Raise eager's error for a write that reads partially overlapping memory (Note above)."""
    name, written, tensors = _tensor_arguments(func, args, kwargs)
    for target in written:
        for other in tensors:
            why = None if other is target else _overlap(target, other)
            if why is None:
                continue
            if why == _PARTIAL:
                raise RuntimeError(EAGER_PARTIAL_OVERLAP)
            raise UnsupportedMutationError(
                format_error(
                    f"an in-place op ({name}) writes a tensor (size {tuple(target.shape)},"
                    f" stride {tuple(target.stride())}, offset {target.storage_offset()}) that"
                    f" {why} a tensor it reads (size {tuple(other.shape)}, stride"
                    f" {tuple(other.stride())}, offset {other.storage_offset()}); aotgrad's"
                    " functional graph cannot promise eager's result for such a write",
                    user_frame_from_stack(),
                    "Write to a copy, or read from one (a.add_(b.clone())).",
                )
            )


_PARTIAL = "partially overlaps"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Eager's ``get_overlap_status`` of a written ``a`` and a read ``b``: None when they
    share no memory or exactly the same memory, else why the write is refused.

    Under dynamic shapes the comparisons of symbolic sizes are guards: a later call
    whose sizes make the answer differ fails them and is traced again.
    """
    if storage_key(a) != storage_key(b):
        return None
    if a.numel() == 0 or b.numel() == 0:
        return None
    (a_begin, a_end), (b_begin, b_end) = _byte_range(a), _byte_range(b)
    if a_end <= b_begin or b_end <= a_begin:
        return None
    if _dense(a) and _dense(b):
        same = a_begin == b_begin and a_end == b_end and a.stride() == b.stride()
        return None if same else _PARTIAL
    same_layout = (
        a.element_size() == b.element_size()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
    if same_layout:
        return None  # the same elements, one for one
    # Eager finds this "too hard" and runs the kernel over any shared elements in its own
    # order of reads and writes: refused where elements are shared, or too many to compare.
    # Symbolic sizes are specialized here (``int()`` records the guards): rare enough.
    if max(a.numel(), b.numel()) > _ELEMENTS_COMPARED:
        return f"may share memory locations (over {_ELEMENTS_COMPARED} elements to compare) with"
    if a.element_size() == b.element_size():  # the same unit: compare element offsets
        shared = bool(_elements(_static(a)) & _elements(_static(b)))
    else:
        shared = bool(_byte_elements(a) & _byte_elements(b))
    return "shares some memory locations (not all) with" if shared else None


def _byte_range(t: torch.Tensor) -> tuple[Any, Any]:
    """First and one-past-last byte ``t`` touches in its storage (``t`` has elements)."""
    low = high = t.storage_offset()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride >= 0:
            high += (size - 1) * stride
        else:
            low += (size - 1) * stride
    return low * t.element_size(), (high + 1) * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """Eager's ``is_non_overlapping_and_dense``: some order of the dims is contiguous."""
    dims = [(stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size != 1]
    expected = 1
    for stride, size in sorted(dims, key=lambda d: d[0]):
        if stride != expected:
            return False
        expected *= size
    return True


def _static(t: torch.Tensor) -> ViewMeta:
    """``t``'s layout in ints (a symbolic size is specialized: ``int()`` records its guard)."""
    return ViewMeta(
        tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride()), int(t.storage_offset())
    )


def _byte_elements(t: torch.Tensor) -> set[int]:
    size = t.element_size()
    return {o * size + i for o in _elements(_static(t)) for i in range(size)}


def may_overlap(t: torch.Tensor) -> bool:
    """Can two elements of ``t`` share a memory location? (Sorted strides must clear the span.)"""
    if t.layout is not torch.strided:
        return False
    dims = [(stride, size) for size, stride in zip(t.shape, t.stride(), strict=True)]
    if not all(isinstance(v, int) for d in dims for v in d):  # symbolic: only stride 0
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return any(
            statically_known_true(s == 0) and not statically_known_true(n <= 1) for s, n in dims
        )
    if any(size == 0 for _, size in dims):
        return False
    span = 0  # how far the dimensions with smaller strides reach
    for stride, size in sorted(d for d in dims if d[1] > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False
