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
``optable.passes_gradient_through``). A saved value the kept gradients read
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

import functools
import operator
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from aotgrad.capture import Body, JointGraph
from aotgrad.capture.provenance import META_KEY, NodeInfo, set_info
from aotgrad.capture.recorder import MODULE_KEY, SOURCE_FIXED_KEY, SOURCE_KEY
from aotgrad.errors import AotgradError, DoubleBackwardError, UserFrame, format_error
from aotgrad.optable import (
    draws_random,
    must_run,
    op_name,
    outputs_reached,
    passes_gradient_through,
    passes_no_gradient,
)
from aotgrad.runtime.differentiable_ops import (
    NO_DERIVATIVE,
    REPLACED,
    decomposition_of,
    is_op_named,
    op_without_derivative,
)
from aotgrad.runtime.straight_line import Step
from aotgrad.signature import FlatInputs, Signature, storage_key
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


@dataclass(frozen=True)
class ZeroLink:
    """Forward inputs eager's double backward reaches from one gradient of ``G`` only
    through saved values read as masks (Note [Saved values read as masks])."""

    # The gradient's forward-input position (a position among ``G``'s outputs).
    grad: int
    # Forward inputs ``G`` sends no gradient to from it: they get zeros.
    zeros: tuple[int, ...]
    # Every forward input the masks came from: under ``create_graph`` the zeros are a
    # function of them, as eager's are.
    reached: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Slice:
    """What ``G`` reads and computes for one set of primals requiring grad and one set of
    gradients asked for (Note [Only the gradients asked for])."""

    # Forward-input positions whose gradient ``G`` computes; None for every other input.
    grads: tuple[int, ...]
    # Per gradient, the forward inputs that get zeros from it besides (Note [Saved values
    # read as masks]).
    zero_links: tuple[ZeroLink, ...]
    # Forward-input positions ``G`` takes, in order.
    primals: tuple[int, ...]
    # Saved positions ``G`` recomputes from the primals; the others it takes as saved.
    recomputed: tuple[int, ...]
    constants: tuple[int, ...]
    # Forward inputs changed in place that ``G`` reads but whose value reaches none of its
    # outputs: zeros stand in for them (Note [Primals in the backward]).
    stand_ins: tuple[int, ...]
    graph: fx.GraphModule

    @functools.cached_property
    def linked(self) -> tuple[tuple[int, ...], tuple[ZeroLink, ...]]:
        """The forward inputs ``zero_links`` name, and the links by their positions there."""
        inputs = tuple(sorted({i for link in self.zero_links for i in link.reached}))
        at = {i: k for k, i in enumerate(inputs)}.__getitem__
        local = tuple(
            ZeroLink(n, tuple(map(at, link.zeros)), tuple(map(at, link.reached)))
            for n, link in enumerate(self.zero_links)
        )
        return inputs, local

    def zeros(self, i: int) -> torch.Tensor:
        """The stand-in for forward input ``i``."""
        node = _placeholders(self.graph)[self.primals.index(i)]
        val = node.meta["val"]
        return torch.zeros(tuple(val.shape), dtype=val.dtype, device=val.device)


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
        placeholders = _placeholders(self.forward)
        saved = _outputs(self.forward)[self.saved_in_forward]
        index = {node: i for i, node in enumerate(placeholders)}
        for j, node in enumerate(saved):
            if node in index:
                self.saved_as_is.setdefault(index[node], j)
        read = {index[n] for n in _ancestors(saved) if n in index}  # inputs saved values need
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
    ) -> Sequence[torch.Tensor | None]:
        """The gradients as differentiable functions of the primals and cotangents.

        ``needs_grad``: the forward inputs requiring grad; ``wanted``: those whose gradient the
        running backward uses (Note [Only the gradients asked for]); the others get None.
        ``kept``: the forward inputs in ``extra`` and their versions at the call (Note
        [Primals in the backward]).
        """
        if not any(wanted):
            return (None,) * len(wanted)
        piece = self._slice(tuple(needs_grad), tuple(wanted))
        values = [
            *(
                piece.zeros(i) if i in piece.stand_ins else self._primal(i, saved, kept)
                for i in piece.primals
            ),
            *(saved[j] for j in piece.constants),
            *cotangents,
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
        raise _changed_input(self._input_name(i))

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
        key = (id(piece), *(_meta(v) for v in values), _sharing(values))
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


def _changed_input(what: str) -> DoubleBackwardError:
    return DoubleBackwardError(
        format_error(
            f"create_graph=True needs the value input {what} had when the compiled function"
            " was called, to differentiate its gradient again, but the function changed that"
            " input in place (Note [Primals in the backward]).",
            None,
            f"Clone {what} before changing it inside the function first, or change"
            " it outside the compiled function, after the backward.",
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


def _meta(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    return (
        tuple(v.shape),
        tuple(v.stride()),
        v.storage_offset(),
        v.dtype,
        v.device,
        v.requires_grad,
        v.is_leaf,
    )


def _sharing(values: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """Per value, the first value that is it and the first sharing its memory: a capture
    specializes on both (one cotangent passed for two outputs, a saved view of a primal)."""
    same: dict[int, int] = {}
    storages: dict[Any, int] = {}
    found = []
    for k, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            found.append((k, k))
            continue
        found.append((same.setdefault(id(v), k), storages.setdefault(storage_key(v), k)))
    return tuple(found)


def _nodes(graph: fx.GraphModule | Sequence[Step]) -> Iterable[Any]:
    """An fx module's nodes, or the steps of a graph read from a file (the same fields)."""
    return graph.graph.nodes if isinstance(graph, fx.GraphModule) else graph


def _placeholders(graph: fx.GraphModule | Sequence[Step]) -> list[Any]:
    return [n for n in _nodes(graph) if n.op == "placeholder"]


def num_forward_inputs(forward: fx.GraphModule | Sequence[Step]) -> int:
    """How many inputs the forward graph takes."""
    return len(_placeholders(forward))


def _outputs(graph: fx.GraphModule | Sequence[Step]) -> list[Any]:
    (output,) = [n for n in _nodes(graph) if n.op == "output"]
    return list(output.args[0])


def _ancestors(targets: Sequence[Any], stop: Container[Any] = ()) -> list[Any]:
    """Every node the targets need, themselves included, in no set order; ``stop`` nodes
    and what only they need are left out."""
    seen: dict[Any, None] = {}
    stack = [t for t in targets if isinstance(t, fx.Node | Step)]
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen[node] = None
        stack.extend(node.all_input_nodes)
    return list(seen)


# Note [Primals in the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``G`` recomputes dependent saved values from the primals, so the forward
# keeps the primals the saved values are computed from. Most are saved
# already (a matmul saves its weight): those are not kept twice. The others
# (``extra``) are kept on ``ctx`` with their version counters, not saved:
# a first-order backward never unpacks them, ``saved_tensors_hooks`` (offloading)
# never move them, and the memory report, which counts the saved values, does
# not count them: they are the caller's own tensors (mostly parameters, kept
# alive by the module anyway; an input activation lives as long as the
# outputs' ``grad_fn``).
# ``G`` checks their versions, as autograd checks saved tensors, and refuses an
# input changed in place since the call. For ``f(x) = (x * 2).sin()`` the
# forward saves ``mul``; ``extra = (x,)``.
#
# An input the function changes in place is not kept: the epilogue's
# ``copy_`` would fail the version check of every backward. ``G`` needs one
# only when a saved value that depends on a primal requiring grad is computed
# from it; then there is no faithful value to recompute from, and the
# backward raises ``DoubleBackwardError`` naming the input. For
# ``f(x, n) = x * n.add_(1)`` (``n`` a counter), the saved ``n + 1`` depends
# on no primal requiring grad: ``G`` takes it as saved, and nothing is needed.
# BatchNorm's running statistics are the same: the saved mean and inverse
# standard deviation are computed from the input, not from them.


def build_slice(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    signature: Signature,
    needs_grad: Sequence[bool],
    changed: frozenset[int] = frozenset(),
    wanted: Sequence[bool] | None = None,
) -> Slice:
    """``G``'s graph for these primals requiring grad (Note [Differentiable backward]),
    computing the gradients of the forward inputs in ``wanted`` only (all those requiring grad
    when None: Note [Only the gradients asked for]).

    ``changed``: forward inputs the function changes in place (Note [Primals in the backward]).
    """
    wanted = needs_grad if wanted is None else wanted
    placeholders = _placeholders(forward)
    saved = _outputs(forward)[signature.saved_in_forward]
    bw_placeholders = _placeholders(backward)
    grads = [
        g if w and n else None
        for g, w, n in zip(_outputs(backward), wanted, needs_grad, strict=True)
    ]
    saved_inputs = bw_placeholders[signature.saved_in_backward]
    live = _live(backward, grads)
    read = [n in live for n in saved_inputs]
    seeds = {n: 1 << j for j, n in enumerate(saved_inputs)}
    differentiated = _reaching(_carried(backward, seeds, through_zeros=False), grads)
    depends = _depends_on(
        forward, [p for p, needed in zip(placeholders, needs_grad, strict=True) if needed]
    )
    tensors = [
        isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in saved
    ]
    recomputed = tuple(
        j
        for j in range(len(saved))
        if read[j] and (not tensors[j] or (saved[j] in depends and differentiated >> j & 1))
    )
    # The recompute stops at the saved values no primal requiring grad reaches: ``G`` takes
    # them as saved (a dropout mask).
    boundary = {
        saved[j]: j for j in reversed(range(len(saved))) if tensors[j] and saved[j] not in depends
    }
    needed = _ancestors([saved[j] for j in recomputed], stop=boundary)
    _refuse_random(needed)
    reached = {boundary[a] for n in needed for a in n.all_input_nodes if a in boundary}
    constants = tuple(
        j for j in range(len(saved)) if j not in recomputed and (read[j] or j in reached)
    )
    masks = [j for j in constants if saved[j] in depends]  # Note [Saved values read as masks]
    links = _zero_links(forward, backward, signature, needs_grad, grads, masks)
    primals = tuple(i for i, p in enumerate(placeholders) if p in needed)
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for i in primals:
        env[placeholders[i]] = _placeholder(
            graph, f"primal_{placeholders[i].name}", placeholders[i]
        )
    saved_nodes: dict[int, fx.Node] = {}
    for j in constants:
        saved_nodes[j] = _placeholder(graph, f"saved_{bw_placeholders[j].name}", bw_placeholders[j])
    for node, j in boundary.items():
        if j in saved_nodes:
            env[node] = saved_nodes[j]
    cotangents = [
        _placeholder(graph, f"cotangent_{n.name}", n)
        for n in bw_placeholders[signature.cotangents_in_backward]
    ]
    wanted_nodes = set(needed)
    for node in forward.graph.nodes:
        if node in wanted_nodes and node.op != "placeholder":
            env[node] = _copy(graph, root, forward, node, env)
    for j in recomputed:
        saved_nodes[j] = env[saved[j]]
    # The backward's inputs: the saved values, then the cotangents (Note [Positions]).
    env.update((bw_placeholders[j], node) for j, node in saved_nodes.items())
    env.update(zip(bw_placeholders[signature.cotangents_in_backward], cotangents, strict=True))
    for node in backward.graph.nodes:
        if node.op != "placeholder" and node.op != "output" and node in live:
            env[node] = _copy(graph, root, backward, node, env)
    graph.output(fx.map_arg(tuple(grads), lambda n: env[n]))
    gm = fx.GraphModule(root, graph, "differentiable_backward")
    links = _without_real_gradients(links, gm, primals)
    stand_ins = tuple(i for i in primals if i in changed)
    for i in stand_ins:
        if needs_grad[i] or _reaches_outputs(gm, primals.index(i)):
            raise _changed_input(str(signature.forward_inputs[i]))
    for i in sorted({i for link in links for i in link.reached} & changed):
        raise _changed_input(str(signature.forward_inputs[i]))
    return Slice(
        grads=tuple(i for i, g in enumerate(grads) if g is not None),
        zero_links=links,
        primals=primals,
        recomputed=recomputed,
        constants=constants,
        stand_ins=stand_ins,
        graph=gm,
    )


def _reaching(carried: dict[fx.Node, int], grads: Sequence[Any]) -> int:
    """The bits ``carried`` to any of ``grads``."""
    bits = 0
    for g in grads:
        bits |= carried.get(g, 0) if isinstance(g, fx.Node) else 0
    return bits


def _zero_links(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    signature: Signature,
    needs_grad: Sequence[bool],
    grads: Sequence[Any],
    masks: Sequence[int],
) -> tuple[ZeroLink, ...]:
    """Per gradient ``G`` computes, the forward inputs requiring grad that eager's double
    backward reaches through the saved values ``masks`` only: they get zeros (Note [Saved
    values read as masks])."""
    if not masks:
        return ()
    saved = _outputs(forward)[signature.saved_in_forward]
    saved_inputs = _placeholders(backward)[signature.saved_in_backward]
    edges = _carried(backward, {saved_inputs[j]: 1 << j for j in masks}, through_zeros=True)
    inputs = {p: 1 << i for i, p in enumerate(_placeholders(forward)) if needs_grad[i]}
    reached_by = _carried(forward, inputs, through_zeros=True)
    links = []
    for k, g in enumerate(grads):
        read = _reaching(edges, [g])
        bits = 0
        for j in masks:
            if read >> j & 1:
                bits |= reached_by.get(saved[j], 0)
        if bits:
            reached = tuple(i for i in range(len(needs_grad)) if bits >> i & 1)
            links.append(ZeroLink(k, reached, reached))
    return tuple(links)


def _without_real_gradients(
    links: tuple[ZeroLink, ...], gm: fx.GraphModule, primals: tuple[int, ...]
) -> tuple[ZeroLink, ...]:
    """``links`` whose zeros leave out the inputs ``G`` itself sends a gradient to from that
    gradient; those left with none dropped."""
    inputs = {p: 1 << i for i, p in zip(primals, _placeholders(gm), strict=False)}
    carried = _carried(gm, inputs, through_zeros=True)
    outputs = _outputs(gm)
    kept = []
    for link in links:
        real = _reaching(carried, [outputs[link.grad]])
        zeros = tuple(i for i in link.zeros if not real >> i & 1)
        if zeros:
            kept.append(replace(link, zeros=zeros))
    return tuple(kept)


def _live(backward: fx.GraphModule, grads: Sequence[Any]) -> set[fx.Node]:
    """The backward's nodes the kept ``grads`` need, with every op that must run though
    nothing reads it (an error check, a collective) and what it needs."""
    effects = [n for n in backward.graph.nodes if n.op == "call_function" and must_run(n)]
    return set(_ancestors([*grads, *effects]))


def _reaches_outputs(gm: fx.GraphModule, position: int) -> bool:
    """Does placeholder ``position``'s value reach an output (Note [Inputs only some outputs read])?"""
    reached: dict[fx.Node, tuple[int, ...] | None] = {_placeholders(gm)[position]: None}
    for node in gm.graph.nodes:
        if node.op == "output":
            return any(n in reached for n in node.all_input_nodes)
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in reached:
            outputs = reached[node.args[0]]
            if outputs is None or node.args[1] in outputs:
                reached[node] = None
            continue
        positions = [k for k, a in enumerate(node.args) if _reads(a, reached)]
        if any(_reads(v, reached) for v in node.kwargs.values()):
            reached[node] = None
        elif positions:
            reached[node] = _outputs_of(node, positions)
    return False


def _reads(arg: Any, reached: dict[fx.Node, Any]) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return any(n in reached for n in found)


def _outputs_of(node: fx.Node, positions: Sequence[int]) -> tuple[int, ...] | None:
    found: set[int] = set()
    for k in positions:
        outputs = outputs_reached(node.target, node.args, k)
        if outputs is None:
            return None
        found.update(outputs)
    return tuple(sorted(found))


def _depends_on(forward: fx.GraphModule, sources: Sequence[fx.Node]) -> set[fx.Node]:
    """Forward nodes a gradient can flow from to one of ``sources`` (themselves included):
    for ``dropout``, the mask is a constant (``_carried``)."""
    return set(_carried(forward, dict.fromkeys(sources, 1), through_zeros=True))


def _carried(
    graph: fx.GraphModule, seeds: dict[fx.Node, int], *, through_zeros: bool
) -> dict[fx.Node, int]:
    """Per node, the bits of the ``seeds`` whose gradient can flow from it (seeds included;
    nodes carrying none left out).

    Not through values that hold no floating point (a mask, indices), nor ops that pass no
    gradient (``empty_like``, ``bernoulli``); without ``through_zeros``, nor arguments PyTorch
    differentiates as zero (``threshold_backward``'s ``self``: ``passes_gradient_through``),
    where autograd's graph still has an edge, which carries zeros.
    """
    carried = dict(seeds)
    for node in graph.graph.nodes:
        if node.op != "call_function" or passes_no_gradient(node.target):
            continue
        bits = 0
        for where, arg in [*enumerate(node.args), *node.kwargs.items()]:
            if through_zeros or passes_gradient_through(node.target, where):
                for read in _nodes_in(arg):
                    bits |= carried.get(read, 0)
        if bits and _can_hold_gradient(node):
            carried[node] = carried.get(node, 0) | bits
    return carried


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found


def _can_hold_gradient(node: fx.Node) -> bool:
    values = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    if not values:  # sizes (a recompute reads them), or no value known: assume it can
        return True
    return any(v.is_floating_point() or v.is_complex() for v in values)


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node


def _copy(
    graph: fx.Graph,
    root: torch.nn.Module,
    source: fx.GraphModule,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
) -> fx.Node:
    if node.op == "get_attr":  # a constant of the graph: the new root holds it too
        name = f"{source.__class__.__name__}_{node.target}".replace(".", "_")
        if not hasattr(root, name):
            setattr(root, name, getattr(source, node.target))  # type: ignore[arg-type]
        copied = graph.get_attr(name)
        copied.meta = dict(node.meta)
        return copied
    return graph.node_copy(node, lambda n: env[n])


def _refuse_random(nodes: Sequence[fx.Node]) -> None:
    """A random op recomputed in ``G`` would draw other numbers: refuse it."""
    for node in nodes:
        if node.op == "call_function" and draws_random(node.target, node.args, node.kwargs):
            raise DoubleBackwardError(
                format_error(
                    f"create_graph=True through a compiled function would recompute the random"
                    f" op {op_name(node.target)}, whose result the gradient depends on through"
                    " a primal requiring grad; it would draw other numbers than the forward"
                    " did (Note [Differentiable backward]).",
                    _source(node),
                    "Make the random draw outside the compiled function and pass its result in"
                    " (a dropout mask).",
                )
            )


def _source(node: fx.Node) -> UserFrame | None:
    return getattr(node.meta.get(META_KEY), "source", None)


def capture_backward(
    graph: fx.GraphModule, values: Sequence[Any], order: int, driver: Driver
) -> Any:
    """Capture, partition and compile ``G`` on these values (fake tensors, as every capture)
    with ``driver``; its nodes note their derivative ``order``.

    An op of ``graph`` autograd has no derivative for is run through its decomposition and the
    capture tried again (Note [Backward ops without a derivative]).
    """
    names = [n.name for n in _placeholders(graph)]
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
            None if node is None else _source(node),
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


__all__ = ["Driver", "HigherOrder", "Orders", "ZeroLink", "build_slice", "capture_backward"]
