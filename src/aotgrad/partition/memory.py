"""The predicted peak memory of a training step: a simulation of what the runtime holds.

:func:`predict_peak` replays, op by op, what a step ``f(*inputs).backward()`` holds
when it runs the forward and backward graphs (Note [What a step holds]) and returns a
:class:`PeakEstimate`: the peak, where in the step it occurs, and what is live then.
``aotgrad.testing.measure_peak`` measures the same step; tests hold them together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from aotgrad import _torch_compat as compat
from aotgrad.capture import node_info
from aotgrad.errors import UserFrame
from aotgrad.ops.table import op_name
from aotgrad.partition.saved import record_dict, storages
from aotgrad.partition.sizes import ExampleSize, hint
from aotgrad.signature import Cotangent, Grad, Output, Saved, Signature, StateAtBackward

__all__ = ["LiveValue", "PeakEstimate", "held_after_forward", "predict_peak", "shared_node_facts"]

# The bytes an op allocates at its own peak, outputs included (None: just its new outputs).
Workspace = Callable[[fx.Node], int | None]
# A live storage's label before it is made a LiveValue: the node, graph, kind and bytes.
_Label = tuple[fx.Node, str, str, Any]


@dataclass(frozen=True)
class LiveValue:
    """A storage live at the peak: the value that made it, and why it is still held."""

    name: str  # the value's node name in its graph
    graph: str  # "forward" or "backward"
    kind: str  # "input", "output", "saved", "temporary", "cotangent", "gradient", "workspace",
    # or "state" (Note [State updated by the backward])
    nbytes: int
    module: str
    source: UserFrame | None

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self)


@dataclass(frozen=True)
class PeakEstimate:
    """The predicted peak of one step: forward, backward, gradients (Note [What a step holds])."""

    # Bytes of tensor storage live at the peak, the step's inputs included.
    nbytes: int
    # Bytes of the inputs (parameters, buffers, arguments): held by the caller before the step.
    inputs: int
    # Where: the graph ("forward", "backward" or "gradients") and the op running then.
    graph: str
    node: str
    op: str
    module: str
    source: UserFrame | None
    # Everything live at the peak, largest first (the op's own scratch space as "workspace").
    live: tuple[LiveValue, ...]
    # Under dynamic shapes, the sizes every byte above is counted at: the example inputs'
    # (Note [Weights at the example sizes]); () for static shapes.
    sizes: tuple[ExampleSize, ...] = ()

    @property
    def allocated(self) -> int:
        """Bytes the step allocated beyond its inputs at the peak: what ``measure_peak`` reports."""
        return self.nbytes - self.inputs

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self, allocated=self.allocated)


# Note [What a step holds]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The prediction follows the runtime, storage by storage (Note [Counting bytes]):
# a storage is live while anything holds it, and each op's peak is what is live
# before it plus what it allocates while it runs (its new outputs, and any
# scratch space the kernel takes: ``workspace``). For ``f(x, w) =
# (x @ w).relu().sum()`` with 4 KB inputs and 4 KB activations:
#
#     forward:   mm      live x, w (caller) + mm                  -> 12 KB
#                relu    + relu; mm freed after its last use      -> 12 KB
#                sum     + sum (4 bytes); relu is saved, kept
#     between:   the loss (the user's output) and relu (saved) stay; the rest is freed
#     backward:  .backward() allocates the loss's cotangent (ones, 4 bytes),
#                held until it returns
#                the graph frees each saved value after its last use
#                (the runtime drops its own references first) and returns
#                grads of x and w, held together until the graph returns
#     gradients: each grad becomes ``.grad`` as is, unless its strides break
#                ``.grad``'s layout contract: then autograd copies it first
#                (a row-major gradient of a transposed leaf), one more grad's bytes
#
# On CUDA each storage counts as the caching allocator's block: its bytes
# rounded up to a multiple of 512. The inputs count in ``nbytes`` and not in
# ``allocated`` (``measure_peak`` does not see them either). Every output is
# held to the end of the step, as ``f(*inputs).backward()`` holds its loss: a
# step that drops other outputs before its backward (``f(x)[0].backward()``, a
# ``ModelOutput`` whose logits die once its loss is read) measures less than
# predicted, never more. Outside the model: a ``.grad`` that already holds a
# gradient (accumulated in place: less memory, never more), user compilers
# that keep values the default runtime frees, and kernels' scratch space when
# ``workspace`` is not given.


class _Holds:
    """Who holds each storage; the bytes of those with a holder are live."""

    def __init__(self) -> None:
        self.holders: dict[Any, set[Any]] = {}
        self.sizes: dict[Any, int] = {}
        self.labels: dict[Any, LiveValue | _Label] = {}
        self.live = 0

    def hold(self, key: Any, nbytes: int, holder: Any, label: LiveValue | _Label) -> int:
        """Hold ``key``; the bytes that were newly allocated (0 when it was live already)."""
        holders = self.holders.setdefault(key, set())
        fresh = not holders
        holders.add(holder)
        if fresh:
            self.sizes[key], self.labels[key] = nbytes, label
            self.live += nbytes
        return nbytes if fresh else 0

    def drop(self, key: Any, holder: Any) -> None:
        holders = self.holders.get(key)
        if holders is None or holder not in holders:
            return
        holders.discard(holder)
        if not holders:
            self.live -= self.sizes.pop(key)
            del self.holders[key], self.labels[key]

    def drop_all(self, holder_kind: str) -> None:
        for key in list(self.holders):
            for holder in [h for h in self.holders[key] if h[0] == holder_kind]:
                self.drop(key, holder)

    def snapshot(self) -> list[LiveValue | _Label]:
        """What is live now, labelled later (:func:`_live_value`): most snapshots are
        overtaken by a higher peak before the step ends."""
        return list(self.labels.values())


class _Simulation:
    def __init__(self, workspace: Workspace | None) -> None:
        self.holds = _Holds()
        self.workspace = workspace
        # The highest point so far: its bytes, graph, op, and what was live (unlabelled).
        self.best: tuple[int, str, fx.Node | None, list[LiveValue | _Label]] | None = None
        self.inputs = 0

    def at(self, nbytes: int, graph: str, node: fx.Node | None, extra: LiveValue | None) -> None:
        if self.best is not None and nbytes <= self.best[0]:
            return
        live = self.holds.snapshot() + ([extra] if extra is not None else [])
        self.best = (nbytes, graph, node, live)

    def estimate(self, sizes: tuple[ExampleSize, ...]) -> PeakEstimate:
        """The highest point as a :class:`PeakEstimate`, everything live labelled."""
        assert self.best is not None
        nbytes, graph, node, live = self.best
        info = node_info(node) if node is not None and node.op != "output" else None
        return PeakEstimate(
            nbytes=nbytes,
            inputs=self.inputs,
            graph=graph,
            node="" if node is None else node.name,
            op=_op_text(node),
            module="" if info is None else info.module,
            source=None if info is None else info.source,
            live=tuple(sorted(map(_live_value, live), key=lambda v: -v.nbytes)),
            sizes=sizes,
        )

    def run(self, gm: fx.GraphModule, graph: str, kinds: dict[fx.Node, str]) -> None:
        """Run ``gm``'s ops in order; values in ``kinds`` (outputs) are held past the graph."""
        nodes = list(gm.graph.nodes)
        # A storage is labelled by what the graph returns it as, whichever node makes it
        # (a weight's gradient made by ``mm`` and returned through ``t``: a gradient).
        stored = {key: kind for node, kind in kinds.items() for key in _storages(node)}
        last_use: dict[fx.Node, int] = {}
        for i, node in enumerate(nodes):
            for source in node.all_input_nodes:
                last_use[source] = i
        for i, node in enumerate(nodes):
            if node.op == "output":
                break
            if node.op != "placeholder":
                self._compute(node, graph, stored)
            for source in [*node.all_input_nodes, node]:
                if last_use.get(source, i) <= i and source not in kinds:
                    for key in _storages(source):
                        self.holds.drop(key, (graph, source))

    def _compute(self, node: fx.Node, graph: str, stored: dict[Any, str]) -> None:
        before = self.holds.live
        fresh = sum(
            self.holds.hold(
                key, size, (graph, node), _label(node, graph, stored.get(key, "temporary"), size)
            )
            for key, size in _allocations(node).items()
        )
        during = None if self.workspace is None else _remembered(node, "workspace", self.workspace)
        scratch = 0 if during is None else max(0, during - fresh)
        extra = None
        if scratch:
            extra = LiveValue(node.name, graph, "workspace", scratch, *_where(node))
        self.at(before + fresh + scratch, graph, node, extra)

    def hold_node(self, node: fx.Node, holder: Any, graph: str, kind: str) -> None:
        for key, size in _allocations(node).items():
            self.holds.hold(key, hint(size), holder, _label(node, graph, kind, size))

    def drop_node(self, node: fx.Node, holder: Any) -> None:
        for key in _storages(node):
            self.holds.drop(key, holder)


def predict_peak(
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    signature: Signature,
    workspace: Workspace | None = None,
    sizes: tuple[ExampleSize, ...] = (),
) -> PeakEstimate:
    """The peak of the step ``f(*inputs).backward()`` run by the default runtime (Note [What a
    step holds]), every ``.grad`` None before it; ``workspace(node)``, when given, says how
    many bytes an op allocates at its own peak (outputs included). Symbolic sizes count at
    their example values, ``sizes`` (Note [Weights at the example sizes])."""
    sim = _Simulation(workspace)
    inputs = [n for n in forward.graph.nodes if n.op in ("placeholder", "get_attr")]
    for node in inputs:
        sim.hold_node(node, ("caller",), "forward", "input")
    sim.inputs = sim.holds.live
    sim.at(sim.holds.live, "forward", None, None)
    outputs = _outputs(forward)
    kinds = {n: _kind(d) for n, d in zip(outputs, signature.forward_outputs, strict=True) if n}
    sim.run(forward, "forward", kinds)
    for i, (node, desc) in enumerate(zip(outputs, signature.forward_outputs, strict=True)):
        if node is not None and isinstance(desc, Output | Saved):
            sim.hold_node(node, ("user" if isinstance(desc, Output) else "saved", i), "", "")
    sim.holds.drop_all("forward")
    if backward is not None:
        _backward(sim, forward, backward, signature)
    return sim.estimate(sizes)


def _backward(
    sim: _Simulation, forward: fx.GraphModule, backward: fx.GraphModule, signature: Signature
) -> None:
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    saved_positions = range(len(signature.forward_outputs))[signature.saved_in_forward]
    saved_holders = iter(("saved", i) for i in saved_positions)
    for node, desc in zip(placeholders, signature.backward_inputs, strict=True):
        if isinstance(desc, StateAtBackward):  # the caller's buffer, counted among the inputs
            continue
        if isinstance(desc, Cotangent):  # autograd allocates it (.backward(): ones)
            sim.hold_node(node, ("cotangent",), "backward", "cotangent")
            sim.at(sim.holds.live, "backward", node, None)
        sim.hold_node(node, ("backward", node), "backward", _kind(desc))
        if isinstance(desc, Saved):  # the runtime hands its reference to the graph
            sim.drop_node(node, next(saved_holders))
    grads = _outputs(backward)
    kinds = {n: "state" for n in grads[signature.new_state_in_backward] if n is not None}
    kinds |= {n: "gradient" for n in grads[signature.grads_in_backward] if n is not None}
    sim.run(backward, "backward", kinds)
    for i, node in enumerate(grads):
        if node is not None:
            sim.hold_node(node, ("grad", i), "backward", "gradient")
    sim.holds.drop_all("backward")  # the cotangents: held by .backward()'s caller to the end
    primals = [n for n in forward.graph.nodes if n.op == "placeholder"]
    span = signature.grads_in_backward  # not the new state values: copied into the inputs
    grad_nodes = zip(grads[span], signature.backward_outputs[span], strict=True)
    for i, (node, grad_of) in enumerate(grad_nodes):
        grad, primal = (None, None) if node is None else (node.meta.get("val"), primals[i])
        if not isinstance(grad_of, Grad) or not isinstance(grad, torch.Tensor) or primal is None:
            continue
        param = primal.meta.get("val")
        if isinstance(param, torch.Tensor) and not _obeys_layout_contract(grad, param):
            assert node is not None
            nbytes = _rounded(hint(grad.numel() * grad.element_size()), grad.device)
            copy = LiveValue(node.name, "backward", "gradient", nbytes, *_where(node))
            sim.at(sim.holds.live + copy.nbytes, "gradients", node, copy)  # AccumulateGrad's copy
            sim.holds.hold(("copy", i), copy.nbytes, ("grad", i), copy)
            sim.drop_node(node, ("grad", i))


# Note [A floor under a plan's peak]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward graph holds each value it returns (the user's outputs and the
# saved values) from the op that makes it to the end of the graph (Note [What
# a step holds]): nothing frees them before the backward. So while its last op
# runs, every returned storage that is not an input's is live, and
#
#     peak.allocated >= bytes of the distinct storages the forward returns,
#                       less those behind its inputs (parameters, arguments)
#
# whatever the order of either graph and whatever the backward does. It reads
# only the plan's saved set, so a peak budget weighs it before splitting
# (Note [Peak budgets]): a plan whose floor is above the budget cannot fit and
# is never split. With the two layers of the ``aotgrad.budget`` doctest, save_all
# returns the loss (4 bytes) and saves 135,168 bytes of activations besides x,
# w1 and w2: floor 135,172 under its predicted peak of 282,632. On the 12-block
# benchmark GPT (``bench/planning.py``) at ``budget(peak=76_638_216)`` the
# floors are 0.94 to 0.96 of the peaks of the plans saving most, and rule out
# 14 of the 18 plans the choice would otherwise split.
#
# A plan with its recomputed ops at the backward's start (Note [Recompute just
# before use]) has a second floor, at the end of those leading ops: each value
# they made, and each saved value, that a later op of the backward reads (or
# the backward returns) is live then. In the doctest, saved-bytes cap 138240
# recomputed at the start holds relu and relu_1 (65,536 bytes each) and h
# (4,096): floor 135,168. On the benchmark GPT such floors are 0.96 of their
# peaks (``family._Backward.held_after_recompute``). Storages count once (a
# saved view of a saved value adds nothing) and as the allocator counts them (CUDA's
# 512-byte blocks), as the prediction does.


def held_after_forward(inputs: Iterable[fx.Node], returned: Iterable[fx.Node]) -> int:
    """Bytes of the storages behind ``returned`` that are not behind ``inputs``: a lower bound
    of the step's ``peak.allocated`` when a forward returns them (Note [A floor under a plan's
    peak])."""
    taken = {key for node in inputs for key in _storages(node)}
    held: dict[Any, int] = {}
    for node in returned:
        held |= {key: size for key, size in _allocations(node).items() if key not in taken}
    return sum(hint(size) for size in held.values())


# CUDA's caching allocator hands out blocks in multiples of 512 bytes, and counts them so.
_CUDA_BLOCK = 512


# Note [Plans share their nodes' facts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every split of one joint graph copies the joint's nodes, and a copy keeps its
# node's value (``meta["val"]``, the same object) and arguments of the same
# values. What a prediction asks of a node -- its storages and their bytes,
# its op's measured scratch space (``workspace.op_peak``) -- is a function of
# those values, so a peak budget's candidates (Note [Peak budgets]) ask it once
# per joint node, not once per copy: inside ``shared_node_facts()``, answers
# are remembered by the identity of the node's value and op, the value held
# so that its identity is not reused while the scope lasts. A peak budget's
# family keeps one record for its joint (``family._Context.facts``), so every
# floor and split of every budget asked of that joint shares it. A node whose
# value is not a tensor (or tuple of them) is asked every time.

_FACTS: ContextVar[dict[Any, tuple[Any, Any]] | None] = ContextVar("node_facts", default=None)


@contextmanager
def shared_node_facts(store: dict[Any, tuple[Any, Any]] | None = None) -> Iterator[None]:
    """Predictions inside remember each node's facts by its value (Note [Plans share their
    nodes' facts]); in ``store`` when given, which keeps them for later scopes."""
    token = _FACTS.set({} if store is None else store)
    try:
        yield
    finally:
        _FACTS.reset(token)


def _remembered(node: fx.Node, what: str, ask: Callable[[fx.Node], Any]) -> Any:
    facts = _FACTS.get()
    val = node.meta.get("val")
    values = val if isinstance(val, list | tuple) else [val]
    if facts is None or not values or not all(isinstance(v, torch.Tensor) for v in values):
        return ask(node)
    key = (what, id(val), node.target)
    if key not in facts:
        facts[key] = (val, ask(node))
    return facts[key][1]


def _allocations(node: fx.Node) -> dict[Any, int]:
    """The storages behind ``node``'s value with the bytes their allocator counts."""
    return _remembered(node, "allocations", _count_allocations)


def _storages(node: fx.Node) -> dict[Any, Any]:
    return _remembered(node, "storages", storages)


def _count_allocations(node: fx.Node) -> dict[Any, int]:
    val = node.meta.get("val")
    tensors = val if isinstance(val, list | tuple) else [val]
    devices = {k: t.device for t in tensors if isinstance(t, torch.Tensor) for k in storages(t)}
    return {key: _rounded(hint(size), devices.get(key)) for key, size in storages(node).items()}


def _rounded(nbytes: int, device: torch.device | None) -> int:
    if device is None or device.type != "cuda":
        return nbytes
    return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK


def _obeys_layout_contract(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``AccumulateGrad`` can take ``grad`` as ``param.grad`` without a copy."""
    if grad.layout is not torch.strided or param.layout is not torch.strided:
        return True
    grad, param = _at_example_sizes(grad), _at_example_sizes(param)
    if not compat.is_non_overlapping_and_dense(param):
        return bool(grad.is_contiguous())
    return all(
        size == 1 or gs == ps
        for size, gs, ps in zip(grad.shape, grad.stride(), param.stride(), strict=True)
    )


def _at_example_sizes(t: torch.Tensor) -> torch.Tensor:
    """A strided meta tensor of ``t``'s layout with its sizes at their example values: a
    layout question asked of it adds no guard (Note [Weights at the example sizes])."""
    return torch.empty_strided(
        [hint(n) for n in t.shape], [hint(n) for n in t.stride()], dtype=t.dtype, device="meta"
    )


def _outputs(gm: fx.GraphModule) -> list[fx.Node | None]:
    (values,) = gm.graph.output_node().args
    return [v if isinstance(v, fx.Node) else None for v in values]  # type: ignore[union-attr]


def _kind(desc: Any) -> str:
    if isinstance(desc, Saved):
        return "saved"
    if isinstance(desc, Cotangent):
        return "cotangent"
    return "output" if isinstance(desc, Output) else "temporary"


def _label(node: fx.Node, graph: str, kind: str, size: Any) -> _Label:
    return (node, graph, kind, size)


def _live_value(label: LiveValue | _Label) -> LiveValue:
    if isinstance(label, LiveValue):
        return label
    node, graph, kind, size = label
    return LiveValue(node.name, graph, kind, hint(size), *_where(node))


def _where(node: fx.Node) -> tuple[str, UserFrame | None]:
    try:
        info = node_info(node)
    except AssertionError:
        return "", None
    return info.module, info.source


def _op_text(node: fx.Node | None) -> str:
    if node is None:
        return "(the step starts)"
    return op_name(node.target) if node.op == "call_function" else node.op
