"""Calling what a user's compiler returns: boxed or unboxed; what it receives; ``nop``.

A compiler is ``compiler(gm: fx.GraphModule, example_inputs: list[Tensor]) ->
callable``. The callable is *unboxed* (``f(*args)``) or *boxed* (``f(args)``,
one list argument, marked with ``_boxed_call = True``, which lets the callee
free inputs early). aotgrad accepts both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import is_boxed, mark_boxed
from aotgrad.capture.graph import ready_for_compiler
from aotgrad.runtime.straight_line import straight_line

Compiled = Callable[..., Any]
Compiler = Callable[[fx.GraphModule, list[torch.Tensor]], Compiled]
BoxedCall = Callable[[list[Any]], Sequence[Any]]


def make_boxed_func(f: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """Wrap an unboxed ``f(*args)`` as a boxed ``g(args)``.

    >>> g = make_boxed_func(lambda a, b: a + b)
    >>> g([1, 2]), g._boxed_call
    (3, True)
    """

    def boxed(args: list[Any]) -> Any:
        return f(*args)

    mark_boxed(boxed)
    return boxed


def nop(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """The compiler that compiles nothing: run the graph as Python, op by op.

    Aten graphs become straight-line code calling each kernel directly (Note
    [Straight-line graphs]); anything else runs through ``gm.forward``.

    >>> import torch.fx as fx
    >>> nop(fx.symbolic_trace(lambda x: x + 1), [])([1])
    2
    """
    try:
        return straight_line(gm)
    except NotImplementedError:  # call_module / call_method nodes: not an aten graph
        return make_boxed_func(gm.forward)


def compile_boxed(compiler: Compiler | None, gm: fx.GraphModule, examples: list[Any]) -> BoxedCall:
    """Run ``compiler`` (``nop`` if None) and return its result as a boxed call."""
    if compiler is not None and compiler is not nop:
        gm = ready_for_compiler(gm)  # Note [Code on demand]
    compiled = (compiler or nop)(gm, examples)
    if not callable(compiled):
        raise TypeError(
            f"compiler {compiler!r} returned {type(compiled).__name__}, expected a callable;"
            " return the GraphModule itself, gm.forward, or make_boxed_func(...)"
        )
    return compiled if is_boxed(compiled) else make_boxed_func(compiled)
