"""Turn what fails inside a trace into errors that name the user's construct and line."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    DATA_NOT_ALLOCATED,
    EFFECT_TOKEN_MISSING,
    ENGINE_RUN_BACKWARD,
    INTERNAL_ASSERT,
    NO_FAKE_IMPL,
    NO_META_KERNEL,
    NON_FUNCTIONAL_MUTATION,
    NUMPY_OF_TRACED,
    TENSOR_BACKWARD,
    DataDependentOutputException,
    DynamicOutputShapeException,
    OpOverload,
    UnsupportedOperatorException,
    disable_current_modes,
    effect_token_op,
    size_hint,
)
from aotgrad.errors import (
    AotgradError,
    DataDependentError,
    OpError,
    OpIndexError,
    OpRuntimeError,
    OpTypeError,
    OpValueError,
    Origin,
    UnsupportedMutationError,
    UnsupportedOpError,
    UnsupportedOutputError,
    UserFrame,
    format_error,
    frame_origin,
    is_user_file,
    user_frame_from_traceback,
)

_SCALARS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)

_DATA_DEPENDENT: tuple[type[Exception], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
)


def _data_dependent_errors() -> tuple[type[Exception], ...]:
    """The errors that say "this branches on data"; symbolic_shapes' own only once it is loaded
    (a process that never imported it cannot have raised it, and importing it costs sympy)."""
    shapes = sys.modules.get("torch.fx.experimental.symbolic_shapes")
    return (
        _DATA_DEPENDENT
        if shapes is None
        else (*_DATA_DEPENDENT, shapes.GuardOnDataDependentSymNode)
    )


@contextlib.contextmanager
def translate_trace_errors(fn: Any, where: UserFrame | None = None) -> Iterator[None]:
    """Re-raise failures inside torch as aotgrad errors at the user's line.

    Data-dependent code becomes :class:`DataDependentError`; any other error an op
    raised (Note [Errors from inside torch]) an :class:`OpError`. ``where``: the traced
    function's ``def``, named when no user line is on the stack (an op of the backward).
    """
    try:
        with _ops_errors(where):
            yield
    except _data_dependent_errors() as e:
        raise _data_dependent(e) from None
    except RuntimeError as e:
        if NON_FUNCTIONAL_MUTATION in str(e):
            raise UnsupportedMutationError(
                format_error(
                    "the function mutates a tensor it does not take as an argument (a global,"
                    " a closure variable, or a module buffer reached through a method)",
                    user_frame_from_traceback(e.__traceback__),
                    "Pass the tensor as an argument; for a module, trace the module itself"
                    " (aotgrad.aot_module(model)) so its buffers become inputs.",
                )
            ) from None
        if DATA_NOT_ALLOCATED not in str(e):
            raise
        raise _data_dependent(e, "an op that reads tensor values on the host") from None
    except AssertionError as e:
        if EFFECT_TOKEN_MISSING not in str(e):
            raise
        raise UnsupportedOpError(
            format_error(
                f"{effect_token_op(str(e))} has a side effect (it is ordered by an effect token, e.g. an error check"
                " that raises on bad input values); aotgrad's graphs do not carry effect tokens",
                user_frame_from_traceback(e.__traceback__),
                "Call the function eagerly, or use a variant without the check (for linalg:"
                " the *_ex functions, such as torch.linalg.inv_ex).",
            )
        ) from None


# Note [Errors from inside torch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A ``RuntimeError``/``ValueError``/``TypeError``/``IndexError`` that a meta
# kernel, a ref, a decomposition or the fake tensor raises during capture is
# often the error eager raises for the same call (``x @ w`` with mismatched
# shapes), and sometimes a failure of the capture alone. Its traceback ends
# deep inside torch, so it is raised again as an :class:`OpError` (also an
# instance of the original's type) naming the op that failed and the user's
# line, the original chained; it says "Eager PyTorch raises the same" only
# where that was checked (Note [Checking that eager raises the same])::
#
#     aten.mm.default raised RuntimeError during capture: a and b must have same reduction dim...
#       at model.py:12 in forward: return x @ self.w
#     Eager PyTorch raises the same for these shapes and dtypes (checked on meta tensors)...
#
# The op is the outermost ``__torch_dispatch__`` frame's ``func`` (the op as
# the user's code issued it, before decompositions); without one (a check in
# torch's Python code) the outermost torch function. Errors raised by the
# user's own code, and errors aotgrad already translated, pass unchanged.
_OP_ERRORS: dict[type[Exception], type[OpError]] = {
    RuntimeError: OpRuntimeError,
    ValueError: OpValueError,
    TypeError: OpTypeError,
    IndexError: OpIndexError,
}


# Torch functions that fail inside a capture because they cannot be captured, not because
# of the user's inputs: (what happened, what to do) instead of Note [Errors from inside torch]'s
# "eager raises the same".
_REFUSED_CALLS: dict[str, tuple[str, str]] = dict.fromkeys(
    (TENSOR_BACKWARD, "torch.autograd.backward"),
    (
        "the function calls .backward() (torch.autograd.backward): a capture cannot accumulate"
        " gradients into the .grad of tensors outside its graph",
        "aotgrad builds the backward itself: return the loss and call .backward() on the"
        " compiled function's result, or take gradients as values inside with torch.autograd.grad.",
    ),
)


# An internal assert inside a kernel is not the user's error: the kernel met what capture gives it
# (fake tensors, symbolic sizes), e.g. ``_upsample_bicubic2d_aa_backward`` under dynamic shapes.
_INTERNAL_TODO = (
    "This is torch's kernel failing on traced inputs (fake tensors or symbolic sizes), not an"
    " error eager raises: try without dynamic=True, or another op at that line; see"
    " docs/known-limitations.md."
)


_EAGER_RAISES_TOO = (
    "Eager PyTorch raises the same for these shapes and dtypes (checked: the op raises it on"
    " meta tensors of the same layouts): check the shapes, dtypes and arguments at that line."
)
_NOT_CHECKED = (
    "The op does not raise this on meta tensors of the same layouts, or could not be run so:"
    " it may be a failure of the capture (fake tensors), not of your inputs. If the function"
    " runs eagerly, call that line outside the compiled function and pass its result in, and"
    " please report it as an aotgrad bug."
)


@contextlib.contextmanager
def _ops_errors(function: UserFrame | None) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if isinstance(e, (AotgradError, *_data_dependent_errors())) or _raised_by_user(e):
            raise
        if DATA_NOT_ALLOCATED in str(e) or NON_FUNCTIONAL_MUTATION in str(e):
            raise  # translated below, as data-dependent or as a mutation
        kind = next(k for t, k in _OP_ERRORS.items() if isinstance(e, t))
        op = _failing_op(e)
        if op in _REFUSED_CALLS:
            what, fix = _REFUSED_CALLS[op]
            where = user_frame_from_traceback(e.__traceback__)
            raise UnsupportedOpError(format_error(what, where, fix)) from e
        if (
            isinstance(e, UnsupportedOperatorException)
            or (isinstance(e, NotImplementedError) and NO_META_KERNEL in str(e))
            or NO_FAKE_IMPL in str(e)
        ):
            raise _no_fake_kernel(op, e, function) from e  # Note [Ops without a meta kernel]
        if NUMPY_OF_TRACED in str(e):
            raise _numpy_of_traced(e) from e
        if INTERNAL_ASSERT in str(e):
            todo = _INTERNAL_TODO
        elif _eager_raises_too(e):
            todo = _EAGER_RAISES_TOO
        else:
            todo = _NOT_CHECKED
        raise kind(
            format_error(
                f"{op} raised {type(e).__name__} during capture: {e}",
                user_frame_from_traceback(e.__traceback__),
                todo,
            )
        ) from e


# Note [Ops without a meta kernel]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Capture runs every op on fake tensors, which needs the op's meta kernel or fake
# implementation. A few of torch's own ops have none (``multi_margin_loss_backward``,
# ``_sample_dirichlet`` behind ``Beta.rsample``/``Dirichlet.rsample``): the fake mode
# raises ``NotImplementedError`` ("attempted to run this operator with Meta tensors") or
# ``UnsupportedOperatorException`` where eager runs
# the op on real tensors. That is no error of the user's inputs, so it is refused as
# what it is -- the op and the line that called it -- never as "eager raises the same"::
#
#     aten.multi_margin_loss_backward.default has no meta kernel or fake implementation in
#     this PyTorch, so aotgrad cannot run it on the fake tensors it captures with (eager
#     runs it on real tensors)
#       at train.py:12 in loss: return F.multi_margin_loss(x, y)
#     Compute that op outside the compiled function and pass its result in, ...


def _no_fake_kernel(op: str, e: BaseException, function: UserFrame | None) -> UnsupportedOpError:
    """``function``: the traced function's ``def``, for an op the backward runs (no user line)."""
    backward = "_backward" in op
    where = "its forward op" if backward else "it"
    return UnsupportedOpError(
        format_error(
            f"{op} has no meta kernel or fake implementation in this PyTorch"
            f" ({torch.__version__}), so aotgrad cannot run it on the fake tensors it captures"
            " with (eager runs it on real tensors, and so does this function uncompiled)",
            user_frame_from_traceback(e.__traceback__) or function,
            f"Call {where} outside the compiled function and pass the result in (or return"
            " its inputs and finish eagerly), use an equivalent made of other ops, or give the"
            " op a fake implementation (torch.library.register_fake) if it is your own.",
        )
    )


# Note [Checking that eager raises the same]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An op that fails on the capture's fake tensors may run in eager: a custom
# op without a fake kernel, a kernel reading data, a fake kernel stricter
# than the real one. Telling the user "eager raises the same" there sends them
# hunting a bug in their shapes that is not there. Capture never reads real
# data, so the claim is checked without it: the failing op (the outermost
# ``__torch_dispatch__``'s ``func``, ``args``, ``kwargs``) runs once more,
# below every mode, on meta tensors of the same sizes, strides and dtypes
# (symbolic sizes at their example values, devices made ``meta``). Meta
# kernels of torch's own ops (``aten``, ``prims``) are eager's shape and dtype
# checks (a custom op's is its fake implementation, which proves nothing); the
# claim is made only for those, when that run raises an error of the same kind::
#
#     x @ torch.ones(4, 4), x: (1, 3)  aten.mm on meta (1, 3) @ (4, 4) raises: "raises the same"
#     my_op(x), a custom op            on meta: no kernel, NotImplementedError: not claimed
#     x.numpy()                        no op dispatched: not claimed (refused as a data read)
def _eager_raises_too(e: BaseException) -> bool:
    """Does the failing op raise the same kind of error on meta tensors of the same layouts?"""
    call = _failing_call(e)
    if call is None:
        return False
    func, args, kwargs = call
    if func.namespace not in _TORCHS_OWN:
        return False  # a custom op's meta kernel is its fake implementation, not eager's checks
    try:
        meta_args, meta_kwargs = pytree.tree_map(_meta_twin, (args, kwargs))
    except _NoMetaTwin:
        return False
    kind = next(t for t in _OP_ERRORS if isinstance(e, t))
    with disable_current_modes(), torch.no_grad():
        try:
            func(*meta_args, **meta_kwargs)
        except NotImplementedError:
            return False  # no meta kernel: eager's checks were not run
        except kind:
            return True
        except Exception:
            return False
    return False


# Namespaces whose meta kernels torch writes to check what its eager kernels check.
_TORCHS_OWN = frozenset({"aten", "prims"})


class _NoMetaTwin(Exception):
    """A value of the failing call that has no meta stand-in (a sparse tensor, an unhinted size)."""


def _meta_twin(value: Any) -> Any:
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.SymInt):
        return _hint(value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.layout is not torch.strided:
        raise _NoMetaTwin(value.layout)
    size = [_hint(s) for s in value.shape]
    stride = [_hint(s) for s in value.stride()]
    return torch.empty_strided(size, stride, dtype=value.dtype, device="meta")


def _hint(value: int | torch.SymInt) -> int:
    hint = size_hint(value)
    if hint is None:
        raise _NoMetaTwin(value)
    return hint


def _failing_call(e: BaseException) -> tuple[OpOverload, Any, Any] | None:
    """The op being dispatched when ``e`` was raised, with its arguments."""
    for frame in _frames(e):
        if frame.f_code.co_name != "__torch_dispatch__":
            continue
        func = frame.f_locals.get("func")
        if isinstance(func, OpOverload):
            return func, frame.f_locals.get("args") or (), frame.f_locals.get("kwargs") or {}
    return None


def _numpy_of_traced(e: BaseException) -> DataDependentError:
    return DataDependentError(
        format_error(
            "`.numpy()` (or np.asarray / np.array of a tensor) reads a tensor's values on the"
            " host during capture; aotgrad captures one graph for all input values and never"
            " reads data (eager runs it on the real values)",
            user_frame_from_traceback(e.__traceback__),
            "Compute it with torch ops inside the function, or call numpy outside the compiled"
            " function and pass the result in as a tensor.",
        )
    )


def _frames(e: BaseException) -> list[Any]:
    return [frame for frame, _ in traceback.walk_tb(e.__traceback__)]


def _raised_by_user(e: BaseException) -> bool:
    """The innermost frame is the user's code: the user raised it, not torch."""
    frames = _frames(e)
    return bool(frames) and is_user_file(frames[-1].f_code.co_filename)


def _failing_op(e: BaseException) -> str:
    """The op being dispatched when ``e`` was raised, or the torch function that raised it."""
    frames = _frames(e)
    for frame in frames:
        func = frame.f_locals.get("func") if frame.f_code.co_name == "__torch_dispatch__" else None
        if isinstance(func, OpOverload):
            return str(func)
    # The torch function called last from the user's code, or from aotgrad's (autograd.grad).
    callers = (
        i for i, f in enumerate(frames) if frame_origin(f.f_code.co_filename) is not Origin.LIBRARY
    )
    caller = max(callers, default=-1)
    inside = frames[caller + 1 :]
    if not inside:
        return "an op"
    code = inside[0].f_code
    module = inside[0].f_globals.get("__name__", "")
    name = f"{module}.{code.co_name}" if module else code.co_name
    return _TORCH_FUNCTION_NAMES.get(name, name)


# Torch functions aotgrad calls itself, by what they do for the user.
_TORCH_FUNCTION_NAMES = {
    # capture's backward (Note [The swap spans the backward])
    ENGINE_RUN_BACKWARD: "the backward (torch.autograd.grad)",
}


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
    if isinstance(leaf, (torch.Tensor, torch.SymInt, *_SCALARS)):  # Note [Sizes among the outputs]
        return
    raise UnsupportedOutputError(
        format_error(
            f"output{pytree.keystr(path)} is a {type(leaf).__module__}.{type(leaf).__qualname__},"
            " which aotgrad cannot return from a graph",
            where,
            "Return tensors, Python scalars, None, lists/tuples/dicts/namedtuples of them, or"
            " plain objects holding tensors; register custom containers with"
            " torch.utils._pytree.register_pytree_node.",
        )
    )
