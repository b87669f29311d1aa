"""Inputs the function makes require grad (``requires_grad_()``) or detaches (``detach_()``).

Note [requires_grad_() on an input] is here; ``capture/tracing/joint.py`` calls these checks
after the body runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aotgrad.capture.analyses.aliasing import AliasSource, OutputLeaf, TensorOutput, ViewMeta
from aotgrad.errors import UnsupportedOutputError, UserFrame, format_error
from aotgrad.signature import GraphInputDescriptor

# Per user input: the graph input it comes from and its view of it (``GraphInputs.sources``).
Sources = Sequence[tuple[int, ViewMeta | None]]


# Note [requires_grad_() on an input]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``a.requires_grad_()`` inside the function, on an input that does not
# require grad, makes the caller's tensor a leaf that requires grad: outputs
# computed from ``a`` afterwards send their gradient into ``a.grad``::
#
#     def fn(a):
#         b = a * 3             # before: b does not require grad
#         a.requires_grad_()
#         return b, a * 2       # a.grad = 2 * cotangent of output[1]
#
# The trace sees the traced input become such a leaf and differentiates with
# respect to it (only what follows the call depends on it in autograd's
# graph, so ``b`` stays non-differentiable). The runtime calls
# ``requires_grad_()`` on the caller's tensor before it runs the Function,
# whose backward then returns ``a``'s gradient. An input traced as a view of
# a synthetic base (Note [Aliased inputs]) is refused: its ``requires_grad``
# is the view's, not the graph input's. The converse, ``a.detach_()`` on an
# input that requires grad, is replayed on the caller's tensor after the call
# (after its mutations); outputs computed before it keep their gradient.


def made_to_require_grad(
    primals: Sequence[torch.Tensor],
    needs_grad: Sequence[bool],
    sources: Sources,
    descriptors: Sequence[GraphInputDescriptor],
    where: UserFrame | None,
) -> list[int]:
    """User inputs the function made leaves that require grad, by position (Note
    [requires_grad_() on an input])."""
    made: list[int] = []
    for k, (p, (j, view)) in enumerate(zip(primals, sources, strict=True)):
        if needs_grad[j] or not (p.requires_grad and p.grad_fn is None):
            continue
        if view is not None:
            raise UnsupportedOutputError(
                format_error(
                    "the function calls requires_grad_() on an input that shares memory with"
                    f" another input it mutates ({descriptors[j]})",
                    where,
                    "Pass a tensor that already requires grad, or clone the input.",
                )
            )
        made.append(k)
    return made


def check_views_of_made_inputs(
    leaves: Sequence[OutputLeaf],
    made_to_require_grad: Sequence[int],
    sources: Sources,
    descriptors: Sequence[GraphInputDescriptor],
    where: UserFrame | None,
) -> None:
    """Refuse an output viewing an input from before its requires_grad_() (it cannot be rebuilt).

    Eager's view was made, with grad mode on, of a tensor that did not require
    grad yet; rebuilt after the call from the caller's tensor, which by then
    requires grad, it would be a no_grad view that backward refuses.
    """
    made = {sources[k][0] for k in made_to_require_grad}
    for leaf in leaves:
        alias = leaf.alias if isinstance(leaf, TensorOutput) else None
        if alias is None or alias.view is None or alias.with_grad or not alias.requires_grad:
            continue
        source = alias.index
        if alias.source is AliasSource.INPUT:
            source = sources[source][0]
        elif alias.source is not AliasSource.GRAPH_INPUT:
            continue
        if source in made:
            raise UnsupportedOutputError(
                format_error(
                    f"an output is a view of input {descriptors[source]} made before the"
                    " function called requires_grad_() on that input, which aotgrad cannot"
                    " rebuild after the call",
                    where,
                    "Call requires_grad_() before taking the view, or return a clone of it.",
                )
            )
