"""Run an aten graph as straight-line Python that calls each kernel directly.

Note [Straight-line graphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``GraphModule``'s generated code calls ``torch.ops.aten.mm.default(x, w)``:
four attribute lookups and a Python ``OpOverload.__call__`` frame per op
before the kernel runs (bench/findings.md, 2026-12-07). ``nop`` instead
compiles the graph into a function whose globals hold each overload's
kernel entry point (``OpOverload._op``, what ``__call__`` forwards to) and
every non-tensor constant::

    graph:      mm = aten.mm.default(x, w); relu = aten.relu.default(mm); ...
    generated:  def forward(args):
                    x, w = args; args.clear()
                    mm = aten_mm_default(x, w); w = None
                    relu = aten_relu_default(mm); mm = None
                    ...

Same kernels, same order, same frees after each value's last use (so peak
memory matches the GraphModule's); only the Python in between is gone.
:func:`straight_line_source` shows the code::

    >>> import torch, aotgrad
    >>> x = torch.randn(3, requires_grad=True)
    >>> traced = aotgrad.trace(lambda x: x.sin().cos(), x)
    >>> print(straight_line_source(traced.forward)[0])
    def forward(args):
        x, = args
        args.clear()
        sin = aten_sin_default(x)
        cos = aten_cos_default(sin)
        return (cos, x, sin)
    <BLANKLINE>
"""

from __future__ import annotations

import itertools
import linecache
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from aotgrad._torch_compat import OpOverload, mark_boxed, op_kernel

_LITERALS = (bool, int, str, type(None))


@dataclass(eq=False, slots=True)
class Step:
    """One node of an aten graph as straight-line code reads it, without an ``fx.Graph``.

    A graph read from a file becomes steps, cheap to build, and its code is made from
    them directly (Note [Graphs read from a file] in ``store/format.py``); the same
    code :func:`straight_line_source` makes from the ``fx`` graph of those nodes.
    """

    name: str
    op: str  # "placeholder", "call_function" or "output"
    target: Any
    # Arguments as ``fx.Node.args`` / ``kwargs`` hold them, with steps for nodes.
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # The steps the arguments name, in the order ``fx.Node.all_input_nodes`` has them.
    all_input_nodes: list[Step]


Graph = fx.GraphModule | Sequence[Step]


class _Emitter:
    """The source lines and globals of one straight-line function."""

    def __init__(self, reserved: set[str]) -> None:
        self.globals: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._taken = set(reserved)

    def bind(self, hint: str, value: Any) -> str:
        """A global name for ``value``, the same each time the same object is bound."""
        if id(value) in self._names:
            return self._names[id(value)]
        name, k = hint, 0
        while name in self._taken:
            k += 1
            name = f"{hint}_{k}"
        self._taken.add(name)
        self._names[id(value)] = name
        self.globals[name] = value
        return name

    def value(self, arg: Any) -> str:
        if isinstance(arg, fx.Node | Step):
            return arg.name
        if isinstance(arg, list) or (isinstance(arg, tuple) and not hasattr(arg, "_fields")):
            items = ", ".join(self.value(a) for a in arg)
            if isinstance(arg, list):
                return f"[{items}]"
            return f"({items},)" if len(arg) == 1 else f"({items})"  # "()" for no outputs
        if type(arg) in _LITERALS or (type(arg) is float and math.isfinite(arg)):
            return repr(arg)
        return self.bind("_const", arg)

    def call(self, node: fx.Node | Step) -> str:
        target = node.target
        if isinstance(target, OpOverload):
            callee = self.bind(str(target).replace(".", "_"), op_kernel(target))
        elif target is operator.getitem:
            return f"{self.value(node.args[0])}[{self.value(node.args[1])}]"
        else:
            callee = self.bind(getattr(target, "__name__", "_fn"), target)
        args = [self.value(a) for a in node.args]
        args += [f"{k}={self.value(v)}" for k, v in node.kwargs.items()]
        return f"{callee}({', '.join(args)})"


def straight_line_source(graph: Graph) -> tuple[str, dict[str, Any]]:
    """The source of ``graph`` (a GraphModule, or its :class:`Step` s) as a straight-line
    function ``forward(args)``, and its globals."""
    gm, nodes = (
        (graph, list(graph.graph.nodes))
        if isinstance(graph, fx.GraphModule)
        else (None, list(graph))
    )
    emit = _Emitter({n.name for n in nodes} | {"forward", "args"})
    last_use: dict[Any, Any] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            last_use[source] = node
    freed_at: dict[Any, list[str]] = {}
    for value, user in last_use.items():
        freed_at.setdefault(user, []).append(value.name)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    lines = ["def forward(args):"]
    if placeholders:
        lines.append(f"    {', '.join(placeholders)}, = args")
        lines.append("    args.clear()")  # a boxed callee frees its inputs (runtime/boxing.py)
    for node in nodes:
        if node.op == "call_function":
            line = f"    {node.name} = {emit.call(node)}"
        elif node.op == "get_attr" and gm is not None:
            attr = operator.attrgetter(str(node.target))(gm)
            line = f"    {node.name} = {emit.bind('_attr', attr)}"
        elif node.op == "output":
            line = f"    return {emit.value(node.args[0])}"
        elif node.op == "placeholder":
            continue
        else:
            raise NotImplementedError(f"no straight-line code for {node.op} nodes: {node}")
        if node.op != "output" and freed_at.get(node):
            line += f";  {' = '.join(freed_at[node])} = None"
        lines.append(line)
    return "\n".join(lines) + "\n", emit.globals


def straight_line(graph: Graph) -> Callable[[list[Any]], Any]:
    """Compile ``graph`` (a GraphModule, or its steps) to a boxed call (Note [Straight-line graphs]).

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x, w: (x @ w).relu())(torch.ones(2, 2), torch.ones(2, 2))
    >>> straight_line(gm)([torch.ones(2, 2), -torch.ones(2, 2)])
    tensor([[0., 0.],
            [0., 0.]])
    """
    source, namespace = straight_line_source(graph)
    filename = f"<aotgrad straight-line {next(_NUMBERS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    forward = namespace["forward"]
    # The source lines live as long as the code (Note [Source lines of generated code]).
    weakref.finalize(forward.__code__, linecache.cache.pop, filename, None)
    mark_boxed(forward)
    return forward


# Note [Source lines of generated code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A traceback through a straight-line graph shows the failing line because the
# code's made-up file name has its source in ``linecache``. Each entry is freed
# with the code object (a traceback holding the frame keeps it alive, so its
# lines still print); kept forever, every compiled function ever dropped left
# its graphs' sources behind (400 dropped functions: 779 entries). The names
# are numbered, never reused: one keyed by ``id(graph)`` could be taken over by
# a later graph at the same address, and the earlier code's finalizer would
# then free the later one's lines. (torch.fx's own GraphModule sources stay in
# its loader for the process; aotgrad's graphs are lazy and make none unless
# their ``.code`` is read.)
_NUMBERS = itertools.count()
