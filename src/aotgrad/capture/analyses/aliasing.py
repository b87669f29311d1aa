"""Which user outputs alias inputs or each other, decided on the traced outputs.

Note [Aliased outputs]
~~~~~~~~~~~~~~~~~~~~~~
An ``autograd.Function`` cannot return one tensor twice, nor two views of one
storage, and keep eager semantics: the second output steals the first's
``grad_fn`` and gradients through the first are lost (the seed notebook's
``fn_4`` had to clone outputs to get them back). So the runtime returns from
its ``autograd.Function`` only *fresh* outputs (each owning its storage), and
rebuilds every alias outside it, with ordinary autograd ops, from the tensor
it aliases. Worked example::

    def f(x, w):
        a = x @ w
        return a, a, a.t(), x.view(-1), a.view(-1)[:2]

    output[0] a               fresh: returned by the Function
    output[1] a               Alias(source=OUTPUT, index=0, view=None): the same object
    output[2] a.t()           Alias(OUTPUT, 0, view=size/stride/offset of a.t())
    output[3] x.view(-1)      Alias(GRAPH_INPUT, 0, view=...): a real view of the user's x
    output[4] a.view(-1)[:2]  Alias(OUTPUT, 0, view=...)

When every output of a storage is a view (``return a.t(), a.view(-1)`` with
``a`` not returned, or a lone ``return a.view(-1)``), the storage's base
``a`` becomes an extra forward output (an ``OutputBase``) and the views are
rebuilt from it, so that their ``._base`` is an intermediate as in eager. Of
several outputs that own one storage (``return v.detach(), v``), one that
requires grad is returned and the others are rebuilt from it: rebuilt from
``v.detach()``, ``v`` would be a leaf with no path to the inputs. Gradients flow from each
rebuilt view into its source through autograd, so cotangents are needed only
for the Function's own outputs. Views that change dtype or the lazy
conjugate/negative bit (``view(dtype)``, ``conj()``) cannot be rebuilt with
``as_strided`` and are returned fresh (a copy): see
``docs/known-limitations.md``. A rebuilt view keeps the rule autograd gave
the traced one for in-place changes (``unbind``'s outputs refuse them: Note
[Multi-output views]).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aotgrad._torch_compat import (
    FunctionalTensor,
    apply_view_meta_sequence,
    disable_current_modes,
    view_creation,
    view_meta_sequence,
    was_storage_changed,
)
from aotgrad.errors import UnsupportedMutationError, UserFrame, format_error
from aotgrad.signature.storage import storage_key
from aotgrad.signature.subclasses import rebuilt_from_alias, takes_subclasses_apart
from aotgrad.signature.views import ViewCreation, custom_functions


class AliasSource(enum.Enum):
    INPUT = "input"  # index is a user input position (the output *is* that tensor)
    GRAPH_INPUT = "graph input"  # index is a forward-graph input position
    OUTPUT = "output"  # index is the position of an earlier tensor output
    BASE = "base"  # index is a position among the OutputBase values


@dataclass(frozen=True)
class ViewMeta:
    """Where a view sits in its storage: rebuilt with ``base.as_strided(size, stride, offset)``."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def extent(self) -> int:
        """Elements of storage the view reaches: offset + 1 + the farthest stride step."""
        if 0 in self.size:
            return self.storage_offset
        steps = sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        return self.storage_offset + 1 + steps

    @staticmethod
    def of(t: torch.Tensor) -> ViewMeta:
        """``t``'s layout; under dynamic shapes it may hold ``SymInt`` (Note [Symbolic layouts])."""
        offset: Any = t.storage_offset()  # int, or SymInt under dynamic shapes
        return ViewMeta(tuple(t.shape), tuple(t.stride()), offset)

    @property
    def is_symbolic(self) -> bool:
        values = (*self.size, *self.stride, self.storage_offset)
        return any(isinstance(v, torch.SymInt) for v in values)

    def resolved(self, value_of: Callable[[Any], int]) -> ViewMeta:
        """The layout at one call: each ``SymInt`` replaced by ``value_of`` it."""
        size, stride = tuple(map(value_of, self.size)), tuple(map(value_of, self.stride))
        return ViewMeta(size, stride, value_of(self.storage_offset))


# Note [Symbolic layouts]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Under dynamic shapes the layout of an output view (or of an input after
# ``t_()``) is symbolic: ``F.pad(y, (0, 1)).reshape(-1)`` has size
# ``(s0*(s1 + 1),)``. The ViewMeta keeps the ``SymInt`` and the runtime
# evaluates it at each call from the graph inputs' real sizes (the trace's
# ShapeGuards bind ``s0``, ``s1``), then rebuilds the view with ``as_strided``.


# Note [Layouts in the caller's storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An output that aliases an input is rebuilt at run time with
# ``input.as_strided(size, stride, offset)`` on the caller's storage, so its
# layout must be where it sits *there*. Functionalization does not keep that
# after a data mutation: the input's wrapper now holds a fresh buffer (the
# result of the out-of-place op), and a view taken afterwards is measured in
# that buffer. Worked example, the input a view ``base[1:, ::2]`` of a 4x6
# tensor (size (3, 3), stride (6, 2), offset 6)::
#
#     def f(x):
#         x.mul_(2)          # x's value is now mul(x): contiguous, offset 0
#         return x.t()       # measured: stride (1, 3), offset 0
#                            # eager:    stride (2, 6), offset 6
#
# Functionalization does record every view's chain of view ops from its
# storage's base (the graph input, as the caller passed it; ``t_()`` on an
# input is a link of that chain too), so ``caller_layout`` replays the chain
# on the graph input's fake as it was before the call and measures the result.


def caller_layout(view: torch.Tensor, original: torch.Tensor) -> ViewMeta:
    """Where ``view`` sits in its graph input's storage, as the caller passed ``original``.

    ``view`` is a functional tensor over the storage of the graph input whose
    fake, before the call, is ``original`` (Note [Layouts in the caller's storage]).
    """
    # A direct trace records an in-place op on the input's own fake, whose layout stays
    # the caller's (a write of another layout stops it): no fresh buffer to replay past.
    if not isinstance(view, FunctionalTensor):
        return ViewMeta.of(view)
    chain = view_meta_sequence(view.elem)
    with disable_current_modes():  # measure only: nothing is traced or functionalized
        replayed = apply_view_meta_sequence(original, chain)
    return ViewMeta.of(replayed)


@dataclass(frozen=True)
class Alias:
    """How the runtime rebuilds an output from the tensor it aliases."""

    source: AliasSource
    index: int
    # None: the output *is* that tensor (same Python object); else a view of it.
    view: ViewMeta | None
    # Whether the rebuilt output requires grad (a detached alias does not).
    requires_grad: bool
    # Whether autograd recorded the view (it was made with grad mode on): the runtime
    # rebuilds it in the same grad mode (Note [Grad mode regions]).
    with_grad: bool
    # Recorded, but past a view made under no_grad: no autograd path to the source
    # (Note [Views past a no_grad view]).
    past_no_grad_view: bool = False
    # How autograd made the traced view: the rebuilt one gets the same rule for in-place
    # changes (Note [Multi-output views]). None when the output is no view, or one the
    # grad mode of the rebuild makes as eager does (made under no_grad or inference_mode).
    creation: ViewCreation | None = None

    @property
    def multi_output_view(self) -> bool:
        """Is the output one of several views an op made at once (``unbind``), or a view of one?"""
        return self.creation is ViewCreation.MULTI_OUTPUT_NODE


# Creation metas a view made with grad mode off gets from the mode itself: the runtime's
# rebuild, in the caller's mode, gives them as eager does (one trace serves both modes).
_FROM_GRAD_MODE = (ViewCreation.NO_GRAD_MODE, ViewCreation.INFERENCE_MODE)


def _alias(t: torch.Tensor, source: AliasSource, index: int, view: ViewMeta | None) -> Alias:
    creation = ViewCreation(view_creation(t)) if view is not None and t._is_view() else None
    return Alias(
        source=source,
        index=index,
        view=view,
        requires_grad=t.requires_grad,
        with_grad=t.grad_fn is not None,
        past_no_grad_view=_past_no_grad_view(t),
        creation=None if creation in _FROM_GRAD_MODE else creation,
    )


# Note [Multi-output views]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd remembers how it made each view (its creation meta) and lets that
# decide what an in-place change may do. The outputs of an op that returns
# several views at once (``unbind``, ``split``, ``split_with_sizes``,
# ``chunk``; not ``tensor_split``, which slices, nor ``unsafe_split``, which
# returns no views) share one backward node, so eager refuses to change any of
# them in place with grad mode on, and refuses to use one (to read its
# ``grad_fn``) after its base, or another view of the base, was changed in
# place. A later view of such a view keeps the rule (``x.unbind(0)[0].view(-1)``).
# Under ``no_grad`` the in-place change runs; a view made under ``no_grad``
# has that rule instead. Worked example::
#
#     def f(x):                  # x = leaf * 1, requires grad
#         return x.unbind(0)
#
#     a, b = f(x)
#     a.mul_(2)                  # eager: "Output 0 of Unbind is a view and is being
#                                #  modified inplace. This view is the output of a function
#                                #  that returns multiple views..."
#     x.mul_(2); b.sum()         # eager: "...its base or another view of its base has been
#                                #  modified inplace..."
#
# The runtime rebuilds ``a`` and ``b`` as ``x.as_strided(...)``: ordinary
# views, which would take both changes silently. So capture records each
# rebuilt output's creation meta as the trace's autograd made it
# (``Alias.creation``: ``MULTI_OUTPUT_NODE`` for ``a`` and ``b``), the
# signature names such an output (``output[0] (multi-output view)``), and the
# runtime gives the rebuilt view the same creation meta, so that autograd
# applies eager's rule to it. Its error then names the rebuilding op (``Output
# 0 of AsStrided``) where eager names ``Unbind``; the rule is the same. The
# same holds for every rule: an output that is a view of an input that does not
# require grad, made with grad mode on, is rebuilt under ``no_grad`` but keeps
# eager's ``DEFAULT`` (``out.mul_(w)`` with ``w`` requiring grad runs). A view
# made under ``no_grad`` (or ``inference_mode``) keeps the creation meta its
# rebuild gets, in the same mode: calls under either mode share one trace.
#
# One state cannot be rebuilt: a view whose base the function itself changes
# after making it (``a, b = x.unbind(0); x.mul_(2); return a, b``). Eager
# returns it and refuses its first use; the runtime's view would be made
# after the change, and usable. Capture refuses such an output
# (``check_views_still_usable``), as PyTorch's AOTAutograd does.


# Note [Views past a no_grad view]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A view made under ``no_grad`` of a tensor that requires grad requires grad
# itself but has no ``grad_fn`` and no gradient accumulator; a view of it made
# with grad mode on records a node whose edge leads nowhere. Eager's output
# requires grad, yet no gradient reaches the input::
#
#     with torch.no_grad():
#         v = a.view(-1)        # requires_grad, grad_fn None
#     return v.expand(2, 4)     # ExpandBackward0, next_functions ((None, 0),)
#
# Rebuilt as ``a.as_strided(...)`` with grad mode on, the output would send
# its gradient into ``a``. So the runtime rebuilds such an output the way it
# was made: ``as_strided`` under ``no_grad``, then an identity view with grad
# mode on.


def _past_no_grad_view(t: torch.Tensor) -> bool:
    """Does ``t``'s chain of view nodes end in an edge to nowhere (Note [Views past a no_grad view])?"""
    if t._base is None:
        return False
    node, stop = t.grad_fn, t._base.grad_fn
    while node is not None and node is not stop:
        edges = node.next_functions
        if len(edges) != 1:
            return False
        if edges[0][0] is None:
            return True
        node = edges[0][0]
    return False


@dataclass(frozen=True)
class TensorOutput:
    """A tensor leaf of the user's result."""

    # Position among the tensor outputs of the forward graph.
    index: int
    # None when the output is fresh: produced by the forward graph and returned as is.
    alias: Alias | None
    requires_grad: bool


@dataclass(frozen=True)
class ConstantOutput:
    """A non-tensor leaf (None, a number, ...) or a tensor the function did not compute."""

    value: Any


OutputLeaf = TensorOutput | ConstantOutput


@dataclass(frozen=True)
class OutputAliasing:
    """The result of :func:`analyze_aliasing`: how to produce every tensor output."""

    # Per tensor output, in order.
    outputs: tuple[TensorOutput, ...]
    # For each OutputBase: the tensor outputs rebuilt from it.
    base_members: tuple[tuple[int, ...], ...]


def analyze_aliasing(
    tensors: Sequence[torch.Tensor],
    primals: Sequence[torch.Tensor],
    graph_primals: Sequence[torch.Tensor],
    originals: Sequence[torch.Tensor],
) -> tuple[OutputAliasing, list[torch.Tensor]]:
    """Classify traced tensor outputs; return the analysis and the base tensors to output.

    ``primals`` are the user's inputs, ``graph_primals`` the graph's (they
    differ when inputs share memory, Note [Aliased inputs]); ``originals``
    the graph inputs' fakes before the call, where aliases of inputs are
    measured (Note [Layouts in the caller's storage]).
    """
    input_ids: dict[int, int] = {}
    input_storages: dict[Any, int] = {}
    for i, p in enumerate(primals):
        input_ids.setdefault(id(p), i)
    for i, p in enumerate(graph_primals):
        if not _storage_set(p):  # its storage is another's now (Note [set_() on an input])
            input_storages.setdefault(storage_key(p), i)
    aliases: list[Alias | None] = [None] * len(tensors)
    first_index: dict[int, int] = {}
    groups: dict[Any, list[int]] = {}
    custom_owners: dict[Any, list[int]] = {}
    for k, t in enumerate(tensors):
        storage = storage_key(t)
        if id(t) in input_ids:
            aliases[k] = _alias(t, AliasSource.INPUT, input_ids[id(t)], None)
        elif id(t) in first_index:  # one tensor returned twice: the same object twice
            aliases[k] = _alias(t, AliasSource.OUTPUT, first_index[id(t)], None)
        elif custom_functions(t):
            first_index[id(t)] = k
            # Note [Inputs returned by a custom Function]: the first is returned, others alias it
            owners = custom_owners.setdefault(storage, [])
            owner = next((o for o in owners if _covers(tensors[o], t)), k)
            if owner == k:  # the first, or one no earlier owner's elements hold: returned
                owners.append(k)
            else:
                view = ViewMeta.of(t)
                if storage in input_storages:
                    view = caller_layout(t, originals[input_storages[storage]])
                aliases[k] = _alias(t, AliasSource.OUTPUT, owner, view)
        elif storage in input_storages and _rebuildable(t, graph_primals[input_storages[storage]]):
            first_index[id(t)] = k
            source = input_storages[storage]
            view = caller_layout(t, originals[source])
            aliases[k] = _alias(t, AliasSource.GRAPH_INPUT, source, view)
        else:
            first_index[id(t)] = k
            groups.setdefault(storage, []).append(k)
    bases: list[torch.Tensor] = []
    members: list[tuple[int, ...]] = []
    for group in groups.values():
        if len(group) > 1 or _storage_base(tensors[group[0]]) is not None:
            _alias_group(group, tensors, aliases, bases, members)
    outputs = tuple(
        TensorOutput(k, alias, t.requires_grad)
        for k, (t, alias) in enumerate(zip(tensors, aliases, strict=True))
    )
    return OutputAliasing(outputs, tuple(members)), bases


def _covers(owner: torch.Tensor, t: torch.Tensor) -> bool:
    """Does every element of ``t`` lie among ``owner``'s, so that ``owner.as_strided`` rebuilds
    ``t`` and sends all of its gradient back (Note [Inputs returned by a custom Function])?
    Checked for an ``owner`` without gaps (its elements fill its span of the storage)."""
    mine, view = ViewMeta.of(owner), ViewMeta.of(t)
    if mine.is_symbolic or view.is_symbolic:  # not decided on symbolic sizes: as before
        return True
    if not owner.is_contiguous():
        return False
    return t.numel() == 0 or (
        view.storage_offset >= mine.storage_offset and view.extent <= mine.extent
    )


def _storage_set(p: torch.Tensor) -> bool:
    return isinstance(p, FunctionalTensor) and bool(was_storage_changed(p.elem))


def _alias_group(
    group: list[int],
    tensors: Sequence[torch.Tensor],
    aliases: list[Alias | None],
    bases: list[torch.Tensor],
    members: list[tuple[int, ...]],
) -> None:
    """Rebuild every output of one storage from one fresh tensor (Note [Aliased outputs])."""
    source, base, index = _group_source(group, tensors, len(bases))
    rebuilt = []
    for k in group:
        t = tensors[k]
        if (k == index and source is AliasSource.OUTPUT) or not _rebuildable(t, base):
            continue
        aliases[k] = _alias(t, source, index, ViewMeta.of(t))
        rebuilt.append(k)
    if source is AliasSource.BASE and rebuilt:
        assert base is not None
        bases.append(base)
        members.append(tuple(rebuilt))


def _group_source(
    group: list[int], tensors: Sequence[torch.Tensor], num_bases: int
) -> tuple[AliasSource, torch.Tensor | None, int]:
    """The tensor one storage's outputs are rebuilt from: an output, or a base to add.

    One that requires grad when any output does (Note [Aliased outputs]): ``v``,
    not ``v.detach()``; the base of ``v.view(-1)`` when ``v`` is not returned.
    """
    owners = [k for k in group if _storage_base(tensors[k]) is None]
    needs_grad = any(tensors[k].requires_grad for k in group)
    for k in owners:
        if tensors[k].requires_grad or not needs_grad:
            return AliasSource.OUTPUT, tensors[k], k
    views = [k for k in group if _storage_base(tensors[k]) is not None]  # not empty: see above
    view = next((k for k in views if tensors[k].requires_grad), views[0])
    return AliasSource.BASE, _storage_base(tensors[view]), num_bases


def _storage_base(t: torch.Tensor) -> torch.Tensor | None:
    """``t._base`` while ``t`` still views its memory; None when ``t`` owns its storage, or
    when ``set_()`` moved it off its base's (Note [set_() on a view])."""
    base = t._base
    if base is None or storage_key(base) != storage_key(t):
        return None
    return base


# Note [Inputs returned by a custom Function]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A custom ``autograd.Function`` may return its input, or a view of it,
# without ``mark_dirty``. Eager returns a view of the input whose ``grad_fn``
# is the Function's backward, so the gradient goes through that backward::
#
#     class Double(Function):  forward: return x;  backward: return 2 * g
#     y = Double.apply(x)      # y shares x's storage; grad of x = 2 * g
#
# Rebuilt with ``as_strided`` from the input, ``y`` would get the gradient
# of a view (g, not 2g). So an output that reaches its input through a
# custom Function (between it and its ``._base``) is returned by the
# runtime's Function as its own output, with a cotangent: the forward graph
# returns the input (or its view), autograd makes it a view of the caller's
# tensor as eager does, and the backward graph holds the Function's
# backward. The same holds for a view of an intermediate. Other outputs of
# that storage are rebuilt from it when its elements hold theirs (``_covers``):
# ``as_strided``'s backward sends a rebuilt view's gradient only to its
# source's elements. Otherwise the output is returned by the Function too::
#
#     Rows.apply(x) returns x[0], x[1]   each returned: x[1] rebuilt from x[0]
#                                        would lose its gradient (eager: 3 * g1)
#
# aotgrad's own ``_Unwrap`` is such a Function: the inner tensors of two
# subclass outputs viewing one intermediate (``(x * 3).unbind(0)`` of a
# ``TwoTensor``) are each returned.


# What made a view whose use eager refuses once its base changed in place (Note [Multi-output
# views]), as a refusal names it.
def check_custom_views_of_mutated(
    tensors: Sequence[torch.Tensor], mutated: Sequence[torch.Tensor], where: UserFrame | None
) -> None:
    """Refuse an output a custom Function made of an input the function mutates.

    The forward graph can only return such an output as a view of the input's
    *new value* (a fresh buffer), not of the caller's tensor, which eager's
    output shares memory with (Note [Inputs returned by a custom Function]).
    The refusal names the Function: a user's, or aotgrad's own that takes a
    tensor-subclass output apart (Note [Tensor subclasses]).
    """
    storages = {storage_key(p) for p in mutated}
    for t in tensors:
        functions = custom_functions(t) if storage_key(t) in storages else []
        if not functions or rebuilt_from_alias(functions[0]):  # Note [Aliased subclass outputs]
            continue
        users = [f for f in functions if not takes_subclasses_apart(f)]
        if users:
            what = (
                "a custom autograd.Function returns an input (or a view of it) that the"
                f" function also changes in place ({users[0].__qualname__}.apply)"
            )
            fix = (
                "Return a clone from the Function's forward (or mark_dirty() the input),"
                " or pass the Function a clone of the input."
            )
        else:
            what = (
                "an output is a view of a tensor-subclass input (a __tensor_flatten__ wrapper)"
                " that the function also changes in place"
            )
            fix = "Return a clone of the view, or change a clone of the input in place."
        raise UnsupportedMutationError(
            format_error(
                f"{what}; aotgrad cannot return it as a view of the caller's tensor, as eager does",
                where,
                fix,
            )
        )


def check_input_aliases_are_views(
    tensors: Sequence[torch.Tensor], aliasing: OutputAliasing, where: UserFrame | None
) -> None:
    """Refuse an output over an input's memory whose gradient is not a view's.

    The runtime rebuilds such an output as a view of the input, so autograd
    sends its gradient into the input. An alias made with ``detach()`` (or
    ``.data``) and then changed in place with grad mode on has a history of
    its own instead (``CopyBackwards``)::

        v = x.detach()
        v.copy_(v * 2 + x.sum())   # eager: v's gradient flows through x.sum()
        return v                   # rebuilt as a view of x: it would flow into x as is
    """
    for out in aliasing.outputs:
        alias, t = out.alias, tensors[out.index]
        if alias is None or alias.source is not AliasSource.GRAPH_INPUT:
            continue
        if t.grad_fn is not None and t._base is None:
            raise UnsupportedMutationError(
                format_error(
                    "an output shares memory with an input, but autograd does not see it as a"
                    " view of that input: a detach() (or .data) of the input changed in place"
                    " with grad mode on; aotgrad rebuilds such an output as a view of the"
                    " input, and its gradient would go the wrong way",
                    where,
                    "Return a clone of it, or write the new values into a fresh tensor"
                    " (v = x.detach() * 2 + y) rather than into the detached alias.",
                )
            )


def _rebuildable(view: torch.Tensor, base: torch.Tensor | None) -> bool:
    """``as_strided`` keeps dtype and the lazy conj/neg bits: it rebuilds only views that do too."""
    return (
        base is not None
        and view.dtype == base.dtype
        and view.is_conj() == base.is_conj()
        and view.is_neg() == base.is_neg()
    )
