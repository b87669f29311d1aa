"""Kernel scratch space: the bytes an op allocates while it runs, beyond its outputs.

A graph says what each op returns, not what its kernel allocates on the way:
a CPU convolution unfolds its input into a column buffer, a sort takes
index buffers, a kernel handed a strided input copies it contiguous first.
:func:`op_peak` measures it by running the op once (Note [Measured scratch
space]); the peak prediction adds it to what is live around the op.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad import _torch_compat as compat
from aotgrad.measure import measure_peak
from aotgrad.ops.table import draws_random, is_collective, is_free_view
from aotgrad.partition.sizes import hint

__all__ = ["op_peak"]

# Note [Measured scratch space]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# No table of kernels can say how much scratch space each takes: it depends on
# the backend (oneDNN or the native im2col path), the thread count, the
# strides and dtypes. So aotgrad asks the kernel: for each distinct op and
# argument layout (shapes, strides, dtypes, devices, the other arguments), it
# makes zero-filled tensors of those layouts on their device, runs the op once
# under ``measure_peak`` (Note [Measured peak] in ``measure.py``) and
# remembers the bytes allocated at the op's own peak, outputs included. No
# value of the user's is read. A 3x3 convolution of a (32, 16, 32, 32) input
# on CPU:
#
#     outputs            (32, 16, 32, 32) float32      2 MB
#     measured peak      2 MB + the (32, 144, 1024) column buffer (18 MB)
#
# and the prediction puts the 18 MB on top of what is live at that op.
# Not run, and counted as their outputs alone: views (they allocate nothing),
# random ops (a run would draw from the generator the user's step draws from),
# collectives, ops whose output shape depends on values (zeros are not the
# user's values), and any op that raises on zeros. The first prediction on a
# model pays one run of each distinct op; later ones (another plan of the same
# graph, a peak budget's candidates) find them remembered. Under dynamic shapes
# the op runs at the example sizes (Note [Weights at the example sizes]), as a
# static trace of those sizes would.

_REMEMBERED: dict[Any, int | None] = {}
_NOT_RUN_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def op_peak(node: fx.Node) -> int | None:
    """The bytes ``node``'s op allocates at its own peak, outputs included, measured by running
    it once on zeros of its arguments' layouts (Note [Measured scratch space]); None when it
    is not run."""
    if not _runnable(node):
        return None
    try:
        key = (node.target, _layout_key(node.args), _layout_key(node.kwargs))
        hash(key)
    except (TypeError, _Symbolic):
        return None
    if key not in _REMEMBERED:
        _REMEMBERED[key] = _run(node)
    return _REMEMBERED[key]


class _Symbolic(Exception):
    """An argument with no example value (a symbolic float or bool, a meta tensor): not run."""


def _runnable(node: fx.Node) -> bool:
    op = node.target
    if (
        node.op != "call_function"
        or op is operator.getitem
        or not isinstance(op, compat.OpOverload)
    ):
        return False
    if is_free_view(op) or op.is_view or is_collective(op):
        return False
    if draws_random(op, node.args, node.kwargs):
        return False
    return not any(tag in op.tags for tag in _NOT_RUN_TAGS)


def _layout_key(value: Any) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    return (str(spec), tuple(_leaf_key(leaf) for leaf in leaves))


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, fx.Node):
        val = leaf.meta.get("val")
        if isinstance(val, torch.SymInt):  # a size node: its example value
            return ("size", hint(val))
        if not isinstance(val, torch.Tensor):
            raise _Symbolic
        shape, stride, offset, nbytes = _layout(val)
        return ("tensor", shape, stride, val.dtype, str(val.device), (offset, nbytes))
    if isinstance(leaf, torch.SymInt):
        return hint(leaf)
    if isinstance(leaf, torch.SymFloat | torch.SymBool):
        raise _Symbolic
    return leaf


def _layout(val: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """Shape, strides, offset and storage bytes, symbolic sizes at their example values (Note
    [Weights at the example sizes]: the op runs at those sizes)."""
    return (
        tuple(hint(n) for n in val.shape),
        tuple(hint(n) for n in val.stride()),
        hint(val.storage_offset()),
        hint(val.untyped_storage().nbytes()),
    )


def _run(node: fx.Node) -> int | None:
    try:
        with compat.disable_current_modes(), torch.no_grad():
            args, kwargs = pytree.tree_map_only(fx.Node, _zeros_like, (node.args, node.kwargs))
            args, kwargs = pytree.tree_map_only(torch.SymInt, hint, (args, kwargs))
            device = _device(args, kwargs)
            return measure_peak(lambda: node.target(*args, **kwargs), device)  # type: ignore[operator]
    except Exception:  # an op that refuses zeros: counted as its outputs (Note above)
        return None


def _zeros_like(node: fx.Node) -> torch.Tensor | int:
    val = node.meta["val"]
    if isinstance(val, torch.SymInt):
        return hint(val)
    if val.device.type == "meta":
        raise _Symbolic
    shape, stride, offset, nbytes = _layout(val)
    base = torch.zeros(math.ceil(nbytes / val.dtype.itemsize), dtype=val.dtype, device=val.device)
    return base.as_strided(shape, stride, offset)


def _device(args: Any, kwargs: Any) -> torch.device:
    leaves = pytree.tree_leaves((args, kwargs))
    devices = [t.device if isinstance(t, torch.Tensor) else t for t in leaves]
    cuda = [d for d in devices if isinstance(d, torch.device) and d.type == "cuda"]
    return cuda[0] if cuda else torch.device("cpu")
