"""``set_()`` on an input: which storage the input ends up in, read off the full trace.

Note [set_() on an input]
~~~~~~~~~~~~~~~~~~~~~~~~~
``a.set_(src)`` makes ``a`` a tensor over ``src``'s storage, with ``src``'s size,
stride and offset; ``a`` stays the same autograd variable (FSDP swaps a
parameter's storage so, under ``torch.no_grad()``). After the call the caller's
tensor must be what eager leaves: over the same storage, with the same layout.
Functionalization tells, at the end of the trace, that ``a``'s storage changed
(``was_storage_changed``) and which functional storage it now has; capture
compares that with each input's storage before the call:

    def f(a, b, w):                      # a: (3,), b: (4,) caller tensors
        with torch.no_grad():
            a.set_(b[1:])                # a: b's storage, size (3,), offset 1
        a.mul_(2)                        # writes b's storage too (b[1:] doubles)
        return a * w

    mutations:  b  data         -> forward output "new value of b", copied into b
                a  NewStorage(source=b, layout=(3,), (1,), 1)   no forward output
    epilogue:   b.copy_(new value of b)
                a.set_(b.untyped_storage(), 1, (3,), (1,))      # after every copy_

The source's storage is the caller's storage as it was passed (read before any
replay), and the layout is measured there (Note [Layouts in the caller's
storage]). When the storage is one the function made (``a.set_(x * 2)``,
``a.set_()``), nobody outside the call holds it: the forward returns ``a``'s new
value (``MutatedInput(of=a, storage=True)``, "value set into a") and the
epilogue gives the caller's ``a`` a fresh storage of that layout holding it.

What capture makes uniform before the op runs:

- ``a.set_(storage, offset, size, stride)`` is ``a.set_(t.as_strided(size,
  stride, offset))`` for the input ``t`` owning ``storage``; ``a.set_()`` is
  ``a.set_`` of a fresh empty tensor; ``a.data = src`` (FSDP's ``param.data =
  ...``) is ``a.set_(src)`` under ``no_grad`` that keeps ``a``'s version, as
  eager's does (``NewStorage.keeps_version``); a module's real parameter is
  swapped for its traced value first (Note [Real tensors in a trace]).
- The functional wrapper of ``a`` takes its new size, strides and storage, so
  the function's own ``a.shape`` and aliasing analysis see eager's.

Refused, loudly: a write to an input's data before ``set_`` takes its storage
away (the storage it leaves would need its final values too: PyTorch's
AOTAutograd does not take it either); ``set_`` under grad mode on a tensor that
requires grad (eager records a ``grad_fn`` whose backward raises "derivative
for set_ is not implemented"; on a leaf eager raises at once, and so does
capture); ``set_`` leaving an input that requires grad in another size at the
end of the function (the compiled ``autograd.Function`` takes the input with its
size at the call; eager's gradient would have the new size). Away and back is
fine: ``a.set_(b9); a.set_(old)`` ends in ``a``'s size, and a gradient computed
from ``a`` while it had the other size fails autograd's own shape check in the
traced backward, as in eager; an output other than ``a`` itself over the
storage the function made for ``a`` (it would not share it); symbolic sizes
(torch's functional ``set_`` takes concrete ones).

Note [set_() on a view]
~~~~~~~~~~~~~~~~~~~~~~~
``v.set_(src)`` on a view ``v`` of an input (or buffer) moves ``v`` alone:
the input keeps its storage, size and values, and ``v`` is a tensor over
``src``'s storage. Autograd still calls ``v`` a view of its old base
(``v._base`` is the input), so two things follow::

    def f(x, y):                      # x: (3, 4), y: (4, 3)
        v = x.view(-1)
        with torch.no_grad():
            v.set_(y * 2)             # v: (4, 3), a storage the function made
        return v                      # eager: y * 2; x unchanged

- Outputs are grouped by the storage they are over, and a view's ``._base``
  is used only while it is over the same storage (``_storage_base`` in
  ``aliasing.py``): ``v`` is a fresh output, not ``x.as_strided(...)``
  rebuilt after the call (which read x's values, silently).
- If ``v`` requires grad (``x`` does), eager keeps ``v``'s view history:
  the gradient of ``v``'s new values flows into ``x`` through the old view's
  backward (an ``AsStridedBackward0`` autograd regenerates from ``x``), with
  no meaning for ``x``. Capture refuses such a ``set_`` (``_check_view``);
  with grad mode on, ``_check_grad`` refuses it first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from aotgrad._torch_compat import (
    FakeTensor,
    FunctionalTensor,
    from_functional_tensor,
    has_data_mutation,
    no_dispatch,
    set_version_counter,
    sync,
    was_storage_changed,
)
from aotgrad.capture.analyses.aliasing import ViewMeta, caller_layout
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

SET_OPS = frozenset(
    {
        aten.set_.source_Tensor,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.default,
    }
)

_Dispatch = Callable[..., Any]


@dataclass(frozen=True)
class NewStorage:
    """The storage ``set_()`` left an input in (Note [set_() on an input])."""

    # Graph input position whose storage, as the caller passed it, the input now shares;
    # None: a storage the function made, holding the input's new value (a forward output).
    source: int | None
    # The input's size, stride and offset in that storage.
    layout: ViewMeta
    # Set by ``t.data = source`` alone, which keeps ``t``'s version (``set_()`` bumps it).
    keeps_version: bool = False


class StorageSets:
    """The inputs of one full trace, to resolve and check its ``set_()`` calls."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        # Per input, its functional storage before the function ran: read at the first
        # set_() or storage resize, not before (reading a functional tensor's storage from
        # Python makes functionalization refuse to grow it later: ``x.resize_`` of a
        # subclass input's inner tensors).
        self._original_keys: list[Any] | None = None
        # Python (wrapper) storages of inputs, to find the tensor of a storage argument.
        self.by_storage: dict[Any, torch.Tensor] = {}
        self.leaves: set[int] = set()  # ids of inputs that are leaves requiring grad
        # Per input position, the bytes its caller's storage ends with (Note [Storage resizes
        # of an input]).
        self.resized: dict[int, Any] = {}
        # ids of inputs ``set_()`` itself moved (not only ``t.data = source``).
        self.set_directly: set[int] = set()
        # Inputs requiring grad that set_() gave another size: their size at the call, the
        # new one, and the user's line of that set_().
        self.size_changes: dict[int, tuple[tuple[Any, ...], tuple[Any, ...], Any]] = {}
        # Real tensors (a module's parameters) whose set_() reached dispatch as themselves:
        # autograd bumps their version on the way out, undone after the trace.
        self.real_targets: list[tuple[torch.Tensor, int]] = []

    def note_inputs(self, primals: Sequence[torch.Tensor], leaves: Sequence[bool]) -> None:
        self.inputs = list(primals)
        for p, leaf in zip(primals, leaves, strict=True):
            self.by_storage.setdefault(StorageWeakRef(p.untyped_storage()), p)
            if leaf:
                self.leaves.add(id(p))

    @property
    def original_keys(self) -> list[Any]:
        if self._original_keys is None:
            self._original_keys = [StorageWeakRef(p.elem.untyped_storage()) for p in self.inputs]  # type: ignore[attr-defined]
        return self._original_keys

    def set_(
        self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], run: _Dispatch
    ) -> Any:
        """Run one ``set_`` op in its ``set_(tensor)`` form (Note [set_() on an input])."""
        self.original_keys  # noqa: B018 (read before this set_ moves a storage)
        target = args[0]
        source = self._source(func, args, kwargs, run)
        _check_static(target, source)
        self._check_grad(target, source)
        self._check_view(target)
        self._check_size(target, source)
        self._check_no_write_before(target)
        if not _ASSIGNING.active:
            self.set_directly.add(id(target))
        run(aten.set_.source_Tensor, target, source)
        elem = target.elem
        with no_dispatch():  # the wrapper's own metadata and storage follow (Note above)
            aten.set_.source_Storage_storage_offset(
                target, source.untyped_storage(), elem.storage_offset(), elem.shape, elem.stride()
            )
        return target

    def _source(
        self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], run: _Dispatch
    ) -> torch.Tensor:
        target = args[0]
        if func is aten.set_.source_Tensor:
            return args[1] if len(args) > 1 else kwargs["source"]
        if func is aten.set_.default:
            return run(aten.empty.memory_format, [0], dtype=target.dtype, device=target.device)
        values = [*args[1:], *kwargs.values()]
        storage = values[0]
        owner = self.by_storage.get(StorageWeakRef(storage))
        if owner is None or owner.dtype != target.dtype:
            raise UnsupportedMutationError(
                format_error(
                    "set_() is given a storage that is not the storage of an input of the same"
                    " dtype (an intermediate's, or one reinterpreted as another dtype); aotgrad"
                    " can resolve only an input's storage",
                    user_frame_from_stack(),
                    "Pass a tensor instead: a.set_(t.as_strided(size, stride, offset)).",
                )
            )
        if func is aten.set_.source_Storage:  # all of it: the caller's storage, as the fake's
            nbytes = from_functional_tensor(owner.elem).untyped_storage().nbytes()  # type: ignore[attr-defined]
            return run(aten.as_strided.default, owner, [nbytes // owner.element_size()], [1], 0)
        offset, size = values[1], list(values[2])
        stride = list(values[3]) if len(values) > 3 and values[3] else _contiguous_strides(size)
        return run(aten.as_strided.default, owner, size, stride, offset)

    def note_real_target(self, target: Any) -> None:
        if isinstance(target, torch.Tensor) and not isinstance(target, FunctionalTensor):
            self.real_targets.append((target, target._version))

    @contextlib.contextmanager
    def real_versions_kept(self) -> Iterator[None]:
        """Around the trace: the real tensors set_() reached keep their versions."""
        try:
            yield
        finally:
            for t, version in reversed(self.real_targets):
                set_version_counter((t,), (version,))
            self.real_targets.clear()

    def resize(self, storage: Any, nbytes: Any) -> bool:
        """Note a resize of an input's storage; False when ``storage`` is no input's."""
        owner = self.by_storage.get(StorageWeakRef(storage))
        if owner is None:
            return False
        key = StorageWeakRef(owner.elem.untyped_storage())  # type: ignore[attr-defined]
        if key not in self.original_keys:
            return False
        self.resized[self.original_keys.index(key)] = nbytes
        return True

    def _check_grad(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if not torch.is_grad_enabled() or not (target.requires_grad or source.requires_grad):
            return
        where = user_frame_from_stack()
        if id(target) in self.leaves:
            raise InPlaceOnLeafError(
                format_error(
                    "a leaf Variable that requires grad is being used in an in-place operation"
                    " (set_(); eager PyTorch raises the same error)",
                    where,
                    "Wrap the set_() in torch.no_grad(), as FSDP does.",
                )
            )
        what = (
            "records the set_() in the history of the view's base (a buffer or input then"
            " requires grad), and a backward through it fails"
            if target._is_view()
            else "records a grad_fn whose backward raises 'derivative for set_ is not implemented'"
        )
        raise UnsupportedMutationError(
            format_error(
                "set_() runs with grad mode on, on a tensor that requires grad (or with a source"
                f" that does): eager {what}, and aotgrad cannot compile that",
                where,
                "Wrap the set_() in torch.no_grad(), or detach the source (a.set_(b.detach())).",
            )
        )

    def _check_view(self, target: torch.Tensor) -> None:
        """Refuse ``set_`` on a view that requires grad and is no input (Note [set_() on a view])."""
        if not target._is_view() or not target.requires_grad:
            return
        if any(p is target for p in self.inputs):
            return
        raise UnsupportedMutationError(
            format_error(
                "set_() on a view of a tensor that requires grad: the view keeps its autograd"
                " history, so eager sends the gradient of its new values into its old base,"
                " which aotgrad does not reproduce",
                user_frame_from_stack(),
                "Set a tensor that is no view (v = x.view(-1).detach()), or use the source"
                " directly instead of set_().",
            )
        )

    def _check_size(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Note a size change of an input that requires grad; refused only if the input ends
        the function in another size (``check_sizes``): one set_() away and one back is fine."""
        if not (any(p is target for p in self.inputs) and target.requires_grad):
            return
        change = self.size_changes.get(id(target))
        original = change[0] if change else tuple(target.elem.shape)  # type: ignore[attr-defined]
        if _same_size(original, source.shape):
            self.size_changes.pop(id(target), None)
        else:
            self.size_changes[id(target)] = (original, tuple(source.shape), user_frame_from_stack())

    def check_sizes(self) -> None:
        """Refuse an input requiring grad that set_() left in another size (Note [set_() on
        an input])."""
        for original, new, where in self.size_changes.values():
            raise UnsupportedMutationError(
                format_error(
                    f"set_() changes the size of an input that requires grad (from {original}"
                    f" to {new}); the compiled autograd.Function takes the input with its size"
                    " at the call, and eager's gradient of it would have the new size",
                    where,
                    "Set a tensor of the same size (a.set_(b.view_as(a))), or set_() the input"
                    " before calling the compiled function.",
                )
            )

    def _check_no_write_before(self, target: torch.Tensor) -> None:
        """Refuse ``set_`` on an input whose own storage the function already wrote."""
        if not any(p is target for p in self.inputs):
            return
        i = next(k for k, p in enumerate(self.inputs) if p is target)
        if StorageWeakRef(target.elem.untyped_storage()) != self.original_keys[i]:  # type: ignore[attr-defined]
            return  # a second set_: its storage is no longer the caller's
        sync(target)
        if has_data_mutation(target.elem):  # type: ignore[attr-defined]
            raise UnsupportedMutationError(
                format_error(
                    "the function changes an input's values and then gives it a new storage"
                    " (set_()); aotgrad replays set_() on the caller's tensor but not the write"
                    " into the storage it leaves",
                    user_frame_from_stack(),
                    "Change the values after set_() (they then go to the new storage), or"
                    " write into a clone.",
                )
            )

    def new_storages(
        self,
        graph_primals: Sequence[torch.Tensor],
        originals: Sequence[torch.Tensor],
    ) -> dict[int, NewStorage]:
        """Per input whose storage ``set_`` changed: where it is now."""
        self.check_sizes()
        found = {}
        for i, p in enumerate(graph_primals):
            if not any(p is q for q in self.inputs) or not was_storage_changed(p.elem):  # type: ignore[attr-defined]
                continue
            key = StorageWeakRef(p.elem.untyped_storage())  # type: ignore[attr-defined]
            keeps = id(p) not in self.set_directly
            if key in self.original_keys:
                j = self.original_keys.index(key)
                found[i] = NewStorage(j, caller_layout(p, originals[j]), keeps)
            else:
                found[i] = NewStorage(None, ViewMeta.of(p.elem), keeps)  # type: ignore[attr-defined]
        return found


class _Assigning(threading.local):
    active = False


_ASSIGNING = _Assigning()


def assigns_traced_data(target: Any, source: Any) -> bool:
    """``target.data = source`` on a traced tensor, run as ``set_()`` under ``no_grad`` that
    keeps ``target``'s version (Note [set_() on an input]); False for a real tensor."""
    if not isinstance(target, FunctionalTensor | FakeTensor):
        return False
    if source.dtype != target.dtype or source.device != target.device:
        raise UnsupportedMutationError(
            format_error(
                f"t.data = source changes the tensor's dtype or device ({target.dtype} on"
                f" {target.device} to {source.dtype} on {source.device}); aotgrad replays"
                " t.data = source as set_(), which keeps them",
                user_frame_from_stack(),
                "Assign a tensor of the same dtype and device, or do it outside the compiled"
                " function.",
            )
        )
    with data_assigned(target), torch.no_grad():
        target.set_(source)
    return True


@contextlib.contextmanager
def data_assigned(target: torch.Tensor) -> Iterator[None]:
    """Around the ``set_()`` that ``target.data = source`` is: it keeps ``target``'s version
    (Note [set_() on an input])."""
    version = target._version
    _ASSIGNING.active = True
    try:
        yield
    finally:
        _ASSIGNING.active = False
    set_version_counter((target,), (version,))


def _check_static(target: torch.Tensor, source: torch.Tensor) -> None:
    layouts = (*target.shape, *source.shape, *source.stride(), source.storage_offset())
    if any(isinstance(v, torch.SymInt) for v in layouts):
        raise UnsupportedMutationError(
            format_error(
                "set_() on a tensor with symbolic sizes (dynamic shapes): torch's functional"
                " set_() takes concrete sizes only",
                user_frame_from_stack(),
                "Compile this function with dynamic=False (each new size is traced again).",
            )
        )


# Note [Storage resizes of an input]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FSDP frees a parameter's memory between uses and fills it again, keeping the
# tensor: ``p.untyped_storage().resize_(0)``, later ``resize_(n)`` and ``p.copy_(full)``
# (or ``p.set_(...)``). A functional trace has no storages to resize, so capture
# watches ``UntypedStorage.resize_`` while it traces: a resize of an input's storage
# (as the caller passed it, or reached through an input ``set_()`` moved onto it)
# is noted as the number of bytes that storage ends with, and the epilogue resizes
# the caller's storage so. Worked example::
#
#     def f(p, full):                    # p: (4,), its storage freed (0 bytes)
#         p.untyped_storage().resize_(16)
#         p.copy_(full)                  # functional: new value of p = full
#         return p * 2
#     epilogue: p.untyped_storage().resize_(16); p.copy_(new value of p)
#
# The epilogue grows the storage before the input's other replays and shrinks it
# after them (a shrink before a write is undefined in eager); a storage that ends
# with 0 bytes gets no copy: its values are gone, as in eager, even where the
# function freed it, filled it and freed it again (the caller's storage holds 0
# bytes before and after, and a write into it would crash). Reading a freed input
# is undefined in eager (a crash, or garbage); the compiled function reads what
# the graph computes.

# Who hears of a storage resize while a trace runs: each answers True when it took it.
_WATCHING: list[Callable[[Any, Any], bool]] = []
_WATCH_LOCK = threading.Lock()
_STORAGE_RESIZE = torch.UntypedStorage.resize_


def _resize_watched(storage: Any, nbytes: Any) -> Any:
    for took in list(_WATCHING):
        if took(storage, nbytes):
            return storage
    return _STORAGE_RESIZE(storage, nbytes)


@contextlib.contextmanager
def resizes_watched(took: Callable[[Any, Any], bool]) -> Iterator[None]:
    """Route ``UntypedStorage.resize_`` calls to ``took`` while tracing (Note above); a call
    it does not take resizes as usual. (The direct trace's ``took`` stops it.)"""
    with _WATCH_LOCK:
        _WATCHING.append(took)
        torch.UntypedStorage.resize_ = _resize_watched  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        with _WATCH_LOCK:
            _WATCHING.remove(took)
            if not _WATCHING:
                del torch.UntypedStorage.resize_


def _same_size(old: Sequence[Any], new: Sequence[Any]) -> bool:
    return len(old) == len(new) and all(str(a) == str(b) for a, b in zip(old, new, strict=True))


def _contiguous_strides(size: Sequence[Any]) -> list[Any]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step = step * max(n, 1) if isinstance(n, int) else step * n
    return strides[::-1]


def check_set_outputs(
    tensors: Sequence[torch.Tensor],
    mutations: Sequence[Any],
    graph_primals: Sequence[torch.Tensor],
    primals: Sequence[torch.Tensor],
    descriptors: Sequence[Descriptor],
    where: UserFrame | None,
) -> None:
    """Refuse an output (other than the input itself) over a storage the function made and
    set into an input: the caller's input gets a storage of its own (Note [set_() on an input]).

    ``mutations``: the ``InputMutation`` list (each with ``index`` and ``storage``).
    """

    inputs = {id(p) for p in (*primals, *graph_primals)}
    for m in mutations:
        if m.storage is None or m.storage.source is not None:
            continue
        i = m.index
        key = storage_key(graph_primals[i])
        if any(id(t) not in inputs and storage_key(t) == key for t in tensors):
            raise UnsupportedMutationError(
                format_error(
                    f"the function sets a tensor it made into input {descriptors[i]} (set_())"
                    " and also returns that tensor or a view of it; aotgrad gives the caller's"
                    " input a storage of its own, so the two would not share memory as in eager",
                    where,
                    f"Return {descriptors[i]} itself, or a clone of the other output.",
                )
            )


__all__ = ["SET_OPS", "NewStorage", "StorageSets", "check_set_outputs", "resizes_watched"]
