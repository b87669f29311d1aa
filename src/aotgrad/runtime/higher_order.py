"""Higher-order gradients: the backward of a compiled function, itself compiled and differentiable.

Note [Differentiable backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The Function's backward graph reads the saved values as constants: run
as is under ``create_graph=True``, its result would have no path back
through them to the primals, and a second derivative would be silently
wrong. So when the backward runs with grad mode on, the gradients come
from a *differentiable backward function* built from the two graphs::

    G(primals, saved constants, cotangents)
        = backward_graph(*recompute(primals), *saved constants, *cotangents)

``recompute`` is the forward graph sliced to the saved values that depend
on a primal that requires grad and that the backward differentiates through
(Note [Saved values read as masks]) on its way to the gradients the running
backward asks for (Note [Only the gradients asked for]); every other saved
value is a constant for any derivative taken here, so ``G`` takes it as it
was saved. Dependence follows gradients: it stops at values holding no
floating point (a mask, indices) and at ops that pass none back
(``empty_like``, ``bernoulli``); and the recompute stops at saved constants.
So dropout's mask is read as saved, never drawn again::

    forward:  mask = bernoulli(empty_like(h)) / 0.7   # saved, a constant
              out  = tanh(h * mask)                   # saved, depends on h
    G:        out  = tanh(h * saved mask)             # recomputed from h

``G`` is captured with aotgrad's own driver (``aotgrad.pipeline.run``, under
the first order's options: capture, save_all, the user's compilers) on
demand, at the first ``create_graph`` backward of
a specialization with these input kinds, and cached. Applying ``G``
(itself a compiled autograd.Function) to the primals and cotangents
connects the gradients to autograd; its own backward, under
``create_graph``, builds the next ``G`` the same way: any order. For
``f(x) = x.sin()`` (save_all saves ``x``)::

    first order      backward(saved=(x,), g)         = g * cos(x)
    G                G(x, g)                         = g * cos(x)   # x recomputed: itself
    second order     backward of G (a compiled graph) = (-g * sin(x) * gg, cos(x) * gg)

Why not run the forward again inside the backward (eager's way)? Eager's
backward formulas are differentiable ops on saved tensors that remember their
history; the compiled forward's saved values have none (the forward runs
with no graph). Recomputing only the dependent slice keeps the first-order
path as it was, and ``G`` costs one capture per specialization.

The primals ``G`` reads must still hold their values at the call:
Note [Primals in the backward].

Note [Only the gradients asked for]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ctx.needs_input_grad`` says which inputs require grad, not which gradients
the running backward will use: ``autograd.grad(out, x, create_graph=True)``
never uses the parameters' gradients, and eager's backward formulas skip
them (``task_should_compute_output``). So the Function asks the engine, per
input, whether it will execute the node that input's gradient goes to
(``engine_uses``), and ``G`` is built for two masks, one flag per forward
input: *requires grad* (which primals ``G`` must stay differentiable in) and
*asked for* (which gradients ``G`` outputs; None for the others, and every
node only those needed pruned, the saved values only they read no longer
recomputed nor taken). Slices, and so ``G``'s captures, are keyed on both
masks: a later call asking for another set builds its own ``G``, never
reuses one built for a different mask. For the WGAN-GP critic
``f(W1, W2, x) = leaky(x @ W1) @ W2``::

    autograd.grad(f(...).sum(), x, create_graph=True)
        requires grad (1, 1, 1), asked for (0, 0, 1):
        G(W1, W2, masks, g) = (None, None, leaky_backward(g @ W2.T, mask) @ W1.T)
    loss.backward()  (through G: second-order terms reach W1, W2 and x)
    f(...).sum().backward()
        asked for (1, 1, 1): the first-order backward graph, as before

Second-order terms still reach every primal requiring grad, since ``G``
stays a differentiable function of all of them; only gradients nobody reads
are not computed. An engine that cannot answer (a leaf that ``autograd.grad``
captures) counts as asking.

Note [Saved values read as masks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Some backward ops read a saved value only for its sign or range, and PyTorch
defines their derivative with respect to it as zero (``threshold_backward``'s
``self`` for ReLU, ``leaky_relu_backward``, ``hardtanh_backward``:
``ops.table.passes_gradient_through``). A saved value the kept gradients read
only there need not be recomputed from the primals: ``G`` takes it as saved,
and the forward's matmuls are not run again. For ``r = relu(x @ W)``::

    backward:  grad_x = threshold_backward(g, r, 0) @ W.T   # r: its sign only
    G(W, r, g)         reads r as saved, recomputes nothing

Eager's double backward still has an edge through that argument, which
carries zeros back to every primal the value came from: ``x.grad`` is zeros
there, not None, and an optimizer treats the two differently. So each
gradient ``G`` outputs lists the primals eager reaches only that way
(``zero_links``: above, ``x``, which ``G`` no longer reads), and
``_ZeroLinks`` passes copies of ``G``'s gradients on (a view could not be
changed in place, as eager's gradients can), sending zeros to those primals
whenever a linked gradient is differentiated. Under ``create_graph`` those
zeros are a function, with derivative zero, of every primal the masks came
from (above: ``x`` and ``W``), as eager's are (its formula computes them as
``zeros @ W.T``): a third derivative reaches the same tensors eager's does.
Values, and which tensors get a gradient, are eager's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from aotgrad.capture import JointGraph
from aotgrad.capture.provenance import META_KEY, NodeInfo, set_info
from aotgrad.capture.tracing.joint import Body
from aotgrad.capture.tracing.recorder import MODULE_KEY, SOURCE_FIXED_KEY, SOURCE_KEY
from aotgrad.errors import AotgradError, DoubleBackwardError, format_error
from aotgrad.ops.differentiable import (
    NO_DERIVATIVE,
    REPLACED,
    decomposition_of,
    is_op_named,
    op_without_derivative,
)
from aotgrad.runtime.slices import (
    Slice,
    ZeroLink,
    ancestors,
    build_slice,
    changed_input,
    graph_outputs,
    graph_placeholders,
    source_of,
    storage_sharing,
    value_meta,
)
from aotgrad.runtime.straight_line import Step
from aotgrad.signature import FlatInputs, Signature
from aotgrad.signature.descriptors import Input

# The pipeline's driver under the first order's options (``aotgrad.pipeline``): captures,
# partitions and compiles ``G``'s ``(body, flat inputs, values, root, on_joint)`` into
# ``CompiledGraphs``; ``on_joint`` sees the joint graph before it is partitioned.
Driver = Callable[[Body, FlatInputs, list[Any], fx.GraphModule, Callable[[JointGraph], None]], Any]

# Held while a slice or its graphs are built for a first create_graph backward (Note
# [Concurrent calls]); a module lock, taken before the capture lock.
_BUILDING = threading.RLock()


@dataclass
class Orders:
    """How many ``create_graph`` backward captures happened (Note [Differentiable backward]).

    Shared by every order of one compiled function: ``G``'s own captures count here too.
    ``aot_function`` hands its ``CacheInfo``, which has the same fields.
    """

    create_graph_captures: int = 0
    # Backwards that took another path than a captured G (there is none: kept at 0).
    create_graph_fallbacks: int = 0


@dataclass(kw_only=True)
class HigherOrder:
    """The ``create_graph`` backward of one compiled specialization (Note [Differentiable backward])."""

    # The two graphs and their signature. Graphs read from a file give the forward's steps
    # and None until ``prepare`` builds them, at the first ``G`` (a cache hit that never
    # differentiates twice builds no fx graph: Note [Graphs read from a file]).
    forward: fx.GraphModule | Sequence[Step]
    backward: fx.GraphModule | None
    signature: Signature | None
    # Where the saved values sit among the forward graph's outputs (Note [Positions]).
    saved_in_forward: slice
    # Captures, partitions and compiles ``G`` (the pipeline's driver, under the first
    # order's options).
    driver: Driver
    # Forward inputs the epilogue changes in place (data, metadata or ``detach_()``).
    changed: frozenset[int] = frozenset()
    # Forward inputs the function gives another storage (``set_()``, ``x.data = y``): Note
    # [A gradient through a new storage].
    set_inputs: frozenset[int] = frozenset()
    # Builds the graphs and signature above, once, before the first ``G``.
    prepare: Callable[[], tuple[fx.GraphModule, fx.GraphModule, Signature]] | None = None
    order: int = 1
    orders: Any = field(default_factory=Orders)  # an Orders, or what has its fields
    # Forward inputs saved besides the saved values (Note [Primals in the backward]).
    extra: tuple[int, ...] = ()
    # Saved position of each forward input the forward graph saves as is.
    saved_as_is: dict[int, int] = field(default_factory=dict)
    # Keyed on (requires grad, asked for), one flag per forward input.
    _slices: dict[tuple[tuple[bool, ...], tuple[bool, ...]], Slice] = field(default_factory=dict)
    _compiled: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        placeholders = graph_placeholders(self.forward)
        saved = graph_outputs(self.forward)[self.saved_in_forward]
        index = {node: i for i, node in enumerate(placeholders)}
        for j, node in enumerate(saved):
            if node in index:
                self.saved_as_is.setdefault(index[node], j)
        read = {index[n] for n in ancestors(saved) if n in index}  # inputs saved values need
        self.extra = tuple(
            i for i in sorted(read) if i not in self.saved_as_is and i not in self.changed
        )

    def gradients(
        self,
        needs_grad: Sequence[bool],
        wanted: Sequence[bool],
        saved: Sequence[Any],
        kept: tuple[Sequence[torch.Tensor], Sequence[int]],
        cotangents: Sequence[torch.Tensor],
        state: Sequence[torch.Tensor] = (),
    ) -> Sequence[torch.Tensor | None]:
        """The gradients as differentiable functions of the primals and cotangents.

        ``needs_grad``: the forward inputs requiring grad; ``wanted``: those whose gradient the
        running backward uses (Note [Only the gradients asked for]); the others get None.
        ``kept``: the forward inputs in ``extra`` and their versions at the call (Note
        [Primals in the backward]). ``state``: the values of the inputs the backward changes,
        as it runs (Note [State updated by the backward] in ``capture/analyses/backward_state.py``).
        """
        if not any(wanted):
            return (None,) * len(wanted)
        piece = self._slice(tuple(needs_grad), tuple(wanted))
        if piece.primals or piece.constants:  # Note [A gradient through a new storage]
            for i in sorted(self.set_inputs):
                if needs_grad[i]:
                    raise _through_new_storage(self._input_name(i))
        values = [
            *(
                piece.zeros(i) if i in piece.stand_ins else self._primal(i, saved, kept)
                for i in piece.primals
            ),
            *(saved[j] for j in piece.constants),
            *cotangents,
            *state,
        ]
        grads = self._compiled_for(piece, values)(values)
        if not piece.zero_links:
            return grads
        linked, local = piece.linked
        primals = [self._primal(i, saved, kept) for i in linked]
        return link_zeros(grads, piece.zero_links, local, primals)

    def _primal(
        self, i: int, saved: Sequence[Any], kept: tuple[Sequence[torch.Tensor], Sequence[int]]
    ) -> torch.Tensor:
        if i in self.saved_as_is:
            return saved[self.saved_as_is[i]]
        if i in self.extra:
            k = self.extra.index(i)
            tensor, version = kept[0][k], kept[1][k]
            if tensor._version != version:
                raise _changed_after(self._input_name(i), version, tensor)
            return tensor
        raise changed_input(self._input_name(i))

    def _input_name(self, i: int) -> str:
        assert self.signature is not None, "expected the signature built with the first slice"
        return str(self.signature.forward_inputs[i])

    def _slice(self, needs_grad: tuple[bool, ...], wanted: tuple[bool, ...]) -> Slice:
        key = (needs_grad, wanted)  # Note [Only the gradients asked for]
        piece = self._slices.get(key)
        if piece is not None:
            return piece
        with _BUILDING:  # Note [Concurrent calls]: built once, by one thread
            piece = self._slices.get(key)
            if piece is None:
                if self.prepare is not None:
                    self.forward, self.backward, self.signature = self.prepare()
                    self.prepare = None
                assert isinstance(self.forward, fx.GraphModule), "expected the graphs built"
                assert self.backward is not None and self.signature is not None
                piece = self._slices[key] = build_slice(
                    self.forward, self.backward, self.signature, needs_grad, self.changed, wanted
                )
        return piece

    def _compiled_for(self, piece: Slice, values: Sequence[Any]) -> Callable[[list[Any]], Any]:
        key = (id(piece), *(value_meta(v) for v in values), storage_sharing(values))
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with _BUILDING:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = self._capture(piece, values)
        return compiled

    def _capture(self, piece: Slice, values: Sequence[Any]) -> Callable[[list[Any]], Any]:
        compiled = capture_backward(piece.graph, values, self.order + 1, self.driver)
        if compiled.higher_order is not None:
            compiled.higher_order.orders = self.orders
            compiled.higher_order.order = self.order + 1
        self.orders.create_graph_captures += 1
        return compiled


class _ZeroLinks(torch.autograd.Function):
    """The gradients' values, with an edge to each linked input: a gradient received sends
    zeros to the inputs linked to it (Note [Saved values read as masks])."""

    @staticmethod
    def forward(
        ctx: Any, links: tuple[ZeroLink, ...], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.links = links
        ctx.set_materialize_grads(False)
        ctx.inputs = tensors[len(links) :]  # kept, not saved: only their metadata is read
        # Copies: an input returned as is would be a view the caller may not change in place.
        return tuple(t.clone() for t in tensors[: len(links)])

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[Any, ...]:
        zeros: list[torch.Tensor | None] = [None] * len(ctx.inputs)
        for cotangent, link in zip(cotangents, ctx.links, strict=True):
            if cotangent is None:
                continue
            for k in link.zeros:
                if zeros[k] is None:
                    zeros[k] = _zeros(ctx.inputs[k], [ctx.inputs[i] for i in link.reached])
        return (None, *cotangents, *zeros)


def _zeros(like: torch.Tensor, group: Sequence[torch.Tensor]) -> torch.Tensor:
    """Zeros shaped like ``like``; under ``create_graph``, a function of ``group`` whose
    derivative is zero, as eager's zeros are (its formulas compute them from the inputs)."""
    zeros = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    if not torch.is_grad_enabled():
        return zeros
    never = torch.zeros((), dtype=torch.bool, device=like.device)
    for t in group:  # ``where`` picks 0: no inf or nan of ``t`` reaches the value
        zeros = zeros + torch.where(never, t.sum(), 0).to(like.dtype)
    return zeros


def link_zeros(
    grads: Sequence[torch.Tensor | None],
    links: tuple[ZeroLink, ...],
    local: tuple[ZeroLink, ...],
    primals: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """``grads``, the linked ones passed through ``_ZeroLinks`` with ``primals`` (Note [Saved
    values read as masks]); ``local``: ``links`` by positions among ``primals`` and among
    the linked gradients (``Slice.linked``)."""
    passed = _ZeroLinks.apply(local, *(grads[link.grad] for link in links), *primals)
    found = list(grads)
    for link, grad in zip(links, passed, strict=True):
        found[link.grad] = grad
    return found


# Note [A gradient through a new storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``x.data = y`` (or ``set_()``) keeps ``x`` the same autograd variable over
# ``y``'s data: eager's ops after it differentiate through ``x``. The trace
# reads ``x``'s new data as the value it came from (``y``, a value the function
# made or another input), so a gradient computed from it is differentiable in
# ``y``, not in ``x``::
#
#     def f(a, b):          # both require grad
#         a.data = b
#         return a * a      # eager: grad_a = 2 * a, differentiable in a
#                           # G:     2 * b, differentiable in b (a gets None)
#
# The graph cannot tell ``a``'s new data from ``y`` itself, so ``G`` refuses
# whenever such an input requires grad and ``G`` reads any primal or saved
# value. A gradient that reads neither (``a * 2``: ``2 * g``) is right as is.


def _through_new_storage(what: str) -> DoubleBackwardError:
    return DoubleBackwardError(
        format_error(
            f"create_graph=True: the function gives input {what}, which requires grad, another"
            f" storage (set_() or {what}.data = ...). Eager differentiates what it computes"
            f" from {what} afterwards through {what}; the compiled graph reads that data as the"
            " value it came from, so the gradient's own derivative would be wrong"
            " (Note [A gradient through a new storage]).",
            None,
            f"Assign {what}.data (or call set_()) outside the compiled function, or take this"
            " gradient without create_graph=True.",
        )
    )


def _changed_after(what: str, version: int, tensor: torch.Tensor) -> DoubleBackwardError:
    return DoubleBackwardError(
        format_error(
            f"create_graph=True needs the value input {what} had when the compiled function"
            f" was called (version {version}), but it was changed in place since (version"
            f" {tensor._version}): an optimizer step, an in-place op"
            " (Note [Primals in the backward]). Eager PyTorch raises too when it saved it.",
            None,
            "Take the gradients before changing the input, or change a copy.",
        )
    )


def capture_backward(
    graph: fx.GraphModule, values: Sequence[Any], order: int, driver: Driver
) -> Any:
    """Capture, partition and compile ``G`` on these values (fake tensors, as every capture)
    with ``driver``; its nodes note their derivative ``order``.

    An op of ``graph`` autograd has no derivative for is run through its decomposition and the
    capture tried again (Note [Backward ops without a derivative]).
    """
    names = [n.name for n in graph_placeholders(graph)]
    flat = FlatInputs(
        spec=pytree.tree_structure(((0,) * len(values), {})),
        constants=(None,) * len(values),
        tensor_positions=tuple(range(len(values))),
        descriptors=tuple(Input(path=name) for name in names),
        num_lifted=0,
    )
    decomposed: dict[Any, Callable[..., Any]] = {}

    @contextmanager
    def body(primals: list[torch.Tensor]) -> Iterator[Any]:
        yield tuple(_run_with_provenance(graph, primals, decomposed))

    captured: list[JointGraph] = []  # the capture's errors are retried, the later ones not

    def on_joint(joint: JointGraph) -> None:
        for node in joint.gm.graph.nodes:  # which derivative each node computes
            info = node.meta.get(META_KEY)
            if isinstance(info, NodeInfo):
                set_info(node, replace(info, order=order))
        captured.append(joint)

    while True:
        try:
            return driver(body, flat, list(values), graph, on_joint)
        except (AotgradError, RuntimeError) as error:
            if captured:
                raise
            op = op_without_derivative(error, graph)
            rule = None if op is None or op in decomposed else decomposition_of(op)
            if rule is None:
                raise _no_derivative(error, graph, order) from error
            decomposed[op] = rule


def _no_derivative(error: Exception, graph: fx.GraphModule, order: int) -> DoubleBackwardError:
    """The capture of ``G`` failed: name the op with no derivative and the user's line."""
    found = NO_DERIVATIVE.search(str(error))
    node = None
    if found is not None:
        name = found.group(1)
        node = next((n for n in graph.graph.nodes if is_op_named(n, name)), None)
        what = (
            f"create_graph=True: the backward of a compiled function calls {name}, which has"
            f" neither a derivative nor a decomposition in PyTorch, so its gradient cannot be"
            f" differentiated again (order {order})."
        )
    else:
        what = (
            f"create_graph=True: capturing the differentiable backward (order {order}) of a"
            f" compiled function failed: {error}"
        )
    return DoubleBackwardError(
        format_error(
            what,
            None if node is None else source_of(node),
            "Compute this derivative without create_graph=True, or use an op with a"
            " derivative (for attention on CPU: the math backend,"
            " torch.nn.attention.sdpa_kernel(SDPBackend.MATH)).",
        )
    )


def _run_with_provenance(
    graph: fx.GraphModule, values: Sequence[Any], decomposed: dict[Any, Callable[..., Any]]
) -> Any:
    """Run ``G`` node by node, each op under the module and user line of the node it copies.

    So every node of ``G``'s graphs points at the user's line its first-order node came from
    (Note [Module paths and source lines]); not ``fx.Interpreter``, which would replace the
    tracer's own notes with the copied node's metadata. Ops in ``decomposed`` run through
    their decomposition (Note [Backward ops without a derivative]).
    """
    env: dict[fx.Node, Any] = {}
    inputs = iter(values)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        elif node.op == "get_attr":
            env[node] = getattr(graph, str(node.target))
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            run = decomposed.get(node.target) or REPLACED.get(node.target, node.target)
            with fx_traceback.annotate(_note(node)):
                env[node] = run(*args, **kwargs)
    raise AssertionError("expected the graph to end with an output node")


def _note(node: fx.Node) -> dict[str, Any]:
    info = node.meta.get(META_KEY)
    source = getattr(info, "source", None)
    where = None if source is None else (source.filename, source.lineno, source.name)
    note: dict[str, Any] = {SOURCE_KEY: where, SOURCE_FIXED_KEY: True}
    if getattr(info, "module", ""):
        note[MODULE_KEY] = info.module  # type: ignore[union-attr]
    return note


__all__ = ["Driver", "HigherOrder", "Orders", "capture_backward"]
