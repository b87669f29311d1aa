"""Compiled functions under ``torch.func`` transforms and forward-mode AD.

Note [Transforms run the function]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``torch.func.grad``/``vjp``/``jacrev``/``jvp``/``jacfwd``/``vmap`` the
tensors a compiled function receives are functorch wrappers (``TensorWrapper``,
``BatchedTensor``): a user compiler's kernels cannot read them, and the key of
the call cannot be read off their storage. Running the *captured forward
graph* op by op on the wrappers (functorch's per-op rules then give every
derivative, any order) looks like the answer, but the forward graph is not a
differentiable description of the function: it holds the values, not the
autograd structure. ``detach()``, a custom ``autograd.Function``'s backward
and tensor hooks leave no trace in it::

    def f(x):                              # forward graph:
        return x.sin() * x.cos().detach()  #   mul(sin(x), cos(x))

    eager:             grad(f)(x) = cos(x) * cos(x)
    the graph, per op: grad(f)(x) = cos(x) * cos(x) - sin(x) * sin(x)   # wrong

The same holds for forward mode (a JVP of the forward graph would push a
tangent through the ``detach``). So while a transform is active, or a
forward-AD level (``torch.autograd.forward_ad.dual_level``) is open, the
compiled function runs the *user's function* on the transform's tensors: the
transform then sees exactly the ops eager runs, mutations and views
included, to any order and nesting. (Dual arguments under a forward-AD level
alone take a compiled path instead: Note [Forward mode captures a JVP
graph].) It is a slower path, not a silent one:
``aotgrad.cache_info(f).transform_runs`` counts such calls (``Traced``:
``traced.transform_runs``; ``aotgrad.scan`` runs its loop unrolled). Where no
function is at hand (graphs loaded from a file) the runtime raises
:class:`TransformError` naming the transform instead of handing wrappers to
the graphs::

    g = aotgrad.aot_function(f)
    torch.func.grad(g)(x)         # f(x) under grad: eager's gradient
    aotgrad.cache_info(g).transform_runs        # 1
    torch.func.grad(aotgrad.load(path))(x)      # TransformError: ... torch.func.grad ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    forward_ad_level,
    functorch_or_forward_ad_active,
    functorch_transforms_active,
    peek_functorch_interpreter,
)
from aotgrad.errors import TransformError

# What each functorch interpreter is, in the names users call.
_TRANSFORMS = {
    "Grad": "torch.func.grad (or vjp, jacrev)",
    "Jvp": "torch.func.jvp (or jacfwd)",
    "Vmap": "torch.func.vmap",
    "Functionalize": "torch.func.functionalize",
}


# Who refuses, in TransformError's message, when no function is at hand.
GRAPH_PAIR = "a compiled graph pair with no function to run instead (aotgrad.load's result)"


# Is a ``torch.func`` transform or a forward-AD level active (Note [Transforms run the
# function])? Checked on every call of a compiled function, so it is compat's one frame.
transform_active = functorch_or_forward_ad_active


def active_transform() -> str:
    """The innermost active transform, as users call it.

    >>> torch.func.grad(lambda x: print(active_transform()) or x.sum())(torch.ones(2))
    torch.func.grad (or vjp, jacrev)
    tensor([1., 1.])
    >>> import torch.autograd.forward_ad as fwAD
    >>> with fwAD.dual_level():
    ...     active_transform()
    'torch.autograd.forward_ad'
    """
    if functorch_transforms_active():
        name = peek_functorch_interpreter().key().name
        return _TRANSFORMS.get(name, f"the torch.func transform {name}")
    return "torch.autograd.forward_ad"


def has_tangent(tensors: Sequence[object]) -> bool:
    """Does one of these tensors carry a forward-mode tangent (a dual tensor)?"""
    return forward_ad_level() >= 0 and any(
        isinstance(t, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(t).tangent is not None
        for t in tensors
    )


# Note [Forward mode captures a JVP graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dual tensors (``torch.autograd.forward_ad``) need no functorch wrapper: the
# tangent rides on a plain tensor. So a call with dual arguments is split into
# primals and tangents, and a second function, the *JVP body*, is compiled
# like any other: it makes the duals again on capture's fake tensors, calls
# the user's function and unpacks the result. Capture records the
# forward-mode formulas autograd runs (``detach()`` cuts the tangent there as
# in eager), so the graph holds outputs and their tangents; it is cached per
# specialization, compiled with the user's compilers, and has a backward like
# any graph (reverse mode over the primals still works). For
# ``f(x) = x.sin() * x.cos().detach()`` called on ``make_dual(x, t)``::
#
#     jvp body (leaves=[x], tangents=[t]):  out = sin(x) * cos(x)
#                                           out_tangent = (cos(x) * t) * cos(x)
#     result:                               make_dual(out, out_tangent)
#
# Only a level open *at capture* can be used (torch supports one forward
# level), which is why this works for ``dual_level`` and not for
# ``torch.func.jvp``, whose wrappers run the function instead (Note
# [Transforms run the function]). Dual module state (``functional_call`` with
# dual parameters) also runs the function: capture would drop its tangents.


def dual_positions(leaves: Sequence[object]) -> tuple[int, ...]:
    """Positions of the leaves that carry a tangent.

    >>> import torch.autograd.forward_ad as fwAD
    >>> with fwAD.dual_level():
    ...     dual_positions([torch.ones(1), 2, fwAD.make_dual(torch.ones(1), torch.ones(1))])
    (2,)
    """
    unpack = torch.autograd.forward_ad.unpack_dual
    return tuple(
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and unpack(leaf).tangent is not None
    )


def split_duals(
    leaves: Sequence[Any], positions: Sequence[int]
) -> tuple[list[Any], list[torch.Tensor]]:
    """The leaves with each dual replaced by its primal, and the tangents (at ``positions``)."""
    unpack = torch.autograd.forward_ad.unpack_dual
    primals, tangents = list(leaves), []
    for i in positions:
        primals[i], tangent = unpack(leaves[i])
        tangents.append(tangent)
    return primals, tangents


def jvp_body(
    fn: Callable[..., Any], spec: pytree.TreeSpec, positions: tuple[int, ...]
) -> Callable[[list[Any], list[torch.Tensor]], tuple[Any, list[torch.Tensor | None]]]:
    """The function a dual call compiles (Note [Forward mode captures a JVP graph]).

    >>> import torch.autograd.forward_ad as fwAD
    >>> leaves, spec = pytree.tree_flatten(((torch.zeros(1),), {}))
    >>> with fwAD.dual_level():
    ...     jvp_body(torch.sin, spec, (0,))(leaves, [torch.ones(1)])
    (tensor([0.]), [tensor([1.])])
    """
    make_dual, unpack = torch.autograd.forward_ad.make_dual, torch.autograd.forward_ad.unpack_dual

    def jvp(leaves: list[Any], tangents: list[torch.Tensor]) -> Any:
        duals = list(leaves)
        for i, tangent in zip(positions, tangents, strict=True):
            duals[i] = make_dual(duals[i], tangent)
        args, kwargs = pytree.tree_unflatten(duals, spec)
        flat, out_spec = pytree.tree_flatten(fn(*args, **kwargs))
        unpacked = [unpack(v) if isinstance(v, torch.Tensor) else None for v in flat]
        primals = [v if u is None else u.primal for u, v in zip(unpacked, flat, strict=True)]
        out_tangents = [None if u is None else u.tangent for u in unpacked]
        return pytree.tree_unflatten(primals, out_spec), out_tangents

    return jvp


def join_duals(out: Any, tangents: Sequence[torch.Tensor | None]) -> Any:
    """``out`` with each tensor leaf that has a tangent made dual again."""
    make_dual = torch.autograd.forward_ad.make_dual
    flat, spec = pytree.tree_flatten(out)
    joined = [v if t is None else make_dual(v, t) for v, t in zip(flat, tangents, strict=True)]
    return pytree.tree_unflatten(joined, spec)


def refuse_transforms_on(inputs: Sequence[object], what: str = GRAPH_PAIR) -> None:
    """Raise :class:`TransformError` if a transform is active or one of ``inputs`` is dual.

    For graphs with no function behind them; a forward-AD level alone does not
    stop them: tensors without a tangent run as usual.
    """
    if transform_active() and (functorch_transforms_active() or has_tangent(inputs)):
        refuse_transform(what)


def refuse_transform(what: str) -> None:
    """Raise the :class:`TransformError` for graphs with no function to run instead."""
    raise TransformError(
        f"{what} was called under {active_transform()}, and it holds compiled graphs only: its"
        " kernels cannot run on the transform's tensors, and differentiating the forward graph"
        " would miss detach(), custom autograd.Function backwards and hooks (Note"
        " [Transforms run the function]).\nCompile the function with aotgrad.aot_function or"
        " aotgrad.aot_module (they run the function itself under a transform), or call it"
        " outside the transform."
    )


__all__ = [
    "GRAPH_PAIR",
    "active_transform",
    "dual_positions",
    "has_tangent",
    "join_duals",
    "jvp_body",
    "refuse_transform",
    "refuse_transforms_on",
    "split_duals",
    "transform_active",
]
