"""What a view's autograd history says: how autograd made it, which custom Functions lie
between it and its base, whether eager still lets it be used.

Read at capture (Note [Multi-output views], Note [Inputs returned by a custom Function]) and
when subclass outputs are taken apart (Note [Aliased subclass outputs]), so it sits below both.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from aotgrad._torch_compat import custom_function_class, view_creation
from aotgrad.errors import UnsupportedOutputError, UserFrame, format_error


class ViewCreation(enum.Enum):
    """How autograd made a view (its creation meta): what an in-place change of it may do."""

    DEFAULT = "DEFAULT"  # an ordinary view: in-place changes are recorded
    MULTI_OUTPUT_NODE = "MULTI_OUTPUT_NODE"  # of unbind/split/chunk, or a view of one: refused
    NO_GRAD_MODE = "NO_GRAD_MODE"  # made under no_grad: refused with grad mode on
    INFERENCE_MODE = "INFERENCE_MODE"  # made under inference_mode
    IN_CUSTOM_FUNCTION = "IN_CUSTOM_FUNCTION"  # returned by a custom Function's forward


_VIEW_MADE = {
    ViewCreation.MULTI_OUTPUT_NODE: "one of several views an op made at once (unbind, split,"
    " chunk), or a view of one,",
    ViewCreation.NO_GRAD_MODE: "a view made under no_grad",
    ViewCreation.INFERENCE_MODE: "a view made under inference_mode",
    ViewCreation.IN_CUSTOM_FUNCTION: "a view a custom autograd.Function returned",
}


def check_views_still_usable(tensors: Sequence[torch.Tensor], where: UserFrame | None) -> None:
    """Refuse an output view that eager's autograd no longer lets be used.

    Eager returns such a view (``o = x.unbind(0); x.mul_(2); return o``) and
    raises at its first use that needs its history; the runtime cannot rebuild
    a view in that state (Note [Multi-output views]).
    """
    for t in tensors:
        if not t._is_view():
            continue
        creation = ViewCreation(view_creation(t))
        if creation is ViewCreation.DEFAULT or _history_readable(t):
            continue
        raise UnsupportedOutputError(
            format_error(
                f"an output is {_VIEW_MADE[creation]} whose base the function changed in place"
                " afterwards: eager returns it, but refuses every later use of it that needs"
                " its gradient; aotgrad cannot rebuild a view in that state",
                where,
                "Return a clone of the view (v.clone()), or make the view after the in-place"
                " change.",
            )
        )


def _history_readable(t: torch.Tensor) -> bool:
    """Can autograd give ``t``'s ``grad_fn``? Not for a view whose creation forbids the
    in-place change its base had since (it raises eager's error)."""
    try:
        t.grad_fn  # noqa: B018 - the read is the test
    except RuntimeError:
        return False
    return True


def custom_functions(t: torch.Tensor) -> list[type]:
    """The custom ``autograd.Function`` s that made ``t`` a view of its base, nearest first.

    Walks ``t``'s autograd nodes back to its base's; views have one input each.
    """
    if t._base is None or not t.requires_grad:
        return []
    found: list[type] = []
    node, stop = t.grad_fn, t._base.grad_fn
    while node is not None and node is not stop:
        function = custom_function_class(node)
        if function is not None:
            found.append(function)
        edges = [n for n, _ in node.next_functions if n is not None]
        if len(edges) != 1:
            break
        node = edges[0]
    return found
