"""Tensor subclasses desugared into their inner tensors before capture, and rebuilt after it.

Note [Tensor subclasses]
~~~~~~~~~~~~~~~~~~~~~~~~
A traceable wrapper subclass (``DTensor``, or a test's ``TwoTensor`` holding
``a`` and ``b``) says how to take it apart: ``__tensor_flatten__`` names its
inner tensors and gives a context (a ``DTensor``'s placements), and
``__tensor_unflatten__`` builds it again from inner tensors, the context and
the outer size and stride. The graphs hold only plain tensors: each inner
tensor (recursively, for a subclass holding subclasses) is its own graph
input, named by its place, and the graph records the ops the subclass's
``__torch_dispatch__`` runs on the inner tensors. For ``f(x) = x * 2`` with
``x = TwoTensor(a, b)`` requiring grad::

    graph inputs:   x.a, x.b                      (Inner(of=Input("x"), attr="a"), ...)
    the trace:      x = TwoTensor(x.a, x.b)       rebuilt from the fake inner tensors
                    out = x * 2                   TwoTensor.__torch_dispatch__ runs:
                                                  mul(x.a, 2), mul(x.b, 2) reach the graph
    graph outputs:  output.a, output.b            the result taken apart again
    backward:       grad of x.a, grad of x.b

The rebuilding and taking apart are autograd functions (``_Wrap``,
``_Unwrap``), at trace time and at run time alike, so gradients cross them:
at trace time the function differentiates the rebuilt subclass and the
graph's grads are the inner tensors of its gradient; at run time the caller's
``x`` is taken apart for the compiled graphs, the outputs are rebuilt as the
subclass (same type, context and size as the trace's), and the caller's
``x.grad`` is rebuilt from the inner grads with the context the gradient had
in the trace (a ``DTensor`` parameter gets a ``DTensor`` grad with eager's
placements). One exception: a gradient whose inner tensors have other shapes
than the input's is redistributed to the input's placements in the trace, as
``DTensor.from_local``'s backward does, because the backward graph returns one
gradient per inner tensor, of that tensor's shape::

    x Shard(0) @ w Shard(1)      eager: w.grad Partial(sum), local 6x4 (w's local: 6x2)
                                 aotgrad: w.grad Shard(1), reduce-scattered in the backward
                                 (the same values; an optimizer step reads either alike)

The context and the inner tensors' metadata are part of the cache key: another
placement traces again. Non-tensor attributes the flattening names (a
``DTensor``'s ``device_mesh``) are kept as they are, by identity.

Beyond this: a plain input whose gradient is a subclass is split by that
gradient's layout (Note [Subclass gradients of plain inputs]); a subclass
input the function changes in place is changed as a whole on the caller's
side, its outer metadata and history included (Note [Subclass inputs changed
in place] in ``capture/analyses/subclass_inputs.py``); the inner tensors of subclass
inputs that share memory are aliased inputs like any others, part of the key
(Note [Inputs sharing memory without a common base] in
``capture/analyses/input_aliases.py``); a subclass output that is an input, another
output or a view of one aliases it as eager's does (Note [Aliased subclass
outputs]); and under ``create_graph=True`` the gradients stay differentiable
(Note [Subclass gradients under create_graph]).

A subclass without ``__tensor_flatten__`` cannot be taken apart: aotgrad
refuses it as an input (``UnsupportedSubclassError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    FakeTensor,
    FunctionalTensor,
    disable_current_modes,
    is_traceable_wrapper_subclass,
    set_view_creation,
    view_creation,
)
from aotgrad.errors import UnsupportedSubclassError, UserFrame, format_error
from aotgrad.signature.descriptors import Inner, PrimalDescriptor
from aotgrad.signature.views import check_views_still_usable, custom_functions

# Tensor types that are plain for aotgrad: no subclass behaviour to keep.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, FakeTensor, FunctionalTensor)


@dataclass(frozen=True, kw_only=True)
class SubclassMeta:
    """How one subclass tensor is taken apart and built again (Note [Tensor subclasses])."""

    cls: type
    # The context ``__tensor_flatten__`` returned (a DTensor's placements, ...).
    context: Any
    size: tuple[Any, ...]
    stride: tuple[Any, ...]
    # The tensor attributes ``__tensor_flatten__`` named, in order, and, per attribute, how
    # that attribute is taken apart in turn (None: it is a plain tensor).
    attrs: tuple[str, ...]
    inner: tuple[SubclassMeta | None, ...]
    # Attributes that are not tensors (a DTensor's device_mesh), kept by identity.
    opaque: tuple[tuple[str, Any], ...] = ()
    # The shape of each plain inner tensor, in the order of ``paths()``.
    shapes: tuple[torch.Size, ...] = ()

    @property
    def width(self) -> int:
        """How many plain tensors the subclass stands for."""
        return sum(1 if m is None else m.width for m in self.inner)

    def paths(self) -> list[str]:
        """The attribute path of each plain inner tensor: ``["a", "b"]``, ``["_local_tensor"]``."""
        out: list[str] = []
        for attr, meta in zip(self.attrs, self.inner, strict=True):
            out += [attr] if meta is None else [f"{attr}.{p}" for p in meta.paths()]
        return out

    def key(self) -> tuple[Any, ...]:
        """What a trace specializes on: type, context, structure, opaque attributes."""
        return (
            self.cls,
            _hashable(self.context),
            self.attrs,
            tuple(None if m is None else m.key() for m in self.inner),
            tuple((name, _hashable(value)) for name, value in self.opaque),
        )

    def same_structure(self, other: SubclassMeta) -> bool:
        return self.cls is other.cls and self.paths() == other.paths()


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def is_wrapper(t: object) -> bool:
    """Is ``t`` a traceable wrapper subclass (``__tensor_flatten__``)?

    >>> is_wrapper(torch.ones(1)), is_wrapper(torch.nn.Parameter(torch.ones(1)))
    (False, False)
    """
    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def meta_of(t: torch.Tensor) -> SubclassMeta | None:
    """How ``t`` is taken apart; None for a plain tensor."""
    if not is_wrapper(t):
        return None
    attrs, context = t.__tensor_flatten__()  # type: ignore[attr-defined]
    tensors, inner, opaque = [], [], []
    for attr in attrs:
        value = getattr(t, attr)
        if isinstance(value, torch.Tensor):
            tensors.append(attr)
            inner.append(meta_of(value))
        else:
            opaque.append((attr, value))
    meta = SubclassMeta(
        cls=type(t),
        context=context,
        size=tuple(t.size()),
        stride=tuple(t.stride()),
        attrs=tuple(tensors),
        inner=tuple(inner),
        opaque=tuple(opaque),
    )
    return replace(meta, shapes=tuple(x.shape for x in inner_tensors(t, meta)))


def inner_tensors(t: torch.Tensor, meta: SubclassMeta) -> list[torch.Tensor]:
    """The plain tensors ``t`` holds, in the order of ``meta.paths()``."""
    out: list[torch.Tensor] = []
    for attr, m in zip(meta.attrs, meta.inner, strict=True):
        value = getattr(t, attr)
        out += [value] if m is None else inner_tensors(value, m)
    return out


def rebuild(meta: SubclassMeta, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The subclass ``meta`` describes, built from its plain inner tensors (no autograd link)."""
    inner: dict[str, Any] = dict(meta.opaque)
    start = 0
    for attr, m in zip(meta.attrs, meta.inner, strict=True):
        width = 1 if m is None else m.width
        part = leaves[start : start + width]
        inner[attr] = part[0] if m is None else rebuild(m, part)
        start += width
    out: torch.Tensor = meta.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, meta.context, torch.Size(meta.size), meta.stride
    )
    return out


class GradMeta:
    """The layout of a subclass input's gradient, as the trace found it (Note [Tensor subclasses]).

    Written once, by the trace's backward; read by every run's backward.
    """

    def __init__(self) -> None:
        self.meta: SubclassMeta | None = None


class _Wrap(torch.autograd.Function):
    """Plain inner tensors -> the subclass; the backward takes the gradient apart."""

    @staticmethod
    def forward(ctx: Any, meta: SubclassMeta, grad: GradMeta | None, *leaves: torch.Tensor) -> Any:
        ctx.meta, ctx.grad_meta = meta, grad
        ctx.set_materialize_grads(False)
        return rebuild(meta, [t.detach() for t in leaves])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        meta: SubclassMeta = ctx.meta
        if grad is None:
            return (None, None, *([None] * meta.width))
        if ctx.grad_meta is None:  # a run's output: its cotangent as the trace's
            grad = _coerced(grad, tangent_meta(meta))
            return (None, None, *_taken_apart(grad, meta))
        grad = _conformed(grad, meta)  # the trace's input: record its gradient's layout
        grad_meta = meta_of(grad)
        assert grad_meta is not None
        ctx.grad_meta.meta = grad_meta
        return (None, None, *_taken_apart(grad, grad_meta))


class _Unwrap(torch.autograd.Function):
    """The subclass -> its plain inner tensors (views); the backward builds the gradient."""

    @staticmethod
    def forward(ctx: Any, meta: SubclassMeta, grad: GradMeta | None, outer: torch.Tensor) -> Any:
        ctx.meta, ctx.grad_meta = meta, grad
        ctx.set_materialize_grads(False)  # no gradient reaches x.a, x.b: x.grad stays None
        leaves = [t.view_as(t) for t in inner_tensors(outer, meta)]
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in leaves]
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if all(g is None for g in grads):
            return None, None, None
        filled = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, ctx.shapes, strict=True)
        ]
        recorded = ctx.grad_meta.meta if ctx.grad_meta is not None else None
        meta = recorded or tangent_meta(ctx.meta)
        if torch.is_grad_enabled() and any(g.requires_grad for g in filled):
            # Note [Subclass gradients under create_graph]
            return None, None, _Wrap.apply(meta, None, *filled)
        built = rebuild(meta, filled)
        return None, None, built.detach() if built.requires_grad else built


# Note [Subclass gradients under create_graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``_Wrap`` and ``_Unwrap`` are inverses, so each one's backward is the other:
# under ``create_graph=True`` (grad mode on in the backward) a subclass
# gradient is built from differentiable inner gradients with ``_Wrap``, and
# taken apart with ``_Unwrap``, so the gradient keeps its history through the
# compiled backward (Note [Differentiable backward] in
# ``runtime/higher_order.py``). Reading ``grad.a`` directly, or rebuilding
# with ``__tensor_unflatten__`` alone, would cut it. Worked example, ``x`` a
# ``TwoTensor`` requiring grad::
#
#     out = aot_function(lambda a: (a * a).sum())(x)
#     (g,) = autograd.grad(out, [x], create_graph=True)
#         _Unwrap.backward: g.a = 2 * x.a, g.b = 2 * x.b (each with history)
#                           g = _Wrap.apply(g.a, g.b)   requires grad, as eager's 2 * x
#     g.sum().backward()    _Wrap.backward takes the ones apart with _Unwrap:
#                           x.grad = TwoTensor(2, 2), as eager
# Without grad mode (a first-order backward) both build and take apart as before.


def _taken_apart(grad: torch.Tensor, meta: SubclassMeta) -> list[torch.Tensor]:
    """``grad``'s inner tensors; differentiable views of it when the backward records a graph
    (Note [Subclass gradients under create_graph])."""
    if torch.is_grad_enabled() and grad.requires_grad:
        return list(_Unwrap.apply(meta, None, grad))
    return inner_tensors(grad, meta)


# Note [Subclass gradients of plain inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A plain input's gradient is a subclass when the function mixes it with one:
# ``x * t`` with ``x`` plain and ``t = TwoTensor(a, b)`` gives eager's
# ``x.grad = TwoTensor(g * t.a, g * t.b)``. The backward graph returns plain
# tensors, one per graph input, so the first trace (which finds it, in the
# backward) raises ``SubclassGradients``, and the pipeline takes the call apart
# again with ``x`` *split* by its gradient's layout: ``x`` stands for as many
# graph inputs as the gradient has inner tensors, ``x`` itself in the first
# place, zeros (expanded from one element: no memory) in the others::
#
#     graph inputs:   x.a (x itself), x.b (zeros), t.a, t.b
#     the trace:      x' = _JoinGrad(x.a, x.b)    the identity on x.a; its backward
#                                                 takes the TwoTensor gradient apart:
#                                                 grad of x.a = g * t.a, of x.b = g * t.b
#     at each call:   _SplitGrad(x) -> (x, zeros); its backward builds the caller's
#                     x.grad = TwoTensor(grad of x.a, grad of x.b), with the layout (and
#                     context) the gradient had in the trace
#
# The inputs that only carry a gradient are never read by the forward. A
# function that builds a subclass from a plain input (``TwoTensor(x, x * 2)``)
# gives ``x`` no gradient at all in eager (the constructor is not
# differentiable), and none compiled.
def split_plain(p: torch.Tensor, split: SubclassMeta) -> list[torch.Tensor]:
    """``p`` and zeros standing for the other inner tensors of its gradient's layout."""
    zeros = [
        torch.zeros((), dtype=p.dtype, device=p.device).requires_grad_(p.requires_grad)
        for _ in split.shapes[1:]
    ]
    return [p, *(z.expand(shape) for z, shape in zip(zeros, split.shapes[1:], strict=True))]


class _SplitGrad(torch.autograd.Function):
    """A plain input -> itself and zeros; the backward builds its subclass gradient
    (Note [Subclass gradients of plain inputs])."""

    @staticmethod
    def forward(ctx: Any, split: SubclassMeta, grad: GradMeta | None, p: torch.Tensor) -> Any:
        ctx.split, ctx.grad_meta = split, grad
        ctx.set_materialize_grads(False)
        ctx.shapes = split.shapes
        ctx.like = p
        first, *zeros = split_plain(p.detach(), split)
        return (first.view_as(first), *zeros)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if all(g is None for g in grads):
            return None, None, None
        like = ctx.like
        filled = [
            torch.zeros(shape, dtype=like.dtype, device=like.device) if g is None else g
            for g, shape in zip(grads, ctx.shapes, strict=True)
        ]
        recorded = ctx.grad_meta.meta if ctx.grad_meta is not None else None
        return None, None, rebuild(recorded or ctx.split, filled)


class _JoinGrad(torch.autograd.Function):
    """A plain input and zeros -> the input; the backward takes its subclass gradient apart
    (at trace time: Note [Subclass gradients of plain inputs])."""

    @staticmethod
    def forward(
        ctx: Any, split: SubclassMeta, grad: GradMeta | None, p: torch.Tensor, *zeros: Any
    ) -> Any:
        ctx.split, ctx.grad_meta = split, grad
        ctx.set_materialize_grads(False)
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> Any:
        split: SubclassMeta = ctx.split
        if g is None:
            return (None, None, *([None] * split.width))
        if not is_wrapper(g):
            raise UnsupportedSubclassError(
                format_error(
                    f"a plain input's gradient was a {_type_name(split.cls)} in one trace and"
                    f" a plain {type(g).__name__} in the next",
                    None,
                    "Make the input's gradient one kind of tensor, or detach the input.",
                )
            )
        g = _conformed(g, split)
        grad_meta = meta_of(g)
        assert grad_meta is not None
        if ctx.grad_meta is not None:
            ctx.grad_meta.meta = grad_meta
        return (None, None, *inner_tensors(g, grad_meta))


class _Rebase(torch.autograd.Function):
    """Write new inner values into a subclass tensor in place; its history becomes theirs
    (Note [Subclass inputs rebased] in ``runtime/subclass_inputs.py``)."""

    @staticmethod
    def forward(ctx: Any, meta: SubclassMeta, x: torch.Tensor, *news: torch.Tensor) -> Any:
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        for t, new in zip(inner_tensors(x, meta), news, strict=True):
            t.copy_(new)
        ctx.mark_dirty(x)  # moves x's version on, as eager's in-place op did
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        meta: SubclassMeta = ctx.meta
        if grad is None:
            return (None, None, *([None] * meta.width))
        grad = _coerced(grad, tangent_meta(meta))
        return (None, None, *inner_tensors(grad, meta))  # the old value: overwritten, none


def rebase(x: torch.Tensor, news: Sequence[torch.Tensor | None]) -> None:
    """``x``'s inner tensors set to ``news`` in place, with their history (None: left as is)."""
    meta = meta_of(x)
    assert meta is not None, f"expected a tensor subclass, got {type(x)}"
    inner = inner_tensors(x, meta)
    _Rebase.apply(meta, x, *(t if n is None else n for t, n in zip(inner, news, strict=True)))


def takes_subclasses_apart(function: type) -> bool:
    """Is ``function`` one of aotgrad's own Functions that take a subclass apart or build it
    (not a user's custom ``autograd.Function``)?"""
    return function in (_Wrap, _Unwrap, _UnwrapAliased, _SplitGrad, _JoinGrad)


def _conformed(grad: torch.Tensor, meta: SubclassMeta) -> torch.Tensor:
    """``grad`` with the input's inner structure: a DTensor is redistributed to its placements."""
    grad_meta = meta_of(grad)
    if grad_meta is not None and grad_meta.same_structure(meta) and grad_meta.shapes == meta.shapes:
        return grad
    placements = _placements(meta)
    if placements is not None and hasattr(grad, "redistribute"):
        return grad.redistribute(placements=placements)
    raise UnsupportedSubclassError(
        format_error(
            f"the gradient of a {_type_name(meta.cls)} input is a {_type_name(type(grad))} whose"
            " inner tensors do not match the input's; aotgrad's backward graph returns one"
            " gradient per inner tensor of the input",
            None,
            "Make the subclass's backward return gradients of the input's own subclass and layout.",
        )
    )


def _coerced(grad: torch.Tensor, meta: SubclassMeta) -> torch.Tensor:
    """A run's cotangent of a subclass output, with the layout the trace gave it.

    The backward graph was traced with the output's own layout (a DTensor's placements);
    a caller's cotangent in another one (``out.full_tensor().sum().backward()`` sends a
    ``Replicate`` cotangent to a ``Partial`` output) is redistributed to it through the
    subclass's ``__coerce_same_metadata_as_tangent__``, as torch.compile does.
    """
    coerce = getattr(grad, "__coerce_same_metadata_as_tangent__", None)
    if coerce is not None:
        coerced = coerce(meta.context)
        grad = grad if coerced is None else coerced
    grad_meta = meta_of(grad)
    if grad_meta is None or not grad_meta.same_structure(meta) or grad_meta.shapes != meta.shapes:
        raise UnsupportedSubclassError(
            format_error(
                f"the cotangent of a {_type_name(meta.cls)} output is a"
                f" {_type_name(type(grad))} whose inner tensors do not match the output's;"
                " the backward graph was traced for cotangents of the output's own layout",
                None,
                "Send a cotangent of the output's subclass and layout (loss.backward() on a"
                " subclass loss sends ones of the loss's subclass).",
            )
        )
    return grad


# Note [Cotangents of partial DTensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The backward graph is traced for one layout of each subclass output's
# cotangent, and a run's cotangent is brought to it. That layout is the
# output's own, except that a ``DTensor`` output with a ``Partial`` placement
# (each rank holds a summand) gets a ``Replicate`` cotangent: the gradient of
# a sum with respect to each summand is the whole cotangent, on every rank,
# and it is what callers send (``out.full_tensor().sum().backward()``);
# DTensor refuses redistributing to ``Partial`` outside its own internals::
#
#     out = (x @ w).sum(0)        x Shard(0), w Replicate -> out Partial(sum)
#     cotangent traced as         Replicate: local = the full cotangent
#     a run's Replicate cotangent used as is; a Partial one is all-reduced first


def tangent_meta(meta: SubclassMeta) -> SubclassMeta:
    """The layout the trace gives a subclass output's cotangent (Note [Cotangents of partial
    DTensors])."""
    placements = _placements(meta)
    if placements is None or not any(_is_partial(p) for p in placements):
        return meta
    from torch.distributed.tensor import Replicate

    replicated = tuple(Replicate() if _is_partial(p) else p for p in placements)
    return replace(meta, context=(replicated, *meta.context[1:]))


def _is_partial(placement: Any) -> bool:
    is_partial = getattr(placement, "is_partial", None)
    return bool(is_partial()) if callable(is_partial) else False


def _placements(meta: SubclassMeta) -> Any:
    """A DTensor's placements, the first item of its flatten context; None for other types."""
    first = meta.context[0] if isinstance(meta.context, tuple) and meta.context else None
    return first if isinstance(first, tuple) else None


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --- Outputs ------------------------------------------------------------------------------------


class FlatOutput:
    """A subclass output taken apart: a pytree node whose children are its plain inner tensors.

    Its key paths are the inner tensors' places (``output.a``); the runtime builds the
    subclass again from it (``rebuild_outputs``), or, when ``alias`` says so, takes the
    tensor it aliases (Note [Aliased subclass outputs]).
    """

    def __init__(
        self, meta: SubclassMeta, tensors: Sequence[torch.Tensor], alias: OuterAlias | None = None
    ) -> None:
        self.meta = meta
        self.tensors = list(tensors)
        self.alias = alias


def _flatten_output_with_keys(
    node: FlatOutput,
) -> tuple[list[tuple[pytree.KeyEntry, torch.Tensor]], Any]:
    keys = [pytree.GetAttrKey(p) for p in node.meta.paths()]
    return list(zip(keys, node.tensors, strict=True)), (node.meta, node.alias)


pytree.register_pytree_node(
    FlatOutput,
    lambda node: (node.tensors, (node.meta, node.alias)),
    lambda tensors, context: FlatOutput(context[0], list(tensors), context[1]),
    flatten_with_keys_fn=_flatten_output_with_keys,
)


# Note [Aliased subclass outputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The graphs see a subclass output only as its inner tensors, and the plain
# rules (Note [Aliased outputs] in ``capture/analyses/aliasing.py``) rebuild those: the
# wrapper itself, built again by ``_Wrap``, would be a fresh tensor every
# time. Eager's wrapper is not: ``x.view(-1)`` of a ``TwoTensor`` input is a
# view of ``x`` (its ``._base``, its in-place rules), and ``v, v`` is one
# object twice. So capture decides the same things on the outer tensors, as
# the plain rules do on plain ones (``OuterAlias``), and the runtime applies
# them after the epilogue (after the input's own in-place changes are
# replayed, as eager's view sees them)::
#
#     def f(x):                     # x = TwoTensor(a, b), requires grad
#         v = x * 2
#         return v, v, x.view(-1), x.unbind(0)[0], v.t()
#
#     output[0] v          built by _Wrap from its inner outputs
#     output[1] v          OuterAlias("output", 0): output[0] itself
#     output[2]            OuterAlias("input", 0, view=(6,), (1,), 0): x.as_strided(...)
#     output[3]            the same, and unbind's MULTI_OUTPUT_NODE creation meta (Note
#                          [Multi-output views]): eager's in-place refusals hold
#     output[4] v.t()      OuterAlias("output", 0, view=(3, 2), (1, 3), 0)
#
# A view is rebuilt with the wrapper's own ``as_strided`` where it gives the
# traced inner layouts, which capture tries on a stand-in of the base built
# from meta-device inner tensors (a ``TwoTensor``, a one-scale wrapper); for
# others (a ``DTensor`` has no ``as_strided``) the output stays a fresh
# wrapper. A view of a wrapper the function does not return stays fresh too,
# except one of several views an op made at once (``(x * 2).unbind(0)``):
# eager refuses to change those in place, so each is made a view of its own
# fresh wrapper (``OuterAlias("self", ...)``) with that rule; its ``._base``
# is that wrapper, not eager's whole ``x * 2`` (docs/known-limitations.md).
@dataclass(frozen=True)
class OuterAlias:
    """What a subclass output aliases (Note [Aliased subclass outputs])."""

    # "input": a user input position; "output": an earlier subclass output's; "self": the
    # output's own wrapper (a multi-output view of a value not returned)
    source: str
    index: int
    # None: the same object ("self": an identity view of it)
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None
    creation: str | None = None  # the traced view's creation meta, kept on the rebuilt one
    with_grad: bool = True  # autograd recorded the view: rebuilt with grad mode on
    requires_grad: bool = True


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def _as_strided_rebuilds(t: torch.Tensor, meta: SubclassMeta, base: torch.Tensor) -> bool:
    """Does the wrapper's own ``as_strided`` of ``base`` give ``t``'s inner layouts? Tried,
    outside the trace's modes, on a stand-in of ``base`` built from meta-device inner
    tensors (a ``DTensor`` refuses it)."""
    base_meta = meta_of(base)
    if base_meta is None:
        return False
    inner = [(_layout(x), x.dtype) for x in inner_tensors(base, base_meta)]
    layout, wanted = _layout(t), [_layout(x) for x in inner_tensors(t, meta)]
    try:
        with disable_current_modes(), torch.no_grad():
            stand_in = rebuild(base_meta, [_meta_tensor(*x) for x in inner])
            view = stand_in.as_strided(*layout)
            got = [_layout(x) for x in inner_tensors(view, meta)]
    except Exception:  # any failure: not rebuildable this way
        return False
    return got == wanted


def _meta_tensor(layout: tuple[tuple[int, ...], tuple[int, ...], int], dtype: torch.dtype) -> Any:
    size, stride, offset = layout
    extent = 1 + offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    whole = torch.empty(extent if 0 not in size else 0, dtype=dtype, device="meta")
    return whole.as_strided(size, stride, offset)


def _outer_alias(
    t: torch.Tensor, meta: SubclassMeta, sources: Mapping[int, tuple[str, int]]
) -> OuterAlias | None:
    if id(t) in sources:
        return OuterAlias(*sources[id(t)], None)
    base = t._base
    if base is None:
        return None
    if id(base) not in sources:  # a view of a value not returned
        return _own_view(t)
    if not _as_strided_rebuilds(t, meta, base):
        return None
    if t.requires_grad and t.grad_fn is None:  # past a no_grad view: left fresh
        return None
    if any(not takes_subclasses_apart(f) for f in custom_functions(t)):
        return None  # a user's Function's backward, which as_strided would skip: left fresh
    creation = view_creation(t)
    keep = creation if creation in ("DEFAULT", "MULTI_OUTPUT_NODE") else None
    source, index = sources[id(base)]
    return OuterAlias(source, index, _layout(t), keep, t.grad_fn is not None, t.requires_grad)


def _own_view(t: torch.Tensor) -> OuterAlias | None:
    """A multi-output view of a subclass value the function does not return: a view of its own
    wrapper, with eager's rule for in-place changes (Note [Aliased subclass outputs])."""
    if view_creation(t) != "MULTI_OUTPUT_NODE":
        return None
    return OuterAlias("self", -1, None, "MULTI_OUTPUT_NODE", t.grad_fn is not None, True)


def flatten_outputs(result: Any, inputs: Sequence[torch.Tensor | None] = ()) -> Any:
    """``result`` with every subclass leaf taken apart into a :class:`FlatOutput` (at trace time).

    ``inputs``: the subclass inputs the body sees, by position (None for others), for the
    outputs that alias them (Note [Aliased subclass outputs]).
    """
    sources: dict[int, tuple[str, int]] = {
        id(t): ("input", i) for i, t in enumerate(inputs) if t is not None
    }
    count = [0]
    rebuilt = rebuilt_in_trace()

    def take_apart(t: Any) -> Any:
        meta = meta_of(t) if isinstance(t, torch.Tensor) else None
        if meta is None:
            return t
        # A real primal returned as is (``return self.weight``): its traced stand-in (Note
        # [Real subclass tensors in a trace])
        seen = t if rebuilt is None else rebuilt.traced.get(id(t), t)
        alias = _outer_alias(seen, meta, sources)
        sources.setdefault(id(seen), ("output", count[0]))
        count[0] += 1
        unwrap = _Unwrap if alias is None else _UnwrapAliased
        return FlatOutput(meta, unwrap.apply(meta, None, t), alias)

    leaves = pytree.tree_leaves(result)
    if not any(is_wrapper(leaf) for leaf in leaves):
        return result  # untouched: mapping would rebuild containers (a torch.Size as a tuple)
    check_views_still_usable([t for t in leaves if is_wrapper(t)], None)
    return pytree.tree_map(take_apart, result)


class _UnwrapAliased(_Unwrap):
    """``_Unwrap`` of an output the runtime takes from the tensor it aliases: its inner
    tensors are computed but not returned (Note [Aliased subclass outputs])."""


def rebuilt_from_alias(function: type) -> bool:
    """Does ``function`` take apart a subclass output the runtime does not build from its
    inner tensors (Note [Aliased subclass outputs])?"""
    return function is _UnwrapAliased


def unwrapped(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t``'s plain inner tensors as differentiable views: gradients of them reach ``t``."""
    meta = meta_of(t)
    assert meta is not None, f"expected a tensor subclass, got {type(t)}"
    return tuple(_Unwrap.apply(meta, None, t))


def rebuild_outputs(result: Any, primals: Sequence[torch.Tensor] = ()) -> Any:
    """``result`` with every :class:`FlatOutput` built again as its subclass, or taken from
    the tensor it aliases among ``primals`` and earlier outputs (at run time: Note [Aliased
    subclass outputs])."""
    built: list[torch.Tensor] = []

    def build(node: Any) -> Any:
        if not isinstance(node, FlatOutput):
            return node
        alias = node.alias
        if alias is None or alias.source == "self":
            out = _Wrap.apply(node.meta, None, *node.tensors)
            out = out if alias is None else _view_of(out, alias)
        else:
            source = primals[alias.index] if alias.source == "input" else built[alias.index]
            out = source if alias.view is None else _view_of(source, alias)
        built.append(out)
        return out

    return pytree.tree_map(build, result, is_leaf=lambda x: isinstance(x, FlatOutput))


def _view_of(source: torch.Tensor, alias: OuterAlias) -> torch.Tensor:
    with torch.set_grad_enabled(alias.with_grad):  # Note [Grad mode regions]
        view = source.view_as(source) if alias.view is None else source.as_strided(*alias.view)
    if alias.creation is not None and view._is_view():  # Note [Multi-output views]
        set_view_creation(view, alias.creation)
    if view.requires_grad and not alias.requires_grad:
        return view.detach()
    return view


def holds_flat_outputs(spec: pytree.TreeSpec) -> bool:
    """Does a result of this structure hold a subclass output (a :class:`FlatOutput`)?"""
    if spec.type is FlatOutput:
        return True
    return any(holds_flat_outputs(child) for child in spec.children())


# --- Inputs -------------------------------------------------------------------------------------


# A tensor's size, stride and storage offset.
Layout = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass
class InputChange:
    """How the function changed a subclass input in place, as a whole (Note [Subclass inputs
    changed in place]); written by the trace, read by every run's epilogue."""

    # The outer size, stride and storage offset after the call; None when they did not change.
    layout: Layout | None
    # The same for each plain inner tensor, in ``paths()`` order.
    inner_layouts: tuple[Layout | None, ...]
    # Autograd recorded the change on the outer tensor (grad mode on, it requires grad):
    # the runtime gives the caller's tensor the history of its new value.
    with_grad: bool
    # The forward graph's input positions of its plain inner tensors, in ``paths()`` order.
    positions: tuple[int, ...]


@dataclass(frozen=True)
class TracedInput:
    """A subclass input while a trace runs: the real tensor, the one the body sees (rebuilt
    from the inner graph inputs) and that one's ``grad_fn`` before the body ran."""

    real: torch.Tensor
    traced: torch.Tensor
    grad_fn_before: Any


@dataclass(frozen=True, kw_only=True)
class Subclasses:
    """The subclass inputs of one call, taken apart (Note [Tensor subclasses]).

    Built by :func:`take_apart_inputs`; held by ``FlatInputs.subclasses`` for the runtime.
    """

    # Per outer graph input (lifted state, then the user's tensors): None when plain.
    metas: tuple[SubclassMeta | None, ...]
    # Per outer graph input: where the trace writes its gradient's layout (None when plain
    # and its gradient is plain).
    grads: tuple[GradMeta | None, ...]
    # Per outer graph input: for a plain input whose gradient is a subclass, that gradient's
    # layout (Note [Subclass gradients of plain inputs]); None otherwise. Empty: none is.
    split: tuple[SubclassMeta | None, ...] = ()
    # Per outer graph input, written by the trace: how the function changed it in place
    # (None: plain, or left alone). Note [Subclass inputs changed in place].
    changes: list[InputChange | None] = field(default_factory=list)
    # Per outer graph input while the body runs (None when plain); emptied when it closes.
    traced: list[TracedInput | None] = field(default_factory=list)

    def inner_positions(self) -> list[tuple[int, ...]]:
        """Per outer graph input: the positions of its plain inner tensors among the flat
        inputs (one position for a plain input)."""
        out, start = [], 0
        for i in range(len(self.metas)):
            width = self.width(i)
            out.append(tuple(range(start, start + width)))
            start += width
        return out

    def split_at(self, i: int) -> SubclassMeta | None:
        """The gradient layout plain input ``i`` is split by (None: it is not)."""
        return self.split[i] if self.split else None

    def width(self, i: int) -> int:
        """How many plain graph inputs outer input ``i`` stands for."""
        meta = self.metas[i] or self.split_at(i)
        return 1 if meta is None else meta.width

    def take_apart(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The plain graph inputs of a call: each subclass replaced by its inner tensors.

        Differentiable: gradients of the inner tensors come back as the subclass's.
        """
        out: list[torch.Tensor] = []
        for i, (p, meta, grad) in enumerate(zip(primals, self.metas, self.grads, strict=True)):
            split = self.split_at(i)
            if split is not None:  # Note [Subclass gradients of plain inputs]
                differentiable = p.requires_grad and torch.is_grad_enabled()
                out += _SplitGrad.apply(split, grad, p) if differentiable else split_plain(p, split)
            elif meta is None:
                out.append(p)
            elif p.requires_grad and torch.is_grad_enabled():
                out += _Unwrap.apply(meta, grad, p)
            else:
                out += inner_tensors(p, meta)
        return out

    def build(self, inner: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outer inputs, built from the plain graph inputs (at trace time, differentiable)."""
        out: list[torch.Tensor] = []
        start = 0
        for i, (meta, grad) in enumerate(zip(self.metas, self.grads, strict=True)):
            split = self.split_at(i)
            if meta is None and split is None:
                out.append(inner[start])
                start += 1
                continue
            leaves = inner[start : start + self.width(i)]
            start += self.width(i)
            if split is not None:  # Note [Subclass gradients of plain inputs]
                joined = leaves[0].requires_grad and torch.is_grad_enabled()
                out.append(_JoinGrad.apply(split, grad, *leaves) if joined else leaves[0])
            elif meta is None:
                raise AssertionError("expected a subclass layout")
            elif any(t.requires_grad for t in leaves):
                out.append(_Wrap.apply(meta, grad, *leaves))
            else:
                out.append(rebuild(meta, leaves))
        return out


def check_plain_or_wrapper(
    primals: Sequence[torch.Tensor], descriptors: Sequence[PrimalDescriptor]
) -> None:
    """Refuse a tensor subclass aotgrad cannot take apart (no ``__tensor_flatten__``)."""
    for t, d in zip(primals, descriptors, strict=True):
        if type(t) in _PLAIN_TYPES or is_wrapper(t) or issubclass(type(t), torch.nn.Parameter):
            continue
        raise UnsupportedSubclassError(
            format_error(
                f"input {d} is a {_type_name(type(t))}, a tensor subclass without"
                " __tensor_flatten__/__tensor_unflatten__: aotgrad's graphs hold plain tensors"
                " and cannot keep what the subclass adds",
                None,
                "Pass a plain tensor (t.as_subclass(torch.Tensor)), or make the subclass a"
                " traceable wrapper (__tensor_flatten__ and __tensor_unflatten__, like"
                " DTensor); see Note [Tensor subclasses].",
            )
        )


class SubclassGradients(UnsupportedSubclassError):
    """Plain inputs whose gradients are tensor subclasses: the pipeline traces again with them
    split (Note [Subclass gradients of plain inputs]); raised to the user only when it cannot."""

    def __init__(self, message: str, layouts: dict[PrimalDescriptor, SubclassMeta]) -> None:
        super().__init__(message)
        self.layouts = layouts


def check_plain_grads(
    grads: Sequence[torch.Tensor | None], descriptors: Sequence[Any], where: UserFrame | None
) -> None:
    """Raise :class:`SubclassGradients` for plain graph inputs with tensor subclass gradients:
    the graph returns plain ones (Note [Subclass gradients of plain inputs])."""
    layouts: dict[PrimalDescriptor, SubclassMeta] = {}
    for g, d in zip(grads, descriptors, strict=True):
        meta = meta_of(g) if g is not None else None
        if meta is not None and not isinstance(d, Inner):
            layouts[d] = meta
        elif meta is not None:
            raise _refused(d, g, where)
    if layouts:
        d, meta = next(iter(layouts.items()))
        raise SubclassGradients(str(_refused(d, meta.cls, where)), layouts)


def _refused(d: Any, g: Any, where: UserFrame | None) -> UnsupportedSubclassError:
    kind = g if isinstance(g, type) else type(g)
    return UnsupportedSubclassError(
        format_error(
            f"the gradient of the plain tensor input {d} is a {_type_name(kind)}:"
            " a tensor subclass made from it inside the function (or mixed with a"
            " subclass input) sends a subclass gradient into a plain tensor, which"
            " the backward graph, holding plain tensors only, cannot return here",
            where,
            "Pass that input as the subclass itself (e.g. a DTensor, or"
            " TwoTensor(w, w)), or detach it inside the function.",
        )
    )


Body = Callable[[list[torch.Tensor]], contextlib.AbstractContextManager[Any]]


def take_apart_inputs(
    primals: Sequence[torch.Tensor],
    descriptors: Sequence[PrimalDescriptor],
    body: Body,
    dynamic_dims: Mapping[int, Sequence[int]] | None,
    split_grads: Mapping[PrimalDescriptor, SubclassMeta] | None = None,
) -> tuple[Subclasses | None, list[torch.Tensor], Body]:
    """How to take the call's subclass inputs apart (None: all plain), the plain graph inputs,
    and a body that builds the subclasses again and takes subclass outputs apart.

    ``descriptors`` name ``primals``; ``flatten.desugar`` renames them (``Inner``).
    ``split_grads``: plain inputs whose gradient a first trace found to be a subclass, by
    descriptor, with that gradient's layout (Note [Subclass gradients of plain inputs]).
    """
    check_plain_or_wrapper(primals, descriptors)
    metas = tuple(meta_of(p) for p in primals)
    split = tuple(
        (split_grads or {}).get(d) if m is None else None
        for d, m in zip(descriptors, metas, strict=True)
    )
    if not any(metas) and not any(split):
        return None, list(primals), _outputs_taken_apart(body)
    _refuse_dynamic(primals, metas, descriptors, dynamic_dims)
    _refuse_dynamic(primals, split, descriptors, dynamic_dims, "whose gradient is")
    subclasses = Subclasses(
        metas=metas,
        grads=tuple(
            None if m is None and g is None else GradMeta()
            for m, g in zip(metas, split, strict=True)
        ),
        split=split if any(split) else (),
    )
    inner = _plain_inner(primals, subclasses)
    return (
        subclasses,
        inner,
        _outputs_taken_apart(_inputs_built(body, subclasses, primals), subclasses),
    )


def _plain_inner(primals: Sequence[torch.Tensor], subclasses: Subclasses) -> list[torch.Tensor]:
    """The plain graph inputs: inner tensors detached, requiring grad as their subclass does."""
    out: list[torch.Tensor] = []
    for i, (p, meta) in enumerate(zip(primals, subclasses.metas, strict=True)):
        split = subclasses.split_at(i)
        if split is not None:  # not ``p`` itself: the swap finds ``p`` rebuilt (_JoinGrad)
            out += split_plain(p.detach().requires_grad_(p.requires_grad), split)
        elif meta is None:
            out.append(p)
        elif not p.requires_grad:  # views kept: Note [Inputs sharing memory without a common base]
            out += [t.detach() if t.requires_grad else t for t in inner_tensors(p, meta)]
        else:
            out += [t.detach().requires_grad_(True) for t in inner_tensors(p, meta)]
    return out


def _refuse_dynamic(
    primals: Sequence[torch.Tensor],
    metas: Sequence[SubclassMeta | None],
    descriptors: Sequence[PrimalDescriptor],
    dynamic_dims: Mapping[int, Sequence[int]] | None,
    what: str = "is",
) -> None:
    for p, meta, d in zip(primals, metas, descriptors, strict=True):
        if meta is not None and dynamic_dims and dynamic_dims.get(id(p)):
            raise UnsupportedSubclassError(
                format_error(
                    f"input {d} {what} a {_type_name(meta.cls)} and has dynamic dimensions;"
                    " aotgrad traces tensor subclasses with static sizes only",
                    None,
                    "Call without dynamic=True (and without aotgrad.dynamic marks on it).",
                )
            )


def _inputs_built(body: Body, subclasses: Subclasses, real: Sequence[torch.Tensor]) -> Body:
    real = list(real)

    @contextlib.contextmanager
    def built(inner: list[torch.Tensor]) -> Iterator[Any]:
        outer = subclasses.build(inner)
        pairs = [
            (r, t)
            for i, (r, t, meta) in enumerate(zip(real, outer, subclasses.metas, strict=True))
            if meta is not None or subclasses.split_at(i) is not None
        ]
        subclasses.traced[:] = [
            None if meta is None else TracedInput(r, t, t.grad_fn)
            for r, t, meta in zip(real, outer, subclasses.metas, strict=True)
        ]
        try:
            with _rebuilt(pairs), body(outer) as result:
                yield result
        finally:
            subclasses.traced.clear()

    return built


# Note [Real subclass tensors in a trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Capture swaps every real primal the function reaches for its traced value
# (Note [Real tensors in a trace]); a subclass primal's graph inputs are its
# inner tensors, and its traced value is the subclass rebuilt from them inside
# the body. So the body records, while it runs (the backward included), which
# rebuilt tensor stands for which real one, and the swap reads it: a
# closed-over ``TwoTensor`` parameter, or a module's, reached as
# ``self.weight``, is swapped like a plain one::
#
#     self.weight = Parameter(TwoTensor(a, b))   graph inputs: param weight.a, weight.b
#     x * self.weight                            x' * TwoTensor(weight.a', weight.b')
#
# Without it the real parameter was a constant of the graph and its gradient
# was lost. The record belongs to the running capture (captures take turns:
# Note [Capture sessions]), not to a thread: autograd's worker running the
# capture's backward reads it too. Only the capture's swap reads it; another
# thread's eager call of the same module reads the real parameter.
@dataclass(frozen=True)
class Rebuilt:
    """The rebuilt subclass tensors standing for real ones in the running capture."""

    # Traced tensor by ``id`` of the real one, and the real ones' types.
    traced: dict[int, torch.Tensor]
    kinds: frozenset[type]
    # The real tensors, keeping their ids valid.
    real: tuple[torch.Tensor, ...]

    def holds(self, t: object) -> bool:
        """Is ``t`` a real tensor or its rebuilt stand-in?"""
        return id(t) in self.traced or any(t is v for v in self.traced.values())


# The running capture's record; written only under the capture lock.
_REBUILT: list[Rebuilt | None] = [None]


def rebuilt_in_trace() -> Rebuilt | None:
    """The rebuilt subclass tensors of the running capture (Note [Real subclass tensors in a
    trace]); None outside one, or when it has none."""
    return _REBUILT[0]


@contextlib.contextmanager
def _rebuilt(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    outer = rebuilt_in_trace()
    if not pairs:
        yield
        return
    traced = {} if outer is None else dict(outer.traced)
    traced.update((id(r), t) for r, t in pairs)
    real = (*(outer.real if outer else ()), *(r for r, _ in pairs))
    _REBUILT[0] = Rebuilt(traced=traced, kinds=frozenset(type(r) for r in real), real=real)
    try:
        yield
    finally:
        _REBUILT[0] = outer


def _outputs_taken_apart(body: Body, subclasses: Subclasses | None = None) -> Body:
    @contextlib.contextmanager
    def taken_apart(inner: list[torch.Tensor]) -> Iterator[Any]:
        with body(inner) as result:
            traced = subclasses.traced if subclasses is not None else []
            inputs = [None if t is None else t.traced for t in traced]
            yield flatten_outputs(result, inputs)

    return taken_apart


def subclass_key(t: torch.Tensor) -> Any:
    """What a call's key holds of a subclass tensor beyond its outer metadata: its context and
    its inner tensors' metadata (Note [Tensor subclasses]); None for a plain tensor."""
    meta = meta_of(t)
    if meta is None:
        return None
    inner = tuple(
        (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad)
        for x in inner_tensors(t, meta)
    )
    return (meta.key(), inner)
