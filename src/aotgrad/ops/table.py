"""Per-op knowledge, keyed by ``OpOverload``, read from the op's schema.

Passes ask these functions instead of branching on op names in their loops.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import OpOverload


@functools.cache
def is_free_view(op: object) -> bool:
    """A view op with one tensor result: recomputing it costs nothing and allocates nothing.

    >>> is_free_view(torch.ops.aten.t.default), is_free_view(torch.ops.aten.mm.default)
    (True, False)
    """
    if not isinstance(op, OpOverload):
        return False
    returns = op._schema.returns
    return bool(op.is_view) and len(returns) == 1 and str(returns[0].type) == "Tensor"


def op_name(target: object) -> str:
    """``aten.mm.default`` for an OpOverload; the plain name for anything else."""
    if isinstance(target, OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


@functools.cache
def is_random(op: object) -> bool:
    """May draw from the RNG: never recomputed, or the backward would see other numbers.

    >>> is_random(torch.ops.aten.bernoulli.p), is_random(torch.ops.aten.sin.default)
    (True, False)
    """
    return isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def draws_random(op: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws from the RNG: :func:`is_random`, except calls that draw nothing.

    Attention kernels carry the RNG tag for their ``dropout_p``, dropout and
    recurrent ops for their ``p``/``dropout`` when ``train`` (rrelu: ``training``);
    at 0, or not training, they draw nothing and may be recomputed like any other op.

    >>> attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    >>> q = torch.ones(1, 1, 2, 4)
    >>> draws_random(attention, (q, q, q), {}), draws_random(attention, (q, q, q, 0.1), {})
    (False, True)
    >>> dropout = torch.ops.aten.native_dropout.default
    >>> draws_random(dropout, (q, 0.5, False), {}), draws_random(dropout, (q, 0.5, True), {})
    (False, True)
    """
    if not is_random(op):
        return False
    assert isinstance(op, OpOverload)
    bound = {
        a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        for i, a in enumerate(op._schema.arguments)
    }
    if "dropout_p" in bound:
        return bool(bound["dropout_p"] != 0)
    for flag in ("train", "training"):
        if flag in bound and bound[flag] is False:
            return False
    if "train" in bound:
        p = bound.get("p", bound.get("dropout"))
        return p is None or bool(p != 0)
    return True


# Ops that read their input's storage offset and strides as numbers: a value laid out
# otherwise than at capture would make them read other elements.
_READS_STRIDES = frozenset(
    {
        torch.ops.aten.as_strided.default,
        torch.ops.aten.as_strided_scatter.default,
        torch.ops.aten.as_strided_copy.default,
    }
)


def reads_strides(op: object) -> bool:
    """Does this op read its input's strides and storage offset as numbers?

    >>> reads_strides(torch.ops.aten.as_strided.default), reads_strides(torch.ops.aten.view.default)
    (True, False)
    """
    return op in _READS_STRIDES


def is_pointwise(op: object) -> bool:
    return isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags


# Copies to another dtype or layout: memory-bound, as a pointwise op is.
_CHEAP_COPIES = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten._unsafe_view.default})


def cheap_to_recompute(op: object) -> bool:
    """What min-cut may recompute: free views, deterministic pointwise ops and copies.

    Matmuls, convolutions, attention and random ops are saved instead, and so
    are reductions that shrink their input much (``partition/remat.py``); a
    memory budget may still recompute all but the random ones.

    >>> cheap_to_recompute(torch.ops.aten._to_copy.default)
    True
    >>> cheap_to_recompute(torch.ops.aten.mm.default), cheap_to_recompute(torch.ops.aten.sum.dim_IntList)
    (False, False)
    """
    return is_free_view(op) or op in _CHEAP_COPIES or (is_pointwise(op) and not is_random(op))


def is_reduction(op: object) -> bool:
    """An op that reduces over dimensions (``sum``, ``mean``, ``amax``, ``var``).

    >>> is_reduction(torch.ops.aten.sum.dim_IntList), is_reduction(torch.ops.aten.sin.default)
    (True, False)
    """
    return isinstance(op, OpOverload) and torch.Tag.reduction in op.tags


def _numel(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, list | tuple):
        return sum(_numel(v) for v in value)
    return 0


def _shape(value: object) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _matmul_flops(out: object, inner: int) -> int:
    return 2 * _numel(out) * inner


def _attention_flops(args: tuple[Any, ...], out: object) -> int:
    """q @ kᵀ and weights @ v: 2·B·H·L·S·(E + Ev)."""
    q, k, v = (_shape(a) for a in args[:3])
    if not (q and k and v):
        return _numel(out)
    batch = _numel(args[0]) // (q[-2] * q[-1])
    return 2 * batch * q[-2] * k[-2] * (q[-1] + v[-1])


_ATTENTION = [
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
]

_FLOPS: dict[object, Any] = {
    **{
        getattr(torch.ops.aten, name).default: _attention_flops
        for name in _ATTENTION
        if hasattr(torch.ops.aten, name)
    },
    torch.ops.aten.mm.default: lambda a, out: _matmul_flops(out, _shape(a[0])[-1]),
    torch.ops.aten.bmm.default: lambda a, out: _matmul_flops(out, _shape(a[0])[-1]),
    torch.ops.aten.addmm.default: lambda a, out: _matmul_flops(out, _shape(a[1])[-1]),
    torch.ops.aten.baddbmm.default: lambda a, out: _matmul_flops(out, _shape(a[1])[-1]),
    torch.ops.aten.convolution.default: lambda a, out: _matmul_flops(
        out, _numel(a[1]) // torch.sym_max(_shape(a[1])[0], 1) if _shape(a[1]) else 1
    ),
}


def is_compute_intensive(op: object) -> bool:
    """A matmul, convolution or attention op: FLOPs grow faster than the bytes it touches
    (what ``torch.utils.flop_counter`` counts; everything else costs about its memory traffic).

    >>> is_compute_intensive(torch.ops.aten.mm.default), is_compute_intensive(torch.ops.aten.relu.default)
    (True, False)
    """
    return op in _FLOPS


def flops(op: object, args: tuple[Any, ...], out: object) -> int | torch.SymInt:
    """Estimated floating-point operations of one op, from the per-op table.

    Matmuls and convolutions: 2 × output elements × reduction length; attention:
    both matmuls; views and tuple indexing: 0; everything else: one per output
    element, or per input element for reductions. A ``SymInt`` where sizes are
    symbolic (never ``int()``-ed here: that would add a guard).

    >>> a, b = torch.empty(4, 8, device="meta"), torch.empty(8, 16, device="meta")
    >>> flops(torch.ops.aten.mm.default, (a, b), torch.empty(4, 16, device="meta"))
    1024
    """
    rule = _FLOPS.get(op)
    if rule is not None:
        count = rule(args, out)  # a SymInt under dynamic shapes: int() would add a guard
        return count if isinstance(count, torch.SymInt) else int(count)
    if is_free_view(op) or getattr(op, "is_view", False) or op is operator.getitem:
        return 0
    if isinstance(op, OpOverload) and torch.Tag.reduction in op.tags:
        return torch.sym_max(_numel(args[0]) if args else 0, _numel(out))  # no guard
    return _numel(out)


# Kernels that return less under no_grad (mkldnn's RNN drops the workspace its backward
# needs): the runtime runs forward graphs holding them with grad mode on, on detached inputs.
# Every overload of each (those this torch release has).
_GRAD_MODE_SENSITIVE = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn", "mkldnn_rnn")
    if hasattr(torch.ops.aten, name)
)


def needs_grad_mode(op: object) -> bool:
    """Does this op's kernel change its outputs when grad mode is off?

    >>> needs_grad_mode(torch.ops.aten.mkldnn_rnn_layer.default), needs_grad_mode(torch.ops.aten.mm.default)
    (True, False)
    """
    return isinstance(op, OpOverload) and op.overloadpacket in _GRAD_MODE_SENSITIVE


# Ops that only check their inputs and raise on bad values (they return nothing).
# PyTorch orders them with effect tokens; aotgrad's graphs keep them as plain calls,
# in place, so the compiled function raises eager's error on bad input.
_ERROR_CHECKS = {torch.ops.aten._linalg_check_errors.default}


def is_error_check(op: object) -> bool:
    """An op that returns nothing and raises on bad input values (kept in the graph as is).

    >>> is_error_check(torch.ops.aten._linalg_check_errors.default)
    True
    """
    return op in _ERROR_CHECKS


def must_run(node: fx.Node) -> bool:
    """A node kept though nothing reads its result: fx's impure ones (side effects, writes),
    and error checks whatever the torch release (before 2.13 torch did not count
    ``_linalg_check_errors`` as effectful, so its dead-code pass dropped it and ``linalg.inv``
    of a singular matrix returned inf where eager raises)."""
    return node.is_impure() or is_error_check(node.target)


def remove_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()``, keeping every node that :func:`must_run`."""
    graph.eliminate_dead_code(must_run)


# Ops autocast runs in its lower-precision dtype (``torch.autocast``'s CPU and CUDA
# lists), as they appear in aten graphs: a float32 one runs differently under it.
_AUTOCAST_LOWERS = frozenset(
    [
        torch.ops.aten.mm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.addbmm.default,
        torch.ops.aten.matmul.default,
        torch.ops.aten.linear.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten._convolution.default,
    ]
)


def autocast_lowers(op: object) -> bool:
    """Does autocast cast this op's floating inputs to its lower-precision dtype?

    >>> autocast_lowers(torch.ops.aten.mm.default), autocast_lowers(torch.ops.aten.add.Tensor)
    (True, False)
    """
    return op in _AUTOCAST_LOWERS


# The operator namespaces of torch.distributed's collectives: the functional ones
# (``torch.distributed._functional_collectives``), their autograd forms, and c10d's own.
COLLECTIVE_NAMESPACES = frozenset(["_c10d_functional", "_c10d_functional_autograd", "c10d"])
# Point-to-point ops: each rank of a pair runs a different one (send here, receive there).
_POINT_TO_POINT = frozenset(["isend", "irecv", "batch_p2p_ops", "send", "recv_"])


def is_collective(op: object) -> bool:
    """A torch.distributed communication op, or the wait that completes one: never recomputed,
    never reordered (Note [Collectives] in ``capture/analyses/collectives.py``).

    >>> is_collective(torch.ops._c10d_functional.all_reduce.default)
    True
    >>> is_collective(torch.ops._c10d_functional.wait_tensor.default)
    True
    >>> is_collective(torch.ops.aten.mm.default)
    False
    """
    return isinstance(op, OpOverload) and op.namespace in COLLECTIVE_NAMESPACES


def is_point_to_point(op: object) -> bool:
    """A send or receive: the ranks of a pair run different ops by design.

    >>> is_point_to_point(torch.ops._c10d_functional.all_reduce.default)
    False
    """
    if not is_collective(op):
        return False
    assert isinstance(op, OpOverload)
    return op._schema.name.split("::")[-1] in _POINT_TO_POINT


# Note [Inputs only some outputs read]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some ops take an input that, in one mode, only some of their outputs
# depend on: batch norm in training reads its running statistics only to
# return their new values, and its backward in training ignores them. The
# create_graph backward (Note [Differentiable backward]) asks this to know
# that a saved value does not depend on a buffer the function changed in
# place. Keyed by op: (the argument holding the mode, {input: outputs it reaches}).
#
#     _native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, ...)
#         -> (out, mean, rstd, new running_mean, new running_var)
#     outputs_reached(op, args, 3) == (3,)    # out, mean and rstd do not read running_mean
_READ_BY_SOME_OUTPUTS: dict[Any, tuple[int, dict[int, tuple[int, ...]]]] = {
    torch.ops.aten._native_batch_norm_legit_functional.default: (5, {3: (3,), 4: (4,)}),
    torch.ops.aten.native_batch_norm_backward.default: (7, {3: (), 4: ()}),
}


def outputs_reached(op: object, args: tuple[Any, ...], position: int) -> tuple[int, ...] | None:
    """The outputs whose values input ``position`` changes; None when it may change them all
    (Note [Inputs only some outputs read]).

    >>> bn = torch.ops.aten._native_batch_norm_legit_functional.default
    >>> outputs_reached(bn, (None,) * 5 + (True, 0.1, 1e-5), 3), outputs_reached(bn, (None,) * 5 + (False, 0.1, 1e-5), 3)
    ((3,), None)
    """
    entry = _READ_BY_SOME_OUTPUTS.get(op)
    if entry is None or position not in entry[1]:
        return None
    mode, reached = entry
    return reached[position] if len(args) > mode and args[mode] is True else None


# Ops whose outputs carry no gradient back to their tensor inputs, every overload: factories
# shaped like an input, and draws whose derivative PyTorch defines as zero (``bernoulli``). A
# value made by one is a constant for every derivative (Note [Differentiable backward]).
_NO_GRADIENT_TO_INPUTS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "bernoulli",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    )
)


def passes_no_gradient(op: object) -> bool:
    """Do this op's outputs carry no gradient to its tensor inputs?

    >>> passes_no_gradient(torch.ops.aten.bernoulli.p), passes_no_gradient(torch.ops.aten.mul.Tensor)
    (True, False)
    """
    return isinstance(op, OpOverload) and op.overloadpacket in _NO_GRADIENT_TO_INPUTS


# Backward ops (every overload) whose derivative with respect to an argument PyTorch defines
# as zero (``self: zeros_like(grad)`` in its derivatives.yaml): they read it for its sign or
# range only, a mask in all but name. A value read only there is a constant for every higher derivative (Note
# [Differentiable backward]); eager's double backward uses the same zeros.
_NO_GRADIENT_THROUGH: dict[Any, frozenset[str]] = {
    torch.ops.aten.threshold_backward: frozenset({"self"}),  # relu
    torch.ops.aten.leaky_relu_backward: frozenset({"self"}),
    torch.ops.aten.hardtanh_backward: frozenset({"self"}),  # relu6, hardtanh
    torch.ops.aten.hardshrink_backward: frozenset({"self"}),
    torch.ops.aten.softshrink_backward: frozenset({"self"}),
    torch.ops.aten.rrelu_with_noise_backward: frozenset({"self"}),
    torch.ops.aten.nll_loss_backward: frozenset({"self"}),
    torch.ops.aten.nll_loss2d_backward: frozenset({"self"}),
}


@functools.cache
def _no_gradient_through(op: object) -> frozenset[int | str]:
    if not isinstance(op, OpOverload):
        return frozenset()
    names = _NO_GRADIENT_THROUGH.get(op.overloadpacket, frozenset())
    positions = [k for k, a in enumerate(op._schema.arguments) if a.name in names]
    return frozenset([*names, *positions])


def passes_gradient_through(op: object, argument: int | str) -> bool:
    """Does a gradient flow from this op's result back into ``argument`` (a position in
    ``args`` or a keyword)? False where PyTorch defines that derivative as zero.

    >>> op = torch.ops.aten.threshold_backward.default  # (grad_output, self, threshold)
    >>> passes_gradient_through(op, 0), passes_gradient_through(op, 1)
    (True, False)
    """
    return argument not in _no_gradient_through(op)
