"""``torch.compile(model, backend="aotgrad")``: aotgrad as a Dynamo backend.

Dynamo hands the backend a graph whose placeholders follow the order the
body first uses them, named like ``l_x_weights_``. aotgrad names each input
by the user's own expression instead, recovered from Dynamo's source
information (``L['x']['weights']`` → ``x['weights']``,
``L['self']._modules['fc1']._parameters['weight']`` → ``self.fc1.weight``),
and carries Dynamo's module stack and source lines into its provenance, so
the graphs the user's compilers receive describe themselves.

>>> import torch, aotgrad
>>> compiled = torch.compile(torch.nn.Linear(3, 2), backend=aotgrad.backend())
>>> compiled(torch.ones(4, 3)).shape
torch.Size([4, 2])
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from aotgrad._torch_compat import (
    DYNAMO_ENTERS,
    DYNAMO_EXAMPLE_VALUE,
    DYNAMO_EXITS,
    DYNAMO_GRAPH_ARG,
    DYNAMO_SET_GRAD_ENABLED,
)
from aotgrad.api import AOTFunction
from aotgrad.capture.tracing.recorder import MODULE_KEY, SOURCE_FIXED_KEY, SOURCE_KEY
from aotgrad.runtime.boxing import Compiler
from aotgrad.settings import options_of, with_option_keywords
from aotgrad.store.keys import Unkeyable, stable_text

__all__ = ["aotgrad_backend", "backend", "user_expression"]

_ROOT = re.compile(r"^[LG]\['([^']+)'\]")
_MEMBER = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def backend(
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    **options: Any,
) -> Callable[[fx.GraphModule, list[Any]], Any]:
    """A Dynamo backend running aotgrad with these compilers and options (``aot_function``'s)."""
    given = dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler, **options)
    chosen = options_of(given, "backend")

    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sizes = _size_sources(placeholders)
        numbers = _number_inputs(placeholders, sizes)
        inputs = [i for i in range(len(placeholders)) if i not in sizes]
        tensors = [  # not an opaque object (a DeviceMesh DTensor code reads): a constant
            i for i in inputs if i not in numbers and isinstance(example_inputs[i], torch.Tensor)
        ]
        names = [user_expression(placeholders[i]) for i in tensors]
        body = _Interpreted(gm, _root_name(gm), sizes, inputs)
        dims = tuple(_symbolic_dims(placeholders[i]) if i in tensors else () for i in inputs)
        compiled = AOTFunction(
            body,
            chosen,
            input_names=names,
            # Dynamo guards and lifts what the frame reads itself: read only the arguments.
            read_environment=False,
            # The same every call (Note [Marking dimensions dynamic]).
            dynamic_dims=dims if any(dims) else None,
            code_key=graph_key(gm),
        )
        call: Callable[..., Any] = compiled
        if sizes or numbers:
            call = _DynamicCall(compiled, inputs, numbers)
        after = _grad_mode_after(gm)
        return call if after is None else _GradModeAfter(call, after)

    return compile_graph


with_option_keywords(backend)


def graph_key(gm: fx.GraphModule) -> tuple[Any, set[str]] | None:
    """Dynamo's graph as the disk cache keys it: every node's op, name, target, arguments
    and provenance (Note [Disk cache keys]); None (not cached) for a graph holding
    submodules or attributes, or a value without a stable text.

    (Not ``gm.code``: Dynamo's module is lazy, and generating its code costs more
    (bench/findings.md) for a text that says less -- no source lines.)

    >>> import operator
    >>> gm = fx.symbolic_trace(lambda x: operator.mul(x, 2))
    >>> graph_key(gm)[0][1][:3]
    ['call_function', 'mul', 'builtin _operator.mul']
    """
    modules: set[str] = set()
    parts: list[Any] = []
    try:
        for node in gm.graph.nodes:
            if node.op in ("call_module", "get_attr"):
                return None
            target = node.target
            parts.append(
                [
                    node.op,
                    node.name,
                    stable_text(target, modules) if callable(target) else str(target),
                    _arg_text((node.args, node.kwargs), modules),
                    None if node.type is None else stable_text(node.type, modules),
                    node.meta.get("stack_trace"),
                    _module_key(node),
                ]
            )
    except Unkeyable:
        return None
    return parts, modules


def _module_key(node: fx.Node) -> str | None:
    """The module path ``_module_path`` reads, as Dynamo wrote it (no need to tidy a key)."""
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else None


def _arg_text(value: Any, modules: set[str]) -> Any:
    """A node's arguments as stable text: nodes by name, containers by kind."""
    if isinstance(value, fx.Node):
        return ["node", value.name]
    if isinstance(value, tuple | list):
        return [type(value).__name__, *(_arg_text(v, modules) for v in value)]
    if isinstance(value, dict):
        return ["dict", *([str(k), _arg_text(v, modules)] for k, v in value.items())]
    if isinstance(value, slice):
        return ["slice", *(_arg_text(v, modules) for v in (value.start, value.stop, value.step))]
    if value is Ellipsis:
        return ["..."]
    return stable_text(value, modules)


def _symbolic_dims(node: fx.Node) -> tuple[int, ...]:
    value = node.meta.get(DYNAMO_EXAMPLE_VALUE)
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(d for d, n in enumerate(value.shape) if isinstance(n, torch.SymInt))


def _size_sources(placeholders: list[fx.Node]) -> dict[int, tuple[int, int]]:
    """Note [Dynamo's size inputs]: each SymInt placeholder → (tensor placeholder, dim) it sizes.

    With dynamic shapes Dynamo passes sizes as separate inputs (``s77`` for
    ``x.size(0)``). aotgrad's graph takes only tensors: each size is re-read
    from its tensor (symbolic while tracing, an int when running), so one
    trace serves every size the guards allow.
    """
    owners: dict[Any, tuple[int, int]] = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get(DYNAMO_EXAMPLE_VALUE)
        if isinstance(value, torch.Tensor):
            for d, n in enumerate(value.shape):
                if isinstance(n, torch.SymInt):
                    owners.setdefault(str(n), (i, d))
    sources = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get(DYNAMO_EXAMPLE_VALUE)
        if isinstance(value, torch.SymInt) and str(value) in owners:
            sources[i] = owners[str(value)]
    return sources


# Note [Dynamo's number inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When a Python number argument changes between calls, Dynamo recompiles with
# the number as a graph input: an int as a ``SymInt`` placeholder, a float as
# a 0-d float64 tensor that the graph reads with ``.item()``::
#
#     f(a, 2); f(a, 3)        forward(L_a_, L_n_: SymInt): mul = l_a_ * l_n_
#     g(a, 2.0); g(a, 3.5)    forward(L_a_, L_x_: f64[]): item = l_x_.item(); ...
#
# aotgrad's graphs take tensors only, and reading a tensor's value while
# tracing is data-dependent. So such an input reaches the AOTFunction as the
# Python number it stands for (``x.item()`` read before the call, outside the
# trace): the trace specializes on its value, and the cache keys on the value
# and traces again when it changes, as for a number passed to ``aot_function``.


def _number_inputs(placeholders: list[fx.Node], sizes: dict[int, tuple[int, int]]) -> set[int]:
    """Placeholders that stand for a Python number (Note [Dynamo's number inputs])."""
    numbers = set()
    for i, node in enumerate(placeholders):
        value = node.meta.get(DYNAMO_EXAMPLE_VALUE)
        symbolic = isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool)
        if i not in sizes and (symbolic or _read_only_by_item(node, value)):
            numbers.add(i)
    return numbers


def _read_only_by_item(node: fx.Node, value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.requires_grad:
        return False
    return bool(node.users) and all(
        user.op == "call_method" and user.target == "item" for user in node.users
    )


class _DynamicCall:
    """What Dynamo calls for a graph with size or number inputs: drops sizes, reads numbers."""

    def __init__(self, compiled: AOTFunction, inputs: list[int], numbers: set[int]) -> None:
        self.compiled = compiled
        # The placeholders the AOTFunction takes: all but the sizes (Note [Dynamo's size inputs]).
        self.inputs = inputs
        # The placeholders read as Python numbers (Note [Dynamo's number inputs]).
        self.numbers = numbers

    def __call__(self, *args: Any) -> Any:
        # A number input's 0-d tensor (a float Dynamo wrapped) is read as its value.
        read = {i: args[i].item() for i in self.numbers if isinstance(args[i], torch.Tensor)}
        return self.compiled(*[read.get(i, args[i]) for i in self.inputs])


def aotgrad_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """The backend registered as ``"aotgrad"`` (the ``torch_dynamo_backends`` entry point)."""
    return backend()(gm, example_inputs)


def user_expression(node: fx.Node) -> str:
    """The user's expression for a Dynamo placeholder: ``carry['a']``, ``self.fc1.weight``."""
    source = getattr(node.meta.get(DYNAMO_GRAPH_ARG), "source", None)
    name = source.name if source is not None else node.name
    return user_expression_text(name() if callable(name) else str(name))


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    path = user_expression_text(path)
    return path.removeprefix("self.").removeprefix("self") or None


def user_expression_text(text: str) -> str:
    return _MEMBER.sub(r".\1", _ROOT.sub(r"\1", text))


def _frame(node: fx.Node) -> tuple[str, int, str] | None:
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return None
    filename, line, name = frames[-1]
    return filename, int(line), name


def _root_name(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        frame = _frame(node)
        if frame is not None:
            return frame[2]
    return "compiled"


# Note [Grad-mode regions in Dynamo's graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo turns each ``with`` block that changes global state into straight-line
# calls in its graph, with no ``finally``::
#
#     with torch.no_grad():          torch._C._set_grad_enabled(False)
#         v2 = F.dropout(a, 0.5)     v2 = dropout(l_a_, 0.5)
#                                    torch._C._set_grad_enabled(True)
#     with torch.autocast("cpu"):    ctx = torch.amp.autocast_mode._enter_autocast('cpu', ...)
#         ...                        torch.amp.autocast_mode._exit_autocast(ctx)
#
# aotgrad runs this graph while it traces, and a trace may raise partway: the
# direct trace stops at an op it does not handle (the dropout's ``bernoulli_``)
# and the full trace runs the graph again (Note [Choosing a tracer]), or the
# function's own error is refused. So ``_Interpreted`` unwinds as the ``with``
# blocks would have: on an exception it exits the contexts the graph entered
# (``_ENTERS``) and has not exited, innermost first, and puts grad mode back as
# the call found it. Without it the full trace of the graph above ran wholly with
# grad off (an output computed before the region lost its gradient), or wholly
# under autocast.
#
# The other way round, a graph may leave grad mode changed on purpose: Dynamo's
# graph of ``torch.set_grad_enabled(False); return a * 2`` ends with grad off,
# and eager leaves it off for the caller. Each call of the compiled graph does
# that too (``_GradModeAfter``), not only the first, traced one.

# Calls in Dynamo's graph that enter a context its matching exit call leaves.
_ENTERS = set(DYNAMO_ENTERS)
_EXITS = set(DYNAMO_EXITS)


def _grad_mode_after(gm: fx.GraphModule) -> bool | None:
    """The grad mode the graph's last ``_set_grad_enabled`` leaves; None: it sets none."""
    modes = [
        n.args[0]
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is DYNAMO_SET_GRAD_ENABLED
    ]
    return bool(modes[-1]) if modes else None


class _GradModeAfter:
    """The compiled graph, then grad mode as the graph leaves it (Note [Grad-mode regions in
    Dynamo's graph])."""

    def __init__(self, compiled: Callable[..., Any], enabled: bool) -> None:
        self.compiled = compiled
        self.enabled = enabled

    def __call__(self, *args: Any) -> Any:
        try:
            return self.compiled(*args)
        finally:
            torch.set_grad_enabled(self.enabled)


class _Interpreted:
    """Runs Dynamo's graph node by node, each under its Dynamo module path and source line.

    (Not ``fx.Interpreter``: it swaps in each node's own metadata while running it,
    which would hide aotgrad's provenance notes from the tracer.)
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        name: str,
        sizes: dict[int, tuple[int, int]] | None = None,
        inputs: list[int] | None = None,
    ) -> None:
        self.gm = gm
        self.__name__ = name
        self.sizes = sizes or {}
        self.inputs = inputs

    def __call__(self, *args: Any) -> Any:
        opened: list[Any] = []  # contexts the graph entered and has not exited yet
        enabled = torch.is_grad_enabled()
        try:
            return self._interpret(args, opened)
        except BaseException:  # Note [Grad-mode regions in Dynamo's graph]
            for context in reversed(opened):
                context.__exit__(None, None, None)
            torch.set_grad_enabled(enabled)
            raise

    def _interpret(self, args: tuple[Any, ...], opened: list[Any]) -> Any:
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        values: list[Any] = list(args)
        if self.inputs is not None:  # rebuild Dynamo's inputs: sizes re-read from tensors
            values = [None] * len(placeholders)
            for i, arg in zip(self.inputs, args, strict=True):
                values[i] = arg
            for i, (owner, dim) in self.sizes.items():
                values[i] = values[owner].shape[dim]
        inputs = iter(values)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                env[node] = self._run(node, env)
                if node.target in _ENTERS:
                    opened.append(env[node])
                elif node.target in _EXITS:
                    opened.remove(env[node.args[0]])
        raise AssertionError("expected the graph to end with an output node")

    def _run(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        note = {
            MODULE_KEY: _module_path(node) or self.__name__,
            SOURCE_KEY: _frame(node),
            SOURCE_FIXED_KEY: True,
        }
        with fx_traceback.annotate(note):
            if node.op == "call_function":
                return node.target(*args, **kwargs)  # type: ignore[operator]
            if node.op == "call_method":
                self_arg, *rest = args
                if node.target == "item" and not isinstance(self_arg, torch.Tensor):
                    return self_arg  # already a number (Note [Dynamo's number inputs])
                return getattr(self_arg, str(node.target))(*rest, **kwargs)
            if node.op == "call_module":
                return self.gm.get_submodule(str(node.target))(*args, **kwargs)
            return operator.attrgetter(str(node.target))(self.gm)  # get_attr
