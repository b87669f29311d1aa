"""Parity with PyTorch's AOTAutograd on the behaviours its own tests exercise (issue 39 item 6).

The behaviour classes are those of PyTorch's ``test/functorch/test_aotdispatch.py``: input data and
metadata mutation, mutation under ``no_grad``, mutations of aliased inputs (views of one base, false
aliasing), outputs aliasing inputs and intermediates, views of views, multi-output views, ``set_``,
storage resizes, backward-time mutation in custom Functions, tensor subclasses (``TwoTensor``: inner
and outer metadata, subclass gradients), partitioners under dynamic shapes, ``requires_grad``
changes, ``detach``/``.data`` aliasing. The cases are our own.

Each :class:`Case` runs on fresh, equal inputs eagerly and through ``aotgrad.aot_function``; the
report (below) also runs PyTorch's ``aot_function`` (``nop`` compilers, keeping inference input
mutations as PyTorch's own tests of ``set_`` do; the tests may call it, the library never does). A run records (:class:`Observed`) the outputs, which input or earlier output each one shares
memory with and whether it is a view, every input after the call (values, shape, strides, offset,
``requires_grad``, leafness; a subclass's inner tensors too), the outputs again after the case's
``after`` action (what a user does with them next: change one in place, change the input), every
leaf's gradient for seeded cotangents, the inputs after the backward, and where it raised. Eager
raising at some stage and the compiled function raising at the same stage is a match.

``test_aotgrad_matches_eager`` checks aotgrad on each case; the cases it fails today are strict
xfails naming the issue's class (``AOTGRAD_FAILS``), so each flips when its fix merges.
``python tests/test_aotdispatch_parity.py`` prints both compilers' counts and every failure
(outcomes: pass; refused, a documented ``AotgradError`` or PyTorch's error; error, another
exception; wrong, a silent difference).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from aotgrad.errors import AotgradError

# torch's fake-tensor logger prints every failed meta kernel: keep the report readable.
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

STAGES = ("call", "after", "backward")

# --- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    cls: str  # the behaviour class (PyTorch's test names group them the same way)
    fn: Callable[..., Any]
    # () -> (leaves whose .grad is compared, arguments); with ``sizes``: (size) -> the same
    make: Callable[..., tuple[list[torch.Tensor], tuple[Any, ...]]]
    # What the caller does next with (outputs, arguments): its error, or the state it leaves.
    after: Callable[[list[Any], tuple[Any, ...]], None] | None = None
    under_no_grad: bool = False
    create_graph: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # aotgrad's: dynamic, partition
    sizes: tuple[int, ...] = ()  # one compiled function called at each size


CASES: list[Case] = []


def case(cls: str, name: str, fn, make, **kw: Any) -> None:
    CASES.append(Case(f"{cls.replace(' ', '_')}-{name}", cls, fn, make, **kw))


def leaf(*shape: int, rg: bool = False) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=rg)


def arg(kind: str, *shape: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x``: a leaf without grad; ``g``: a leaf requiring grad; ``G``: a non-leaf of a leaf
    requiring grad (what a function may change in place: PyTorch's ``test_mutation``)."""
    shape = shape or (3, 3)
    if kind == "x":
        t = leaf(*shape)
        return [t], t
    base = leaf(*shape, rg=True)
    return [base], base if kind == "g" else base * 1


def args(*kinds: str, shape: tuple[int, ...] = ()) -> Callable[[], tuple[list, tuple]]:
    def make():
        leaves, values = [], []
        for k in kinds:
            ls, v = arg(k, *shape)
            leaves += ls
            values.append(v)
        return leaves, tuple(values)

    make.kinds = "".join(kinds)  # type: ignore[attr-defined]
    return make


def each(cls: str, name: str, fn, kinds: list[str], shape=(), **kw) -> None:
    for k in kinds:
        case(cls, f"{name}[{k}]", fn, args(*k, shape=shape), **kw)


def mutate_output(i: int = 0):
    def after(outs, _args):
        outs[i].mul_(2)

    return after


def mutate_input(i: int = 0):
    def after(outs, a):
        a[i].view(-1).mul_(3)
        for o in outs:
            o.grad_fn  # eager: an error node once the base changed (multi-output views)  # noqa: B018

    return after


# --- input data mutation --------------------------------------------------------------------
C = "data mutation"


def _mul_then_use(a):
    a.mul_(2)
    return a * 3


def _mul_return_input(a):
    a.mul_(2)
    return a


def _mutate_two_of_three(a, b, c):
    a.mul_(2)
    c.mul_(2)
    return a + b + c


def _copy_from_other(a, b):
    a.copy_(b * 2)
    return a + b


def _mutate_unused(a, b):
    a.add_(1)
    return b * 2


def _zero_then_add(a, b):
    a.zero_()
    return a + b


def _setitem(a, b):
    a[0] = b[0] * 2
    return a * 1


def _add_then_view(a):
    a.add_(1)
    return a.view(-1)


def _mutate_and_view_others(a, b, c):
    a.mul_(2)
    c.mul_(3)
    return b.view(9), c.view(9)


def _sin_out(a, b):
    return torch.sin(a, out=b)


each(C, "mul_then_use", _mul_then_use, ["x", "G"])
each(C, "returned", _mul_return_input, ["x", "G"])
each(C, "two_of_three", _mutate_two_of_three, ["xxx", "GgG"])
each(C, "copy_", _copy_from_other, ["xg", "Gg", "xx"])
each(C, "unused", _mutate_unused, ["xg", "Gg"])
each(C, "zero_", _zero_then_add, ["xg", "Gx"])
each(C, "setitem", _setitem, ["xg", "Gg"])
each(C, "then_view", _add_then_view, ["x", "G"])
each(C, "view_others", _mutate_and_view_others, ["xxx", "GGG"])
each(C, "out=", _sin_out, ["xx", "gx"])
for rg in (False, True):

    def _strided_view_input(rg=rg):
        base = leaf(2, 2, rg=rg)
        x = base * 1
        return [base], (x[:, 0],)

    def _transposed_input(rg=rg):
        base = leaf(3, 2, rg=rg)
        return [base], ((base * 1).t(),)

    case(C, f"strided_view_input[{rg}]", lambda a: (a.mul_(2), a + 1)[1], _strided_view_input)
    case(C, f"transposed_input[{rg}]", _mul_then_use, _transposed_input)

    def _batchnorm_inputs(rg=rg):
        x, w, b = leaf(2, 3, 4, rg=rg), leaf(3, rg=rg), leaf(3, rg=rg)
        return [x, w, b], (x, w, b, torch.zeros(3), torch.ones(3))

    case(
        C,
        f"batchnorm_running_stats[{rg}]",
        lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=True, momentum=0.5),
        _batchnorm_inputs,
    )

# --- metadata mutation ----------------------------------------------------------------------
C = "metadata mutation"


def _transpose_then_add(a, b):
    a.transpose_(1, 0)
    return a + b


def _transpose_then_mul(a):
    a.transpose_(1, 0)
    a.mul_(2)
    return a + 1


def _metadata_and_views(a, b, c):
    b.mul_(3)
    c.t_()
    return a.view(9), b.view(9), c.reshape(9)


def _unsqueeze(a):
    a.unsqueeze_(0)
    return a * 2


def _squeeze(a):
    a.squeeze_()
    return a * 2


def _as_strided_(a):
    a.as_strided_((2, 2), (1, 3))
    return a + 1


def _resize_smaller(a):
    a.resize_(4)
    return a * 2


def _transpose_and_others(a, b, c, d):
    b.transpose_(1, 0)
    c.add_(1)
    return d + 1, b.diagonal(), a + c


each(C, "transpose_", _transpose_then_add, ["xx", "Gg", "xg"])
each(C, "transpose_then_mul_", _transpose_then_mul, ["x", "G"])
each(C, "t_and_views", _metadata_and_views, ["xxx", "GGG"])
each(C, "unsqueeze_", _unsqueeze, ["x", "G"])
each(C, "squeeze_", _squeeze, ["x", "G"], shape=(3, 1))
each(C, "as_strided_", _as_strided_, ["x", "G"])
each(C, "resize_", _resize_smaller, ["x", "G"])
each(C, "transpose_and_others", _transpose_and_others, ["xxxx", "GGGG"])

# --- mutation under no_grad -----------------------------------------------------------------
C = "mutation under no_grad"


def _no_grad_mul(a):
    with torch.no_grad():
        a.mul_(2)
    return a + 3


def _no_grad_inference(a):
    with torch.no_grad():
        a.mul_(2)
        return a + 3


def _detach_mul(a):
    a.detach().mul_(2)
    return a + 3


def _mixed(a):
    a.detach().mul_(2)
    a.mul_(3)
    with torch.no_grad():
        a.mul_(4)
    return a + 5


def _no_grad_view_mul(a):
    alias = a.view(-1)
    with torch.no_grad():
        alias.mul_(2)
    return a + 1


each(C, "mul_", _no_grad_mul, ["x", "g", "G"])
each(C, "inference_graph", _no_grad_inference, ["g", "G"])
each(C, "detach_mul_", _detach_mul, ["g", "G"])
each(C, "mixed", _mixed, ["x", "G"])
each(C, "view_mul_", _no_grad_view_mul, ["g", "G"])
each(C, "called_under_no_grad", _mul_then_use, ["g", "G"], under_no_grad=True)

# --- aliased inputs -------------------------------------------------------------------------
C = "aliased inputs"


def _mul_first(a, b):
    a.mul_(2)
    return a + b


def _mul_both(a, b):
    a.mul_(2)
    b.add_(1)
    return a * b


def _mul_first_return_views(a, b):
    a.mul_(2)
    return a.view(-1), b.view(-1)


def _t_first(a, b):
    a.t_()
    return a + 1, b * 2


def _aliased(make_views: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], shape, rg: bool):
    def make():
        base = leaf(*shape, rg=rg)
        return [base], make_views(base * 1 if rg else base)

    return make


def _same_twice(k):
    def make():
        leaves, a = arg(k)
        return leaves, (a, a)

    return make


VIEW_PAIRS = {
    "same_tensor": None,
    "rows": ((2, 3), lambda b: (b[0], b[1])),
    "overlapping": ((4,), lambda b: (b[:3], b[1:])),
    "base_and_view": ((3, 3), lambda b: (b, b.view(-1))),
    "false_aliasing": ((4,), lambda b: (b[:2], b[2:])),
}
for (name, pair), rg, fn in itertools.product(
    VIEW_PAIRS.items(), (False, True), (_mul_first, _mul_both, _mul_first_return_views)
):
    make = _same_twice("G" if rg else "x") if pair is None else _aliased(pair[1], pair[0], rg)
    if fn is _mul_both and name == "same_tensor":
        continue
    case(C, f"{name}-{fn.__name__.strip('_')}[{rg}]", fn, make)
for rg in (False, True):
    case(C, f"t_-rows[{rg}]", _t_first, _aliased(lambda b: (b, b[0:2]), (2, 2), rg))


def _storage_twins():
    """Two tensors over one storage that are no views of each other (``set_``)."""
    b = leaf(4)
    return [], (b[:2], torch.empty(0).set_(b.untyped_storage(), 2, (2,), (1,)))


case(C, "storage_twins-mul_first[False]", _mul_first, _storage_twins)

# --- outputs aliasing inputs ----------------------------------------------------------------
C = "output aliases input"
each(C, "view", lambda a: a.view(-1), ["x", "g", "G"], after=mutate_output())
each(C, "identity", lambda a: a, ["x", "g", "G"], after=mutate_output())
each(C, "two_views", lambda a: (a.t(), a[0]), ["x", "G"], after=mutate_output())
each(C, "detach", lambda a: a.detach(), ["g", "G"], after=mutate_output())
each(C, "view_and_compute", lambda a: (a.view(-1), a * 2), ["g", "G"])
each(C, "view_twice", lambda a: (a.view(-1), a.view(9)), ["x", "G"], after=mutate_output())
each(C, "input_mutated_after", lambda a: a[1:], ["x", "G"], after=mutate_input())

# --- outputs aliasing intermediates ---------------------------------------------------------
C = "output aliases intermediate"


def _out_and_view(a):
    b = a.mul(2)
    return b, b.view(-1)


def _view_of_mutated_intermediate(a):
    out = a * 2
    v = out.view(-1)
    out.add_(1)
    return v


def _detach_and_view(x):
    x = x + 1
    a = x.transpose(0, 1)
    return a.detach(), a


each(C, "view", lambda a: (a * 3).view(-1), ["x", "g"], after=mutate_output())
each(C, "out_and_view", _out_and_view, ["x", "g"], after=mutate_output())
each(C, "view_and_t", lambda a: ((a * 2).view(-1), (a * 2).t()), ["g"])
each(C, "select_rows", lambda a: tuple((a * 2)[i] for i in range(2)), ["g"], after=mutate_output())
each(C, "mutated_after_view", _view_of_mutated_intermediate, ["x", "g"])
each(C, "detach_and_view", _detach_and_view, ["g"], after=mutate_output(1))

# --- views of views -------------------------------------------------------------------------
C = "view of view"


def _mutate_view_of_view(a):
    v = a[1:]
    w = v[:, 1:]
    w.mul_(2)
    return w, v


def _view_of_view_input(rg: bool):
    def make():
        base = leaf(3, 4, rg=rg)
        x = base * 1 if rg else base
        return [base], (x[1:][:, 0],)

    return make


each(C, "view_slice", lambda a: a.view(-1)[1:], ["x", "g"], after=mutate_output())
each(C, "t_select_unsqueeze", lambda a: a.t()[0].unsqueeze(0), ["x", "g"])
each(C, "intermediate_chain", lambda a: (a * 2).view(-1).view(3, 3).t(), ["g"])
each(C, "mutated_chain", _mutate_view_of_view, ["x", "G"], after=mutate_output(1))
for rg in (False, True):
    case(C, f"view_of_view_input[{rg}]", _mul_return_input, _view_of_view_input(rg))

# --- multi-output views ---------------------------------------------------------------------
C = "multi-output view"


def _unbind(a):
    return list(a.unbind(0))


def _unbind_and_view(a):
    return *a.unbind(0), a.view(a.shape)


def _unbind_intermediate(a):
    return list((a * 3).unbind(0))


def _unbind_intermediate_and_it(a):
    out = a * 3
    return *out.unbind(0), out


def _detach_mutate(outs, _args):
    outs[0].detach().mul_(2)
    outs[0].grad_fn  # noqa: B018


each(C, "unbind", _unbind, ["x", "g", "G"])
each(C, "unbind-mutate_output", _unbind, ["x", "G"], after=mutate_output())
each(C, "unbind-mutate_input", _unbind, ["x", "G"], after=mutate_input())
each(C, "unbind-mutate_detached", _unbind, ["G"], after=_detach_mutate)
each(C, "unbind_and_view", _unbind_and_view, ["G"], after=mutate_output(-1))
each(C, "intermediate", _unbind_intermediate, ["g"])
each(C, "intermediate-mutate_output", _unbind_intermediate, ["x", "g"], after=mutate_output())
each(C, "intermediate_and_it", _unbind_intermediate_and_it, ["g"], after=mutate_output(-1))
each(C, "split", lambda a: a.split(1), ["G"], after=mutate_output())
each(C, "chunk", lambda a: a.chunk(3, 1), ["G"], after=mutate_output(1))
each(C, "split_sizes", lambda a: a.split([1, 2]), ["x", "G"], after=mutate_output())

# --- set_ -----------------------------------------------------------------------------------
C = "set_"


def _set_to_arange(a):
    b = torch.arange(9, dtype=a.dtype).reshape(3, 3)
    with torch.no_grad():
        a.set_(b)
    return a * b


def _set_then_mutate_source(a, b):
    with torch.no_grad():
        a.set_(b)
        b.mul_(2)
    return a + b


def _set_and_back(a):
    b = torch.arange(9, dtype=a.dtype)
    old = torch.ops.aten.alias.default(a)
    with torch.no_grad():
        a.set_(b)
        a.set_(old)
    return a + b.reshape(3, 3)


def _set_steals_view_chain(a, b):
    a_ = a.mul(2)
    b_ = b.mul(2)
    b_slice = b_[1].view(3, 3)
    a_.set_(b_slice)
    a_.view(-1).mul_(2)
    return a_ * b_slice


def _set_then_mul_(a, b):
    with torch.no_grad():
        a.set_(b)
    a.mul_(2)
    return a + b


def _set_other_shape(a):
    with torch.no_grad():
        a.set_(torch.ones(2))
    return a * 2


def _set_from_input_return(a, b):
    a.set_(b)
    return a


def _resize_storage_then_set(a):
    with torch.no_grad():
        torch.ops.inductor.resize_storage_bytes_(a, 0)
        a.set_(torch.ones(2))


each(C, "arange", _set_to_arange, ["x", "G"])
each(C, "then_mutate_source", _set_then_mutate_source, ["xx", "GG"])
each(C, "and_back", _set_and_back, ["x", "G"])
case(C, "steals_view_chain", _set_steals_view_chain, lambda: ([], (leaf(3, 3), leaf(3, 9))))
each(C, "then_mul_", _set_then_mul_, ["xx", "GG"])
each(C, "other_shape", _set_other_shape, ["x", "G"])
each(C, "from_input_returned", _set_from_input_return, ["xx"])
each(C, "resize_storage_then_set_", _resize_storage_then_set, ["x", "g"], shape=(8,))

# --- storage resize -------------------------------------------------------------------------
C = "storage resize"


def _resize_storage_down(a):
    out = a * 2
    torch.ops.inductor.resize_storage_bytes_(a, 0)
    return out


def _resize_storage_up(a):
    torch.ops.inductor.resize_storage_bytes_(a, 32)
    with torch.no_grad():
        a.copy_(torch.ones(8))
    return a + 1


def _empty_storage(rg: bool):
    def make():
        t = torch.zeros(8, requires_grad=rg)
        t.untyped_storage().resize_(0)
        return [t], (t,)

    return make


each(C, "down", _resize_storage_down, ["x", "g"], shape=(8,))
for rg in (False, True):
    case(C, f"up[{rg}]", _resize_storage_up, _empty_storage(rg))
each(C, "resize_same_numel", lambda a: a.resize_(9) * 1, ["x"])

# --- backward-time mutation -----------------------------------------------------------------
C = "backward mutation"


class BwMutation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return grad.clone()


class BwMetadataMutation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.unsqueeze_(0)
        return grad.clone()


def _bw_mutation(a, b):
    return a * BwMutation.apply(b)


def _bw_mutation_used(a, b):
    return a * BwMutation.apply(b) + b


def _bw_metadata(a, b):
    return a * BwMetadataMutation.apply(b)


each(C, "data", _bw_mutation, ["gx", "gg", "gG"])
each(C, "data-create_graph", _bw_mutation, ["gx", "gg"], create_graph=True)
each(C, "data_used_elsewhere", _bw_mutation_used, ["gx", "gg"])
each(C, "metadata", _bw_metadata, ["gx"])

# --- tensor subclasses ----------------------------------------------------------------------
C = "subclass"


def two(*shape: int, rg: bool = False, transposed: bool = False) -> TwoTensor:
    a, b = (torch.randn(*reversed(shape)).t() if transposed else torch.randn(*shape) for _ in "ab")
    return TwoTensor(a, b).requires_grad_(rg)  # type: ignore[return-value]


def sub(kind: str, *shape: int, transposed: bool = False) -> tuple[list, Any]:
    """``s``: a TwoTensor without grad; ``S``: a non-leaf of one requiring grad; ``p``: plain, grad."""
    shape = shape or (2, 3)
    if kind == "p":
        t = leaf(*shape, rg=True)
        return [t], t
    t = two(*shape, rg=kind == "S", transposed=transposed)
    return [t], t * 1 if kind == "S" else t


def subs(*kinds: str, transposed: bool = False):
    def make():
        leaves, values = [], []
        for k in kinds:
            ls, v = sub(k, transposed=transposed)
            leaves += ls
            values.append(v)
        return leaves, tuple(values)

    return make


def _nested(rg: bool):
    def make():
        t = TwoTensor(two(4), two(4)).requires_grad_(rg)
        return [t], (t,)

    return make


def _shared_inner(first: slice | None, second: slice | None = None):
    """One TwoTensor over one tensor twice (``first`` None), or two whose inner tensors are
    slices of the same two tensors: they share memory without a common ``_base``."""

    def make():
        a, b = torch.randn(4), torch.randn(4)
        if first is None:
            return [], (TwoTensor(a, a),)
        return [], tuple(TwoTensor(a[s], b[s]) for s in (first, second))

    return make


def _sin_cos(x):
    return x.sin().cos()


def _mul_mixed(x, y):
    return x * y


def _data_mutation(x):
    x.mul_(2)
    return x + 1


def _data_mutation_no_grad(x):
    with torch.no_grad():
        x.mul_(2)
    return x + 1


for k in ("s", "S"):
    for transposed in (False, True):
        t = "[T]" if transposed else ""
        case(C, f"sin_cos[{k}]{t}", _sin_cos, subs(k, transposed=transposed))
        case(C, f"data_mutation[{k}]{t}", _data_mutation, subs(k, transposed=transposed))
        for meta, fn in {
            "t_": lambda x: (x.t_(), x * 2)[1],
            "transpose_": lambda x: (x.transpose_(0, 1), x + 1)[1],
            "unsqueeze_": lambda x: (x.unsqueeze_(0), x * 2)[1],
        }.items():
            case(C, f"metadata-{meta}[{k}]{t}", fn, subs(k, transposed=transposed))
    case(C, f"view_outputs[{k}]", lambda x: (x.view(-1), x.t()), subs(k))
    case(C, f"unbind_outputs[{k}]", lambda x: list(x.unbind(0)), subs(k))
    case(C, f"nested[{k}]", _sin_cos, _nested(k == "S"))
case(C, "plain_times_subclass[ps]", _mul_mixed, subs("p", "s"))
case(C, "plain_times_subclass[pS]", _mul_mixed, subs("p", "S"))
case(C, "subclass_from_plain_parts", lambda x: TwoTensor(x * 2, x * 3).sum() * x, subs("p"))
case(C, "data_mutation_no_grad[S]", _data_mutation_no_grad, subs("S"))
case(C, "inner_alias_same", _data_mutation, _shared_inner(None))
case(C, "false_aliasing", _mul_first, _shared_inner(slice(0, 2), slice(2, 4)))
case(C, "overlapping_inners", _mul_first, _shared_inner(slice(0, 3), slice(1, 4)))
case(C, "returns_input_view_mutated", lambda x: (x.mul_(2), x[0])[1], subs("s"))
case(C, "returned_twice[S]", lambda x: (lambda v: (v, v))(x * 2), subs("S"))
case(C, "create_graph[S]", lambda x: (x * x).sum(), subs("S"), create_graph=True)

# --- partitioners under dynamic shapes ------------------------------------------------------
C = "dynamic partition"


def _mlp(x, w):
    return (x @ w).relu().sin().sum(-1)


def _pointwise(x):
    return x.sin().cos() * x


def _sized(kinds: str):
    def make(n: int):
        leaves = [leaf(n, 4, rg=True), leaf(4, n + 1, rg=True)][: len(kinds)]
        return leaves, tuple(leaves)

    return make


def _softmax(x, w):
    return (x @ w).softmax(-1).mul(x.sum()).sum()


def _layer_norm(x, w):
    return F.layer_norm(x @ w, (w.shape[1],)).relu().sum()


PARTITIONS = {"mincut": "mincut", "save_all": "save_all", "budget": aotgrad.budget(0.5)}
for (name, fn, make), partition in itertools.product(
    [
        ("mlp", _mlp, _sized("gg")),
        ("pointwise", _pointwise, _sized("g")),
        ("softmax", _softmax, _sized("gg")),
        ("layer_norm", _layer_norm, _sized("gg")),
    ],
    PARTITIONS,
):
    options = dict(dynamic=True, partition=PARTITIONS[partition])
    case(C, f"{name}-{partition}", fn, make, options=options, sizes=(3, 5, 8))


# --- requires_grad changes ------------------------------------------------------------------
C = "requires_grad change"


def _requires_grad_input(a):
    a.requires_grad_()
    return a * 2


def _requires_grad_intermediate(a):
    b = a * 2
    b.requires_grad_()
    return b * 3


def _detach_requires_grad(a):
    b = a.detach()
    b.requires_grad_()
    return b * a


def _no_grad_output(a):
    with torch.no_grad():
        out = a * 2
    return out, a * 3


def _enable_grad_inside(a):
    with torch.enable_grad():
        return a * 2


each(C, "input", _requires_grad_input, ["x"])
each(C, "intermediate", _requires_grad_intermediate, ["x"])
each(C, "detached_input", _detach_requires_grad, ["g", "x"])
each(C, "no_grad_output", _no_grad_output, ["g"])
each(C, "enable_grad_under_no_grad", _enable_grad_inside, ["g"], under_no_grad=True)
each(C, "no_grad_call", lambda a: (a * 2, a.view(-1)), ["g"], under_no_grad=True)

# --- detach / .data aliasing ----------------------------------------------------------------
C = "detach/.data"


def _data_mul(a):
    a.data.mul_(2)
    return a * 3


def _detach_copy(a, b):
    a.detach().copy_(b)
    return a + b


def _data_t_(a):
    y = a.data
    y.t_()
    return y, a * 1


def _assign_data(a, b):
    a.data = b
    return a * 2


each(C, "data_mul_", _data_mul, ["g", "x"])
each(C, "return_data", lambda a: (a.data, a * 2), ["g"], after=mutate_output())
each(C, "return_detach", lambda a: (a.detach(), a * 2), ["g", "G"], after=mutate_output())
each(C, "detach_copy_", _detach_copy, ["gx", "Gx"])
each(C, "data_t_", _data_t_, ["g"])
each(C, "assign_data", _assign_data, ["xx", "gx"])

# --- running a case ---------------------------------------------------------------------------


@dataclass
class Observed:
    """What one compiler's run of a case left for the caller to see."""

    error: tuple[str, BaseException] | None = None  # the stage that raised, and what
    records: dict[str, Any] = field(default_factory=dict)  # name -> snapshot (compared)


def snapshot(t: Any) -> Any:
    """What a caller can see of a value, down to a subclass's inner tensors."""
    if not isinstance(t, torch.Tensor):
        return ("value", t)
    meta = dict(
        type=type(t).__name__,
        shape=tuple(t.shape),
        stride=t.stride(),
        dtype=t.dtype,
        requires_grad=t.requires_grad,
        is_leaf=t.is_leaf,
    )
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        meta["inner"] = {n: snapshot(getattr(t, n)) for n in names}
        return meta
    meta["offset"] = t.storage_offset()
    has_data = t.untyped_storage().nbytes() > 0 or t.numel() == 0
    meta["values"] = t.detach().clone() if has_data else "no storage"
    return meta


def storages(t: torch.Tensor) -> set[int]:
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return set().union(*(storages(getattr(t, n)) for n in names))
    return {t.untyped_storage()._cdata}


def aliasing(outs: list[Any], inputs: list[torch.Tensor]) -> list[Any]:
    """Per output: the input (index) or earlier output it shares memory with, whether it *is*
    that tensor, and ``_is_view()``."""
    found = []
    for k, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            found.append(None)
            continue
        mine = storages(o)
        which = next(
            (("input", i, o is t) for i, t in enumerate(inputs) if mine & storages(t)), None
        )
        if which is None:
            which = next(
                (("output", j, o is p) for j, p in enumerate(outs[:k]) if mine & storages(p)),
                None,
            )
        found.append((which, o._is_view()))
    return found


def _structure(out: Any) -> str:
    """The output's pytree structure; a list and a tuple are one (PyTorch's returns lists)."""
    return str(pytree.tree_structure(out)).replace("TreeSpec(list,", "TreeSpec(tuple,")


def _unique(tensors: list[Any]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)
    return list(seen.values())


def observe(case: Case, compiled: Callable[..., Any], size: int | None = None) -> Observed:
    torch.manual_seed(0)
    leaves, call_args = case.make() if size is None else case.make(size)
    inputs = _unique([*call_args, *leaves])
    seen = Observed()
    rec = seen.records
    stage = "call"
    try:
        with torch.no_grad() if case.under_no_grad else contextlib.nullcontext():
            out = compiled(*call_args)
        outs = pytree.tree_leaves(out)
        rec["output structure"] = _structure(out)
        rec["outputs"] = [snapshot(o) for o in outs]
        rec["aliasing"] = aliasing(outs, inputs)
        rec["inputs after the call"] = [snapshot(t) for t in inputs]
        if case.after is not None:
            stage = "after"
            case.after(outs, call_args)
            rec["outputs after the action"] = [snapshot(o) for o in outs]
            rec["inputs after the action"] = [snapshot(t) for t in inputs]
        stage = "backward"
        _backward(outs, inputs, case.create_graph, rec)
        rec["inputs after the backward"] = [snapshot(t) for t in inputs]
    except Exception as err:
        seen.error = (stage, err)
    return seen


def _backward(outs: list[Any], inputs: list[torch.Tensor], create_graph: bool, rec) -> None:
    diff = [
        o
        for o in outs
        if isinstance(o, torch.Tensor)
        and o.requires_grad
        and o.is_floating_point()
        and (o.grad_fn is not None or o.is_leaf)
    ]
    holders = [t for t in inputs if t.is_leaf]
    if not diff:
        rec["grads"] = [snapshot(t.grad) if t.grad is not None else None for t in holders]
        return
    generator = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=generator)).sum() for o in diff)
    if not create_graph:
        loss.backward()
        rec["grads"] = [snapshot(t.grad) if t.grad is not None else None for t in holders]
        return
    wrt = [t for t in holders if t.requires_grad]
    firsts = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
    rec["grads"] = [None if g is None else snapshot(g) for g in firsts]
    again = sum((g * g).sum() for g in firsts if g is not None and g.requires_grad)
    if isinstance(again, torch.Tensor):
        seconds = torch.autograd.grad(again, wrt, allow_unused=True)
        rec["second-order grads"] = [None if g is None else snapshot(g) for g in seconds]


# --- comparing --------------------------------------------------------------------------------


def differences(name: str, e: Any, c: Any) -> list[str]:
    if isinstance(e, dict) and isinstance(c, dict):
        return [d for k in e for d in differences(f"{name}.{k}", e[k], c.get(k))]
    if isinstance(e, (list, tuple)) and isinstance(c, (list, tuple)) and len(e) == len(c):
        return [
            d
            for i, (x, y) in enumerate(zip(e, c, strict=True))
            for d in differences(f"{name}[{i}]", x, y)
        ]
    if isinstance(e, torch.Tensor) and isinstance(c, torch.Tensor):
        try:
            torch.testing.assert_close(c, e, rtol=1.3e-6, atol=1e-5, equal_nan=True)
        except AssertionError as err:
            return [f"{name}: values differ ({str(err).strip().splitlines()[0]})"]
        return []
    if type(e) is not type(c) or e != c:
        return [f"{name}: {c!r} != eager {e!r}"]
    return []


def judge(eager: Observed, other: Observed) -> tuple[str, str]:
    """("pass" | "refused" | "error" | "wrong", what differs)."""
    if eager.error is not None:
        stage, err = eager.error
        if other.error is not None and STAGES.index(other.error[0]) == STAGES.index(stage):
            return "pass", ""
        if other.error is not None and STAGES.index(other.error[0]) < STAGES.index(stage):
            return "refused", f"raised at {other.error[0]}: {other.error[1]!r}; eager at {stage}"
        return "wrong", f"eager raised at {stage} ({err!r}); the compiled function did not"
    if other.error is not None:
        stage, err = other.error
        kind = "refused" if isinstance(err, AotgradError) else "error"
        return kind, f"raised at {stage}: {type(err).__name__}: {str(err).splitlines()[0]}"
    diffs = [
        d
        for key, e in eager.records.items()
        for d in differences(key, e, other.records.get(key, "missing"))
    ]
    return ("wrong", "\n".join(diffs)) if diffs else ("pass", "")


def aotgrad_compiler(case: Case) -> Callable[..., Any]:
    return aotgrad.aot_function(case.fn, disk_cache=False, **case.options)


def pytorch_compiler(case: Case) -> Callable[..., Any]:
    from functorch.compile import default_partition, nop
    from functorch.compile import min_cut_rematerialization_partition as min_cut_partition
    from torch._functorch.aot_autograd import aot_function

    partition = case.options.get("partition", "save_all")
    return aot_function(
        case.fn,
        fw_compiler=nop,
        bw_compiler=nop,
        partition_fn=default_partition if partition == "save_all" else min_cut_partition,
        dynamic=case.options.get("dynamic", False),
        keep_inference_input_mutations=True,  # as PyTorch's tests of set_ and resizes run
    )


def run(case: Case, compiler: Callable[[Case], Callable[..., Any]]) -> tuple[str, str]:
    """One compiler on one case, against eager (at every size, for a sized case)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compiled = compiler(case)
        except Exception as err:
            kind = "refused" if isinstance(err, AotgradError) else "error"
            return kind, f"at compile: {err!r}"
        for size in case.sizes or (None,):
            outcome = judge(observe(case, case.fn, size), observe(case, compiled, size))
            if outcome[0] != "pass":
                return outcome[0], (f"at size {size}: " if size else "") + outcome[1]
    return "pass", ""


# --- the cases aotgrad fails today (issue 39) -------------------------------------------------
# case id -> the class. Each is a strict xfail: it fails the suite when its fix merges,
# and the entry is then deleted.
AOTGRAD_FAILS: dict[str, str] = {
    **dict.fromkeys(
        [
            "set_-other_shape[G]",
            "set_-resize_storage_then_set_[g]",
        ],
        "set_() changing the size of an input that requires grad (refused loudly)",
    ),
    **dict.fromkeys(
        [
            "requires_grad_change-detached_input[x]",
            "requires_grad_change-intermediate[x]",
        ],
        "requires_grad_() on a value the function made, no input requiring grad (documented refusal, F24)",
    ),
}


# Cases PyTorch's aot_function crashes the process on (not run by main()).
PYTORCH_CRASHES = {"storage_resize-up[True]"}


def _param(c: Case) -> Any:
    marks = []
    if c.id in AOTGRAD_FAILS:
        marks.append(pytest.mark.xfail(strict=True, reason=f"issue 39: {AOTGRAD_FAILS[c.id]}"))
    return pytest.param(c, id=c.id, marks=marks)


def test_case_ids_are_unique_and_the_failures_are_cases():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert set(AOTGRAD_FAILS) <= set(ids)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_aotgrad_matches_eager(case):
    outcome, detail = run(case, aotgrad_compiler)
    assert outcome == "pass", f"{outcome}: {detail}"


def test_the_oracle_sees_a_mutation_that_is_not_replayed():
    # A compiler that drops the input mutation is caught (as PyTorch's nop compiler is not).
    def forgetful(case):
        return lambda a: case.fn(a.clone())

    c = Case("oracle", "data mutation", _mul_then_use, args("x"))
    outcome, detail = run(c, forgetful)
    assert outcome == "wrong" and "inputs after the call" in detail


def test_the_oracle_sees_a_missing_error():
    c = next(c for c in CASES if c.id == "multi-output_view-unbind-mutate_output[G]")
    outcome, detail = run(c, lambda case: lambda a: [t.clone() for t in case.fn(a)])
    assert outcome == "wrong" and "eager raised at after" in detail


def main() -> None:  # pragma: no cover - a report, run by hand
    counts: dict[str, dict[str, int]] = {}
    failures: dict[str, list[str]] = {}
    for c in CASES:
        print(c.id, file=sys.stderr, flush=True)
        for name, compiler in (("aotgrad", aotgrad_compiler), ("pytorch", pytorch_compiler)):
            if name == "pytorch" and c.id in PYTORCH_CRASHES:
                outcome, detail = "error", "the process crashes (segmentation fault)"
            else:
                outcome, detail = run(c, compiler)
            counts.setdefault(name, {}).setdefault(outcome, 0)
            counts[name][outcome] += 1
            if outcome != "pass":
                first = detail.splitlines()[0][:160] if detail else ""
                failures.setdefault(name, []).append(f"{outcome:8} {c.cls:28} {c.id}: {first}")
    print(f"{len(CASES)} cases")
    for name, by_outcome in counts.items():
        print(name, dict(sorted(by_outcome.items())))
    for name, lines in failures.items():
        print(f"\n{name} fails:")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
    sys.exit(0)
