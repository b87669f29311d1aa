"""Compilers for the forward and backward graphs: ``nop``, ``print_graphs``, ``inductor``.

Each is ``compiler(gm, example_inputs) -> callable`` and works with ``trace``
(via ``Traced``), ``aot_function``, ``aot_module``:

>>> import torch, aotgrad
>>> from aotgrad.compilers import nop
>>> f = aotgrad.aot_function(lambda x: x.sin(), nop, nop)
>>> f(torch.zeros(2))
tensor([0., 0.])
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from aotgrad._torch_compat import FakeTensorMode, inductor_compile, inductor_decompositions
from aotgrad.runtime import make_boxed_func, nop

__all__ = ["inductor", "nop", "print_graphs"]


def print_graphs(stream: TextIO | None = None) -> Callable[[fx.GraphModule, list[Any]], Any]:
    """A compiler that prints each graph's code, descriptors included, then runs it as is.

    >>> import torch, aotgrad, io
    >>> out = io.StringIO()
    >>> f = aotgrad.aot_function(lambda x: x.sin(), aotgrad.compilers.print_graphs(out))
    >>> _ = f(torch.zeros(2))
    >>> "x,  # x" in out.getvalue()
    True
    """

    def compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        print(gm.code.strip(), end="\n\n", file=stream or sys.stdout)
        return make_boxed_func(gm.forward)

    return compiler


def inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Compile a graph with TorchInductor.

    The graph is first re-traced with Inductor's decomposition table (aotgrad's
    graphs keep ops such as ``threshold_backward`` that Inductor lowers through
    its own decompositions), on the example inputs' fake mode.
    """
    fake_mode = next(
        (t.fake_mode for t in example_inputs if hasattr(t, "fake_mode")), None
    ) or FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        decomposed = make_fx(gm, decomposition_table=inductor_decompositions())(*example_inputs)
    with torch.no_grad():
        return inductor_compile(decomposed, example_inputs, fake_mode)
