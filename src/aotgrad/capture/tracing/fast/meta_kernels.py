"""Ops the capture's fake mode runs straight on their meta kernels.

Note [Straight to the meta kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A fake tensor is a meta tensor (a layout, no data) that remembers the device it
stands for. For most ops PyTorch's fake mode ends by running the op's meta
kernel on the arguments seen as meta tensors, and wraps the results as fake
tensors of the arguments' device. Before that last step it does work capture
does not need when every layout is static and plain: it flattens and hashes
the arguments for its cache (a miss costs the hashing and a cache entry on top
of the kernel), checks for constants, subclasses, real-tensor propagation and
rules of its own. So the fast path's fake mode (``FastFakeMode``) takes the last
step directly when the fake mode would do nothing else:

* the op is an aten op that writes none of its arguments, takes no ``device``,
  neither reads data nor makes data-dependent shapes, has a meta kernel, and
  the fake mode has no rule of its own for it (metadata queries, views and
  constructors it treats specially: ``view``, ``convolution``, ``empty_strided``);
* the fake mode would not run Python code in place of the kernel: a
  ``torch._decomp`` decomposition (``addmm``, ``native_batch_norm``,
  ``nll_loss_forward`` ...) or a CompositeImplicit kernel. Those read the
  device, which a meta kernel sees as ``meta``: ``native_batch_norm`` returns
  empty saved statistics on CPU and per-channel ones elsewhere. They keep the
  fake mode's path (and its cache); their small ops then come back here;
* every tensor argument is a plain fake tensor of this mode with a static,
  strided layout, no constant value and no real tensor behind it, and no
  argument is symbolic.

The result is then the fake mode's own: same kernel, same arguments, same
wrapping. A view's meta result shares its argument's storage, as in the fake
mode. ``tests/test_meta_kernels.py`` checks each routed call against PyTorch's
fake mode (layouts, dtypes, devices, memory shared with arguments) over library
models and a slice of the OpInfo database (capture times: ``bench/findings.md``).
Pointwise ops whose meta kernels are Python references of many small ops
(``gelu``) get their layout by rule instead (Note [Layouts without
decompositions]).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aotgrad._torch_compat import (
    FakeTensor,
    FakeTensorMode,
    OpOverload,
    fake_mode_decomposes,
    fake_mode_has_own_rule,
    has_meta_kernel,
    in_kernel_invocation,
)

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_SKIP_TAGS = frozenset(
    {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view}
)


@functools.cache
def straight_to_meta(func: Any) -> bool:
    """Would the fake mode run ``func`` on its meta kernel, and nothing more, for plain
    arguments (Note [Straight to the meta kernel])?

    >>> aten = torch.ops.aten
    >>> straight_to_meta(aten.mm.default), straight_to_meta(aten.add_.Tensor)
    (True, False)
    """
    if not isinstance(func, OpOverload) or func.namespace != "aten":
        return False
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    if any(a.name == "device" for a in schema.arguments) or not schema.returns:
        return False
    if _SKIP_TAGS.intersection(func.tags) or fake_mode_decomposes(func):
        return False
    return not fake_mode_has_own_rule(func) and has_meta_kernel(func)


def run_meta(
    mode: FakeTensorMode, func: Any, args: Sequence[object], kwargs: Mapping[str, object]
) -> object | None:
    """``func(*args, **kwargs)`` on its meta kernel, wrapped as ``mode``'s fake tensors; None
    when the arguments are not all plain static fake tensors of ``mode`` (ask the fake mode)."""
    if not straight_to_meta(func):
        return None
    flat = open_lists([*args, *kwargs.values()])
    if not any(isinstance(a, torch.Tensor) for a in flat) or not all(_plain(a, mode) for a in flat):
        return None
    with in_kernel_invocation(mode):
        out = func(*args, **kwargs)
    # device=None: the arguments' common device, as the fake mode passes for an op without one
    return mode.wrap_meta_outputs_with_default_device_logic(
        out,
        func,
        flat,
        device=None,  # type: ignore[arg-type]
    )


def open_lists(values: Sequence[object]) -> list[object]:
    """The arguments with lists opened: an aten op nests them one level (``Tensor[]``, ``int[]``)."""
    return [x for v in values for x in (v if isinstance(v, list | tuple) else [v])]


def _plain(a: object, mode: FakeTensorMode) -> bool:
    """Not symbolic; a tensor only if a static strided fake tensor of ``mode``, no constant."""
    if isinstance(a, _SYMBOLIC):
        return False
    if not isinstance(a, torch.Tensor):
        return True
    return (
        type(a) is FakeTensor
        and a.fake_mode is mode
        and a.constant is None
        and a.real_tensor is None
        and a.layout is torch.strided
        and not a._has_symbolic_sizes_strides
    )


__all__ = ["open_lists", "run_meta", "straight_to_meta"]
