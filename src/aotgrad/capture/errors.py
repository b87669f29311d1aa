"""Turn what fails inside a trace into errors that name the user's construct and line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from aotgrad.errors import (
    DataDependentError,
    UnsupportedMutationError,
    UnsupportedOpError,
    UnsupportedOutputError,
    UserFrame,
    format_error,
    user_frame_from_traceback,
)

_SCALARS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)

_DATA_DEPENDENT = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


@contextlib.contextmanager
def translate_trace_errors(fn: Any) -> Iterator[None]:
    """Re-raise data-dependent failures as :class:`DataDependentError` at the user's line."""
    try:
        yield
    except _DATA_DEPENDENT as e:
        raise _data_dependent(e) from None
    except RuntimeError as e:
        if "mutating a non-functional tensor with a functional tensor" in str(e):
            raise UnsupportedMutationError(
                format_error(
                    "the function mutates a tensor it does not take as an argument (a global,"
                    " a closure variable, or a module buffer reached through a method)",
                    user_frame_from_traceback(e.__traceback__),
                    "Pass the tensor as an argument; for a module, trace the module itself"
                    " (aotgrad.aot_module(model)) so its buffers become inputs.",
                )
            ) from None
        if "data is not allocated yet" not in str(e):
            raise
        raise _data_dependent(e, "an op that reads tensor values on the host") from None
    except AssertionError as e:
        if "Could not find a token for effect" not in str(e):
            raise
        where = user_frame_from_traceback(e.__traceback__)
        op = str(e).rsplit(" ", 1)[-1]
        raise UnsupportedOpError(
            format_error(
                f"{op} has a side effect (it is ordered by an effect token, e.g. an error check"
                " that raises on bad input values); aotgrad's graphs do not carry effect tokens",
                where,
                "Call the function eagerly, or use a variant without the check (for linalg:"
                " the *_ex functions, such as torch.linalg.inv_ex).",
            )
        ) from None


def _data_dependent(e: Exception, construct: str | None = None) -> DataDependentError:
    where = user_frame_from_traceback(e.__traceback__)
    construct = construct or _construct(e, where.line if where else "")
    return DataDependentError(
        format_error(
            f"{construct} reads a tensor's value during capture ({type(e).__name__}: {e})."
            " aotgrad captures one graph for all input values and never reads data, so"
            " Python code cannot depend on tensor values",
            where,
            "Keep the decision in tensor ops (torch.where(cond, a, b) instead of"
            " `if cond:`), move .item() out of the function, or pass the value as a Python"
            " scalar argument (aotgrad specializes on it and re-traces when it changes).",
        )
    )


def _construct(e: Exception, line: str) -> str:
    if isinstance(e, DynamicOutputShapeException):
        return "an op whose output shape depends on tensor values (nonzero, unique, masked_select)"
    if ".item()" in line:
        return "`.item()`"
    if ".tolist()" in line:
        return "`.tolist()`"
    if line.startswith(("if ", "elif ", "while ", "assert ")):
        return f"Python control flow on a tensor (`{line.rstrip(':')}`)"
    return "converting a tensor to a Python value (bool(t), int(t), float(t), .item())"


def check_output_leaf(path: tuple[Any, ...], leaf: Any, where: UserFrame | None) -> None:
    """Outputs are tensors, Python scalars, ``None`` or pytrees of them; anything else fails."""
    if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided and leaf.requires_grad:
        raise UnsupportedOutputError(
            format_error(
                f"output{pytree.keystr(path)} is a {leaf.layout} tensor that requires grad;"
                " aotgrad's backward graphs take strided (dense) cotangents",
                where,
                "Return it densified (.to_dense()), or detached if it needs no gradient.",
            )
        )
    if isinstance(leaf, (torch.Tensor, *_SCALARS)):
        return
    raise UnsupportedOutputError(
        format_error(
            f"output{pytree.keystr(path)} is a {type(leaf).__module__}.{type(leaf).__qualname__},"
            " which aotgrad cannot return from a graph",
            where,
            "Return tensors, Python scalars, None, or lists/tuples/dicts/namedtuples of them;"
            " register custom containers with torch.utils._pytree.register_pytree_node.",
        )
    )
