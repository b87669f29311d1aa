"""The predicted peak of a whole scan step, and a peak budget's choice of the body's plan.

Note [A scan's step peak]
~~~~~~~~~~~~~~~~~~~~~~~~~
A scan's step is ``carry, ys = scan(...)`` (N iterations of the body's forward
graph), then the backward of the loop's outputs with a dense cotangent for each
(allocated after the forward, as ``.backward()`` allocates a loss's), walking
the iterations in reverse. Its peak is not one body's (Note [What a step
holds] counts one forward and one backward): the loop holds what no iteration
sees, and the prediction follows the loop storage by storage, as
``loops/loop.py`` holds them (Note [Saved per iteration]):

    forward, iteration i:   live + the body forward's peak above its inputs
                            then + its outputs (new carry, y, saved);
                            the old carry is dropped unless saved
    after the loop:         + N stacked ys; the N y's are dropped
    backward, iteration i:  (checkpoint: + the forward's peak again, its saved kept)
                            live + the body backward's peak above its inputs
                            then + its grads: the carry's become the next
                            cotangent, closed-over grads are summed (one sum
                            allocated while the old total lives), x's kept
    after the loop:         (xs stacked: + N stacked x grads)

Every saved value (or, with ``checkpoint=True``, every iteration's incoming
carry) stays held until the loop's backward returns, so the peak is usually
at iteration 0's backward: all N iterations' saved values, N-1 iterations'
x grads (scan_layers: each layer's parameter grads) and one body backward.
The body's graphs are simulated once each (:func:`graph_run`, the peak above
their inputs and which storages they return); the loop itself is a walk over
N iterations of those few numbers and storages, so a 12-layer stack costs one
layer's simulation. For ``scan_layers`` of 3 blocks whose forward saves
``s`` bytes per layer, with parameter grads ``g`` per layer and a body
backward peaking ``b`` above its inputs::

    peak = 3 s (all saved values, held)  + 2 g (layers 2 and 1's grads, returned at the end)
         + b (layer 0's backward, its grads included) + the output and its cotangent

``aotgrad.testing.measure_peak`` of the same step measures it; on CPU the two
agree to the byte where Note [What a step holds] is exact. Not counted:
extra tensors of ``scan_layers`` given to every row that require grad (the
engine sums their N grads), a ``.grad`` already holding a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from aotgrad.capture import JointGraph
from aotgrad.errors import PartitionError, format_error, user_frame_from_stack
from aotgrad.ops.table import is_random
from aotgrad.partition import Budget, Partitioned, split_plan
from aotgrad.partition.peak_budget import Candidate, candidates, every_candidate
from aotgrad.partition.saved import storages
from aotgrad.partition.sizes import hint
from aotgrad.partition.workspace import op_peak
from aotgrad.signature import Cotangent

__all__ = ["LoopShape", "ScanPeak", "choose_for_peak", "predict_scan_peak"]


@dataclass(frozen=True)
class ScanPeak:
    """The predicted peak of a scan's step (Note [A scan's step peak])."""

    # Bytes the step allocates at its peak above its inputs: what ``measure_peak`` reports.
    allocated: int
    # Where: "forward iteration 3", "backward iteration 0", "stacking ys", ...
    where: str
    # The loop's length and whether it recomputes each iteration's forward.
    length: int
    checkpoint: bool
    # The body's plan (its partition strategy, or a peak budget's chosen candidate).
    plan: str


@dataclass(frozen=True)
class GraphRun:
    """One run of a graph whose inputs its caller holds: the bytes above them at its peak, and
    the storages behind each output (``None`` for an output that is not a tensor)."""

    peak: int
    inputs: tuple[tuple[Any, ...], ...]  # per placeholder, its storage keys
    outputs: tuple[dict[Any, int], ...]  # per output, its storages and bytes
    # Per output, its tensor's bytes before any rounding (0 for None): what N of them
    # stacked take, rounded once, by ``stacked``.
    tensor_bytes: tuple[int, ...]
    # On CUDA each storage counts as 512-byte blocks (Note [What a step holds]).
    cuda: bool

    def stacked(self, positions: Sequence[int], length: int) -> int:
        """Bytes of each of these outputs stacked ``length`` times, one tensor per output."""
        return sum(_rounded(length * self.tensor_bytes[p], self.cuda) for p in positions)


def graph_run(gm: fx.GraphModule) -> GraphRun:
    """Simulate ``gm`` as the loop runs it: the inputs held by the caller, each other value
    freed after its last use, the outputs held past the graph (Note [What a step holds])."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outputs = [v if isinstance(v, fx.Node) else None for v in gm.graph.output_node().args[0]]  # type: ignore[union-attr]
    held = {k for n in placeholders for k in storages(n)}
    kept = {n for n in outputs if n is not None}
    last_use = {source: i for i, n in enumerate(nodes) for source in n.all_input_nodes}
    holders: dict[Any, set[fx.Node]] = {}
    sizes: dict[Any, int] = {}
    live = peak = 0
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "output"):
            continue
        fresh = 0
        for key, size in _allocations(node).items():
            if key in held:
                continue
            if not holders.get(key):
                sizes[key] = size
                fresh += size
            holders.setdefault(key, set()).add(node)
        during = op_peak(node)
        peak = max(peak, live + fresh + max(0, (during or 0) - fresh))
        live += fresh
        for source in [*node.all_input_nodes, node]:
            if last_use.get(source, i) <= i and source not in kept:
                for key in storages(source):
                    if key in holders and source in holders[key]:
                        holders[key].discard(source)
                        if not holders[key]:
                            live -= sizes.pop(key)
                            del holders[key]
    return GraphRun(
        peak=peak,
        inputs=tuple(tuple(storages(n)) for n in placeholders),
        outputs=tuple({} if n is None else _allocations(n) for n in outputs),
        tensor_bytes=tuple(_tensor_bytes(n) for n in outputs),
        cuda=any(_on_cuda(n.meta.get("val")) for n in nodes),
    )


def _tensor_bytes(node: fx.Node | None) -> int:
    val = None if node is None else node.meta.get("val")
    return hint(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _on_cuda(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


def _rounded(nbytes: int, cuda: bool) -> int:
    return -(-nbytes // 512) * 512 if cuda else nbytes


def _allocations(node: fx.Node) -> dict[Any, int]:
    """A node's storages with the bytes the allocator counts (CUDA: 512-byte blocks)."""
    val = node.meta.get("val")
    tensors = val if isinstance(val, list | tuple) else [val]
    cuda = any(_on_cuda(t) for t in tensors)
    return {k: _rounded(hint(b), cuda) for k, b in storages(node).items()}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where the loop finds each value among the body's graph inputs and outputs."""

    num_lifted: int
    num_carry: int
    num_x: int
    # Forward outputs: the new carry's leaves, y's tensor leaves, the saved values.
    carry_out: tuple[int, ...]
    y_out: tuple[int, ...]
    saved_out: tuple[int, ...]
    # Per cotangent of the backward: ("carry", j) or ("y", j).
    cotangent_of: tuple[tuple[str, int], ...]
    # Bytes of each CPU generator state the loop keeps under checkpoint when the body may
    # draw (Note [Random ops in a scan]); 0 when it never draws or runs on CUDA, whose
    # allocator does not see them.
    rng_state: int


def layout_of(partitioned: Partitioned, num_lifted: int, num_carry: int, num_x: int) -> Layout:
    """The loop's positions in ``partitioned``'s graphs (Note [Scan's calling convention])."""
    signature = partitioned.signature
    outputs = signature.outputs_in_forward
    tensors = range(outputs.start, outputs.stop)
    saved = signature.saved_in_forward
    owners = []
    for c in signature.backward_inputs:
        if isinstance(c, Cotangent):
            k = signature.outputs.index(c.of)
            owners.append(("carry", k) if k < num_carry else ("y", k - num_carry))
    return Layout(
        num_lifted=num_lifted,
        num_carry=num_carry,
        num_x=num_x,
        carry_out=tuple(tensors[:num_carry]),
        y_out=tuple(tensors[num_carry:]),
        saved_out=tuple(range(saved.start, saved.stop)),
        cotangent_of=tuple(owners),
        rng_state=_rng_state_bytes(partitioned.forward),
    )


def _rng_state_bytes(forward: fx.GraphModule) -> int:
    nodes = list(forward.graph.nodes)
    if not any(is_random(n.target) for n in nodes):
        return 0
    values = [n.meta.get("val") for n in nodes]
    if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values):
        return 0
    return torch.get_rng_state().nbytes


class _Memory:
    """Who holds each storage of the loop; the live bytes and the peak so far."""

    def __init__(self) -> None:
        self.holders: dict[Any, set[Any]] = {}
        self.held_by: dict[Any, set[Any]] = {}  # holder -> the storages it holds
        self.sizes: dict[Any, int] = {}
        self.live = 0
        self.peak = 0
        self.where = "the step starts"

    def at(self, extra: int, where: str) -> None:
        """The live bytes plus ``extra`` (what an op allocates as it runs) are reached."""
        if self.live + extra > self.peak:
            self.peak, self.where = self.live + extra, where

    def hold(self, key: Any, nbytes: int, holder: Any) -> None:
        """``holder`` holds ``key``; its ``nbytes`` count when it had no holder."""
        if key[0] == "caller":  # the caller's tensors: not the step's allocation
            return
        holders = self.holders.setdefault(key, set())
        if not holders:
            self.sizes[key] = nbytes
            self.live += nbytes
        holders.add(holder)
        self.held_by.setdefault(holder, set()).add(key)

    def drop(self, holder: Any) -> None:
        """``holder`` lets go of everything; what nothing holds any more is freed."""
        for key in self.held_by.pop(holder, ()):
            holders = self.holders[key]
            holders.discard(holder)
            if not holders:
                self.live -= self.sizes.pop(key)
                del self.holders[key]


# A storage of the loop: ("caller", ...) for the caller's, else (what made it, iteration, key).
Key = tuple[Any, ...]


@dataclass(frozen=True, kw_only=True)
class _Loop:
    """The walk of Note [A scan's step peak] for one plan of the body."""

    layout: Layout
    forward: GraphRun
    backward: GraphRun
    length: int
    checkpoint: bool
    stacked: bool

    def peak(self) -> tuple[int, str]:
        """The step's peak above its inputs, and where it falls."""
        mem = _Memory()
        incoming, kept = self._forwards(mem)
        cotangent = self._cotangents(mem)
        totals: dict[int, Key] = {}  # per closed-over input: its grad summed so far
        if self.checkpoint:  # the generator's state, put back after the backward
            mem.hold(("rng state", "backward"), self.layout.rng_state, "kept")
        for i in reversed(range(self.length)):
            saved = kept[i] if not self.checkpoint else self._recomputed(mem, i, incoming[i])
            cotangent = self._run_backward(mem, i, saved, cotangent, totals)
        lay = self.layout
        if self.stacked:  # each x leaf's grads stacked; the rows die after
            x_out = range(lay.num_lifted + lay.num_carry, len(self.backward.outputs))
            stacked = self.backward.stacked(x_out, self.length)
            mem.at(stacked, "the backward stacking the grads of xs")
        return mem.peak, mem.where

    def _forwards(self, mem: _Memory) -> tuple[list[list[Key]], list[list[Key | None]]]:
        """The N forwards and the stacking of ys: per iteration, its incoming carry and
        (without checkpoint) its saved values."""
        lay = self.layout
        carry: list[Key] = [("caller", "init", j) for j in range(lay.num_carry)]
        incoming: list[list[Key]] = []
        kept: list[list[Key | None]] = []
        for i in range(self.length):
            incoming.append(carry)
            if self.checkpoint:
                for key in carry:
                    mem.hold(key, 0, "kept")  # the carry's storage: held already
                mem.hold(("rng state", i), lay.rng_state, "kept")
            mem.at(self.forward.peak, f"forward iteration {i}")
            out = self._run_forward(mem, i, carry, "results")
            new_carry = [_one(out[p]) for p in lay.carry_out]
            for key in new_carry:
                mem.hold(key, 0, ("carry", i + 1))
            for key in (k for p in lay.y_out for k in out[p]):
                mem.hold(key, 0, "ys")
            if not self.checkpoint:
                kept.append([_first(out[p]) for p in lay.saved_out])
                for key in (k for p in lay.saved_out for k in out[p]):
                    mem.hold(key, 0, "kept")
            mem.drop("results")
            mem.drop(("carry", i))
            carry = new_carry
        stacked = self.forward.stacked(lay.y_out, self.length)
        mem.at(stacked, "the forward stacking ys")
        mem.hold(("ys",), stacked, "user")
        mem.drop("ys")
        return incoming, kept

    def _cotangents(self, mem: _Memory) -> list[Key]:
        """The dense cotangents the caller allocates after the forward (as ``.backward()``
        does); the carry's."""
        lay = self.layout
        cotangent = [("cotangent", j) for j in range(lay.num_carry)]
        for key, p in zip(cotangent, lay.carry_out, strict=True):
            mem.hold(key, self._bytes(p), "user")
        ys = self.forward.stacked(lay.y_out, self.length)
        mem.hold(("cotangent", "ys"), ys, "user")
        mem.at(0, "the cotangents")
        return cotangent

    def _bytes(self, p: int) -> int:
        return sum(self.forward.outputs[p].values())

    def _run_forward(self, mem: _Memory, i: int, carry: list[Key], holder: Any) -> list[list[Key]]:
        """The forward graph at iteration ``i``: its outputs' storages, held by ``holder``."""
        lay = self.layout
        inputs: list[Key | None] = [
            *[("caller", "lifted", k) for k in range(lay.num_lifted)],
            *carry,
            *[("caller", "x", k) for k in range(lay.num_x)],
        ]
        return _outputs(self.forward, inputs, ("forward", i), mem, holder)

    def _recomputed(self, mem: _Memory, i: int, carry: list[Key]) -> list[Key | None]:
        """checkpoint: iteration ``i``'s forward again, its saved values kept, the rest freed."""
        mem.at(self.forward.peak, f"backward iteration {i} (recomputing its forward)")
        out = self._run_forward(mem, i, carry, "recompute")
        saved = [_first(out[p]) for p in self.layout.saved_out]
        for key in saved:
            if key is not None:
                mem.hold(key, 0, "values")
        mem.drop("recompute")
        return saved

    def _run_backward(
        self,
        mem: _Memory,
        i: int,
        saved: list[Key | None],
        cotangent: list[Key],
        totals: dict[int, Key],
    ) -> list[Key]:
        """The backward graph at iteration ``i``; the next carry cotangent."""
        lay = self.layout
        given = [
            cotangent[j] if kind == "carry" else ("cotangent", "ys") for kind, j in lay.cotangent_of
        ]
        mem.at(self.backward.peak, f"backward iteration {i}")
        out = _outputs(self.backward, [*saved, *given], ("backward", i), mem, "grads")
        mem.drop("values")  # checkpoint: the recomputed saved values die with the graph's call
        for k in range(lay.num_lifted):  # summed over iterations: total + g
            if not out[k]:
                continue
            key = _one(out[k])
            if k in totals:
                nbytes = sum(self.backward.outputs[k].values())
                mem.at(nbytes, f"backward iteration {i} (summing grads)")
                key = ("sum", i, k)
                mem.hold(key, nbytes, ("total", k, i))
                mem.drop(("total", k, i + 1))
            else:
                mem.hold(key, 0, ("total", k, i))
            totals[k] = key
        for k in range(lay.num_lifted + lay.num_carry, len(out)):
            for key in out[k]:
                mem.hold(key, 0, "x grads")
        new = [_one(out[lay.num_lifted + j]) for j in range(lay.num_carry)]
        for key in new:
            mem.hold(key, 0, ("carry cotangent", i))
        mem.drop(("carry cotangent", i + 1))
        mem.drop("grads")
        return new


def _outputs(
    run: GraphRun, inputs: Sequence[Key | None], tag: tuple[Any, ...], mem: _Memory, holder: Any
) -> list[list[Key]]:
    """``run``'s outputs as storages of the loop: an input's where an output is one (or a view
    of one), else fresh ones, held by ``holder``."""
    env: dict[Any, Key] = {}
    for local, given in zip(run.inputs, inputs, strict=True):
        for key in local:
            if given is not None:
                env[key] = given
    found: list[list[Key]] = []
    for storages_of in run.outputs:
        names = []
        for key, nbytes in storages_of.items():
            name = env.get(key, (*tag, key))
            mem.hold(name, nbytes, holder)
            names.append(name)
        found.append(names)
    return found


def _one(keys: list[Key]) -> Key:
    if len(keys) != 1:
        raise AssertionError(f"expected one storage behind a tensor, got {keys}")
    return keys[0]


def _first(keys: list[Key]) -> Key | None:
    """A saved value's storage (None for a saved size, which has none)."""
    return keys[0] if keys else None


def predict_scan_peak(partitioned: Partitioned, shape: LoopShape) -> ScanPeak:
    """The predicted peak of the scan's step with ``partitioned`` as the body's plan (Note [A
    scan's step peak])."""
    if partitioned.backward is None:
        raise AssertionError("expected a body with a backward graph")
    layout = layout_of(partitioned, shape.num_lifted, shape.num_carry, shape.num_x)
    loop = _Loop(
        layout=layout,
        forward=graph_run(partitioned.forward),
        backward=graph_run(partitioned.backward),
        length=shape.length,
        checkpoint=shape.checkpoint,
        stacked=shape.stacked,
    )
    allocated, where = loop.peak()
    return ScanPeak(
        allocated=allocated,
        where=where,
        length=shape.length,
        checkpoint=shape.checkpoint,
        plan=partitioned.strategy,
    )


# Note [Peak budgets over a scan]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``scan(..., partition=budget(peak=B))`` and ``scan_layers(...)`` bound the
# peak of the whole step (Note [A scan's step peak]), not one body's. The body's
# candidates are the fixed family of Note [Peak budgets] (built once for the
# body, whatever N); each gets its step peak for this N, checkpoint and xs, and
# the plan is the same argmin as there with the step peak in place of the
# body's:
#
#     argmin over {c : step_peak(c, N) <= B} of
#         (recomputed matmul-class FLOPs, recompute FLOPs, step peak, saved bytes, position)
#
# so the same argument makes it monotone (a smaller B never gives a larger
# predicted step peak). Another length is another plan: a peak budget keys the
# body by N too. Below the family's smallest step peak the PartitionError names
# it, and, without checkpoint, the smallest with ``checkpoint=True``. For 12
# MLP layers (``tests/test_scan_peak.py``), save_all's step peak is 12 layers'
# saved values plus the last backward; a budget below it recomputes each
# layer's hidden activation, and ``checkpoint=True`` keeps 12 carries only.


@dataclass(frozen=True, kw_only=True)
class LoopShape:
    """What a scan step's peak depends on besides the body's plan."""

    num_lifted: int
    num_carry: int
    num_x: int
    length: int
    checkpoint: bool
    stacked: bool


def choose_for_peak(
    joint: JointGraph, limit: Budget, shape: LoopShape
) -> tuple[Partitioned, ScanPeak]:
    """The least-recompute plan of the body whose predicted step peak fits ``limit.peak``
    (Note [Peak budgets over a scan]); PartitionError naming the smallest step peak."""
    assert limit.peak is not None, f"expected a peak budget, got {limit}"
    split = _Recording(joint)
    family = candidates(joint, limit.time_limit)
    scored = [(c, split.of(c)) for c in every_candidate(family, split)]
    peaks = [predict_scan_peak(p, shape) for _, p in scored]
    fits = [k for k, peak in enumerate(peaks) if peak.allocated <= limit.peak]
    if not fits:
        raise PartitionError(_below_floor(limit, shape, scored, peaks))
    best = min(fits, key=lambda k: _rank(scored[k][0], peaks[k], k))
    chosen, partitioned = scored[best]
    peak = replace(peaks[best], plan=chosen.label)
    note = (
        f"{limit} over a scan of {shape.length} iterations: predicted step peak"
        f" {peak.allocated} bytes at {peak.where}; chose {chosen.label} ({chosen.flops}"
        f" recompute FLOPs) of {len(scored)} candidates (Note [Peak budgets over a scan])"
    )
    notes = [n for n in (note, family.note, partitioned.note) if n]
    return replace(partitioned, strategy=str(limit), note="; ".join(notes)), peak


class _Recording:
    """Splits the family's plans and keeps each split, so that weighing a candidate for the
    loop costs no second split (a family from the cache splits again)."""

    def __init__(self, joint: JointGraph) -> None:
        self.joint = joint
        self.splits: dict[str, Partitioned] = {}

    def __call__(self, plan: Any, label: str) -> Partitioned:
        partitioned = split_plan(self.joint, plan, label)
        self.splits[label] = partitioned
        return partitioned

    def of(self, candidate: Candidate) -> Partitioned:
        found = self.splits.get(candidate.label)
        return found if found is not None else self(candidate.plan, candidate.label)


def _rank(c: Candidate, peak: ScanPeak, position: int) -> tuple[int, ...]:
    """Note [Peak budgets]'s order, with the step's peak in place of the body's."""
    return (c.intensive_flops, c.flops, peak.allocated, c.saved_bytes, position)


def _below_floor(
    limit: Budget,
    shape: LoopShape,
    scored: list[tuple[Candidate, Partitioned]],
    peaks: list[ScanPeak],
) -> str:
    least = min(range(len(peaks)), key=lambda k: (peaks[k].allocated, k))
    floor = peaks[least]
    todo = f"Raise the budget to at least {floor.allocated}"
    if not shape.checkpoint:
        with_checkpoint = min(
            predict_scan_peak(p, replace(shape, checkpoint=True)).allocated for _, p in scored
        )
        todo += (
            f"; or pass checkpoint=True, which keeps each iteration's carry only: its smallest"
            f" predicted step peak is {with_checkpoint} bytes"
        )
    todo += "; or run fewer iterations (layers) or smaller inputs per scan"
    return format_error(
        f"no plan of the scan's body fits {limit} over {shape.length} iterations"
        f"{' with checkpoint=True' if shape.checkpoint else ''}: the smallest predicted step"
        f" peak of {len(peaks)} candidate plans is {floor.allocated} bytes"
        f" ({floor.allocated / 1e6:.2f} MB), with {scored[least][0].label} (at {floor.where})",
        user_frame_from_stack(),
        f"{todo} (Note [Peak budgets over a scan]).",
    )
