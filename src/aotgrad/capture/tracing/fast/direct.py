"""The direct tracer: record aten ops straight into a graph, without functionalization.

Note [Direct tracing]
~~~~~~~~~~~~~~~~~~~~~
The full trace (functionalization inside ``make_fx``, Note [Two tracers])
runs every op through three Python layers: functionalization (unwrap,
redispatch, rewrap), the proxy mode (pytree over the arguments, a ``Proxy``
per value, a snapshot of each output) and the fake tensor mode. For most
functions the first two layers only copy: the functional graph holds exactly
the ops that ran, each in-place op as its functional variant. The direct
tracer therefore puts one light mode above the fake tensor mode that appends
each op to an ``fx.Graph`` as it runs::

    user code:      y = (x @ w).relu()
    dispatched:     aten.mm(x, w) -> mm;  aten.relu(mm) -> relu
    recorded:       mm = aten.mm.default(x, w); relu = aten.relu.default(mm)

with the same node names and metadata the proxy mode gives (``val``,
``tensor_meta``, ``seq_nr``, ``original_aten``, the ``custom`` annotations).
In-place ops are recorded as their functional variants (Note [In-place ops,
directly]), a write through a view as a scatter into its base (Note [Writes
through views, directly]). The moment anything needs
more than recording, the direct trace stops with :class:`NeedsFullTrace` and
a reason, and under ``tracer="auto"`` the full trace runs the function again
(Note [Choosing a tracer])::

    the function does                    the direct trace stops with
    x.split(2)[0].add_(1)                aten.add_.Tensor: a write through a view made by ...
    x.t_(), x an input                   aten.t_.default mutates an input's size or strides
    out=, bernoulli_ (dropout)           aten.bernoulli_.float mutates a tensor (an in-place ...)
    w.mul_(2), w an input needing grad   an in-place op on a tensor autograd sees as a leaf ...
    torch.tensor([1.0]) * x              aten.lift_fresh.default lifts a tensor constant ...
    x.sum().item()                       aten._local_scalar_dense.default reads tensor data
    checkpoint(..., use_reentrant=True)  a reentrant checkpoint refuses autograd.grad ...
    checkpoint(f, x, context_fn=sac)     an op ran under a selective checkpoint's policy ...

(The last: ``sac = partial(create_selective_checkpoint_contexts, policy)``,
Note [Selective checkpoints stop the direct trace]. The fourth: the direct
trace's inputs are fake leaves, and autograd refuses an in-place op on a leaf
that requires grad before any mode sees the op; the full trace's inputs are
functional wrappers, which are not leaves.) Besides
every call with the fast path off (Note [The fast path as a layer]), three
kinds of call skip the direct trace: symbolic sizes (``dynamic=True``); inputs
that share memory: which of them an output view comes from (so where its
gradient goes: ``fn(b[0], b)`` returning ``b.t()``) only functionalization
tells, with one storage per input's wrapper; and tensor subclass inputs: the
recording mode would see the subclass's op before its ``__torch_dispatch__``
runs (Note [Tensor subclasses]). The graphs are identical, which a test
checks op by op.
The price of stopping is that the function's Python runs twice (PyTorch's
AOTAutograd always runs it at least twice).

Note [In-place ops, directly]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Real models mutate: a BatchNorm in training adds 1 to ``num_batches_tracked``
and updates its running statistics, torchvision's ``ReLU(inplace=True)`` and
``Hardswish(inplace=True)`` overwrite the conv/BN output, a ResNet block does
``out += identity``. Stopping at the first of these sent every convnet down
the full trace (capture times: ``bench/findings.md``).

Functionalization turns an in-place op into its functional variant, whose
result is the target's new value. Where nothing else sees the target's
memory, that is all it does, and the direct trace does the same: it records
the functional op and from then on reads the target as that node::

    user code:   h = conv(x); h.relu_(); h.add_(identity)
    recorded:    relu = aten.relu.default(convolution)
                 add = aten.add.Tensor(relu, identity)       # reads h: relu, not convolution
    variants:    relu_ -> relu (same arguments); _native_batch_norm_legit ->
                 _native_batch_norm_legit_functional (new values returned last)

The target must be a tensor this trace made or an input; where other
traced tensors share its memory (it is a view, or is viewed), the write is
scattered into their base and they read it from there (Note [Writes through
views, directly]); it must not overlap itself (Note [Writes through
overlapping views]); the new value must have the target's size, strides,
dtype and device (``x.add_(y)`` with a wider ``y``: stop; a view's strides
come back when it is replayed). Metadata mutations of inputs (``t_``),
``out=`` ops, random fills (Note [Random fills keep their layout]), in-place
ops on inputs in the backward (Note [State updated by the backward]) and any
in-place op of a ``.backward()`` inside the function (it accumulates
``.grad`` in place, which only the full trace refuses) stop. An
input whose value changed is an input mutation (Note [Input mutation]) the
runtime copies back; the direct trace takes only those autograd did not see
(the input does not require grad and kept its ``grad_fn``: running
statistics, counters), and stops for the others. Autograd's own checks still
run above the recording mode: an in-place op on a value the backward needs
raises eager's "modified by an inplace operation", as eager would. So resnet18,
mobilenet_v3, efficientnet and convnext take the direct trace.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import operator
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.autograd.graph import GradientEdge
from torch.fx.experimental.proxy_tensor import disable_autocast_cache, set_original_aten_op

from aotgrad._torch_compat import (
    COPY_META_FIELDS,
    FakeTensor,
    OpOverload,
    TorchDispatchMode,
    autograd_would_have_decomposed,
    below_autograd,
    dispatched_by_selective_checkpoint,
    fake_device,
    in_autograd_engine,
    op_node_name,
    seq_nr_of,
    tensor_metadata,
)
from aotgrad.capture.analyses.collectives import refuse_in_place_collective
from aotgrad.capture.analyses.mutation import (
    InputMutation,
    PrimalInfo,
    check_no_partial_overlap,
    may_overlap,
)
from aotgrad.capture.analyses.random import MANUAL_SEED
from aotgrad.capture.analyses.set_storage import resizes_watched
from aotgrad.capture.graph import lazy_module
from aotgrad.capture.tracing.fast.view_writes import (
    Storage,
    StorageView,
    ViewStep,
    chain_of,
    invertible,
    scatter,
)
from aotgrad.capture.tracing.recorder import Recorder
from aotgrad.capture.tracing.state import TraceState
from aotgrad.capture.tracing.tracers import (
    NeedsFullTrace,
    Tracer,
    refuses_autograd_grad,
    released,
)
from aotgrad.signature import storage_key

_PASS_THROUGH = (torch.ops.prim.device.default,)
_CONSTANTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

# Note [Selective checkpoints stop the direct trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A selective checkpoint (``checkpoint(fn, ..., context_fn=partial(
# create_selective_checkpoint_contexts, policy))``) asks its policy about each op from
# a dispatch mode above the tracer's. The answers reach the partitioner only as node
# tags (``node.meta["recompute"]``: MUST_SAVE, PREFER_RECOMPUTE, ...; Note [Selective
# checkpoint policies]), and torch's mode writes them only while a ``make_fx`` proxy
# mode traces: the full trace's. The direct trace records the region untagged, and a
# strategy free to choose recomputes what the policy said to save::
#
#     checkpoint(lambda x, w: (x * w).exp(), x, w, context_fn=...)   exp MUST_SAVE
#     direct trace:  exp untagged       mincut saves x and w, recomputes exp
#     full trace:    exp MUST_SAVE      mincut saves x, w and exp
#
# So the first op the policy's mode passes down stops the direct trace, and "auto"
# runs the full one (Note [Choosing a tracer]). While a mode's handler runs, that mode
# is off the mode stack, so the op is told by the Python stack instead: the policy
# mode's handler is a few of torch's frames above the recording mode's
# (``_torch_compat.dispatched_by_selective_checkpoint``; the walk ends at the first
# frame that is not torch's, under a microsecond per op). A plain checkpoint's
# contexts are no modes, and it stays on the direct trace; so does a ``context_fn``
# of the user's own modes, which sit above either tracer alike.
#
# The stop is raised inside the policy's mode. On torch 2.11 and 2.12 a checkpoint
# whose function raised leaves its contexts open until its frame lets go (Note [The
# direct trace's frames are let go]), and the recording mode's exit pops the top mode,
# the policy's, in place of its own; torch's "a dispatch mode is on" flag then stays
# set after both are gone::
#
#     stack: recording, policy   ->  recording exits: pops policy  ->  the frame lets
#     go, policy exits: pops recording, restores the flag it saved (on)
#
# So a stop lets go of its frames inside the recording mode (``_stops_released``):
# the policy's mode exits first.
_SELECTIVE_CHECKPOINT = (
    "an op ran under a selective checkpoint's policy (context_fn="
    "create_selective_checkpoint_contexts): only the full trace tags the ops with it"
)

# What autograd says, before any mode sees the op, when an in-place op meets a leaf (or a
# view of one) that requires grad: the direct trace's inputs are such leaves. The second:
# a custom Function's ctx.mark_dirty() on one.
_IN_PLACE_ON_LEAF = (
    "leaf Variable that requires grad is being used in an in-place operation",
    "leaf Variable that requires grad has been used in an in-place operation",
)


class DirectTracer(Tracer):
    """Records each op as it runs, without functionalization (Note [Direct tracing]).

    Raises :class:`NeedsFullTrace` for what it does not handle.
    """

    name = "direct"

    def __init__(
        self, recorder: Recorder, decompositions: Mapping[Any, Callable[..., Any]] | None
    ) -> None:
        super().__init__(recorder, decompositions)
        self._mode = _RecordingMode(recorder, decompositions)

    def run(
        self, joint: Callable[..., list[torch.Tensor | None]], fakes: Sequence[torch.Tensor]
    ) -> fx.GraphModule:
        stops = _stops_at_refusals()
        resizes = resizes_watched(_stop_at_resize)  # Note [Storage resizes of an input]
        with (
            self.recorder.recording(),
            disable_autocast_cache(),
            self._mode,
            _stops_released(),  # inside the mode: a stop lets go before the mode exits
            stops,
            resizes,
        ):
            for fake in fakes:
                self._mode.input(fake)
            values = joint(*fakes)
        return self._mode.finish(values, "joint")

    def graph_primals(
        self, fakes: Sequence[torch.Tensor], infos: Sequence[PrimalInfo]
    ) -> list[torch.Tensor]:
        return list(fakes)  # a repeated input is one fake already

    def differentiate_at(self, primal: torch.Tensor) -> GradientEdge | torch.Tensor | None:
        """The primal itself: a fake leaf no in-place op replaces (finding its edge costs a view)."""
        return primal if primal.requires_grad else None

    def traced(self, value: object) -> bool:
        return self._mode.traced(value)

    def input_mutations(self, state: TraceState) -> list[InputMutation]:
        """Inputs whose values an in-place op replaced, out of autograd's sight (Note [In-place ops, directly])."""
        mutations = []
        for i, (p, info) in enumerate(zip(state.graph_primals, state.inputs.infos, strict=True)):
            if info.duplicate_of is not None or id(p) not in self._mode.mutated:
                continue
            if p.requires_grad or p.grad_fn is not state.grad_fns[i]:
                raise NeedsFullTrace(
                    f"input {state.inputs.descriptors[i]} is changed in place where autograd"
                    " records it"
                )
            mutations.append(
                InputMutation(
                    index=i, data=True, metadata=None, with_grad=False, requires_grad=False
                )
            )
        return mutations

    def sync(self, values: Sequence[torch.Tensor]) -> None:
        """Scatter pending writes through views into the values (Note [Writes through views, directly])."""
        self._mode.sync_values(values)

    def unwrap(self, value: torch.Tensor | None) -> torch.Tensor | None:
        if value is not None:
            self._mode.sync_values([value])
        return value


def _stop_at_resize(storage: Any, nbytes: Any) -> bool:
    raise NeedsFullTrace("untyped_storage().resize_() (only the full trace replays it)")


@contextlib.contextmanager
def _stops_released() -> Iterator[None]:
    """A stop lets go of its frames here, inside the recording mode (Note [Selective
    checkpoints stop the direct trace])."""
    try:
        yield
    except NeedsFullTrace as e:
        released(e)
        raise


@contextlib.contextmanager
def _stops_at_refusals() -> Iterator[None]:
    """Autograd's refusals that only the direct trace meets become stops (Note [Direct tracing])."""
    try:
        yield
    except RuntimeError as e:
        if any(message in str(e) for message in _IN_PLACE_ON_LEAF):
            raise NeedsFullTrace(
                "an in-place op on a tensor autograd sees as a leaf that requires grad"
                " (the direct trace's inputs are such leaves)"
            ) from e
        if refuses_autograd_grad(e):
            raise NeedsFullTrace(
                "a reentrant checkpoint refuses autograd.grad (only the full trace"
                " differentiates into leaf inputs with .backward())"
            ) from e
        raise


class _RecordingMode(TorchDispatchMode):
    """Appends every aten op that runs below autograd to a graph (Note [Direct tracing])."""

    def __init__(
        self,
        recorder: Recorder,
        decompositions: Mapping[Any, Callable[..., Any]] | None,
    ) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.recorder = recorder
        self.decompositions = decompositions or {}
        self._nodes: dict[int, fx.Node] = {}
        self._alive: list[torch.Tensor] = []  # keeps every traced tensor's id unique
        # How many traced tensors share each storage: an in-place op on one of several would
        # change the others too (Note [In-place ops, directly]).
        self._storages: collections.Counter[Any] = collections.Counter()
        self._counted = 0  # how many tensors of _alive _storages has counted
        # ids of the tensors an in-place op gave a new value (their node is the new value's).
        self.mutated: set[int] = set()
        self._inputs: set[int] = set()  # ids of the graph inputs
        # Tensors over a base written through a view (Note [Writes through views, directly]).
        self._aliases: dict[int, StorageView] = {}
        self._stand_ins: list[torch.Tensor] = []  # the first values of those bases

    def input(self, t: torch.Tensor) -> None:
        node = self.graph.placeholder(f"arg{len(self._alive)}_1")
        self._copy_context(node)
        self._track(t, node)
        self._inputs.add(id(t))

    def traced(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._nodes

    def finish(self, values: Sequence[torch.Tensor | None], name: str) -> fx.GraphModule:
        node = self.graph.output([self._nodes[id(v)] if v is not None else None for v in values])
        self._copy_context(node)
        return lazy_module(torch.nn.Module(), self.graph, name)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _PASS_THROUGH:
            if len(args) == 1 and type(args[0]) is FakeTensor:  # the fake mode's own answer,
                return fake_device(args[0])  # without two modes' dispatch (a query per op)
            return func(*args, **kwargs)
        # Note [Selective checkpoints stop the direct trace]
        if dispatched_by_selective_checkpoint(sys._getframe(1)):
            raise NeedsFullTrace(_SELECTIVE_CHECKPOINT)
        if self._aliases:
            with self:
                self.sync_values(pytree.arg_tree_leaves(*args, **kwargs), replay=True)
        with set_original_aten_op(func):
            if isinstance(func, OpOverload) and (
                func._schema.is_mutable or _writes_unannotated(func, args, kwargs)
            ):
                return self._functionalize(func, args, kwargs)
            if func is MANUAL_SEED:
                self.recorder.check_reseed()  # Note [Reseeding inside the function]
            answer = self.recorder.host_checks.answer(  # Note [Host checks]
                func, args, lambda op, *a, **k: self._record(op, a, k)
            )
            if answer is not None:
                return answer
            out = self._record(func, args, kwargs)
            self.recorder.host_checks.note(func, out)
            return out

    def _functionalize(
        self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Record an in-place op as its functional variant (Note [In-place ops, directly])."""
        refuse_in_place_collective(func)  # Note [Collectives]: the full trace would refuse it too
        if in_autograd_engine() and not self.recorder.in_backward:
            # a .backward() inside the function, which the full trace refuses, accumulates
            # .grad with in-place ops
            raise NeedsFullTrace(f"{func} mutates a tensor in a backward the function runs")
        functional, targets = _functional_variant(func, args, kwargs)
        through_views = [self._check_target(func, target) for target in targets]
        check_no_partial_overlap(func, args, kwargs)  # Note [Writes that read overlapping memory]
        if torch.Tag.inplace_view in func.tags:
            if any(through_views):
                raise NeedsFullTrace(f"{func} restrides a tensor that shares memory (a view)")
            return self._restride(func, functional, args, kwargs)
        with self:
            out = functional(*args, **kwargs)
        if functional.overloadpacket.__name__.endswith("_functional"):
            results = out[: len(out) - len(targets)]
            new_values = out[len(out) - len(targets) :]
        else:
            results, new_values = args[0], (out,)
        for target, new, shared in zip(targets, new_values, through_views, strict=True):
            if target is None:
                continue
            _check_same_layout(func, target, new, strides=not shared)  # a view: replayed next
            self._nodes[id(target)] = self._nodes[id(new)]
            if shared:
                self._write_through(target, new)
            else:
                self.mutated.add(id(target))
        if any(through_views):
            with self:  # as functionalization does after a write: the target reads its base
                self.sync_values(targets)
        return tuple(results) if isinstance(results, list | tuple) else results

    def _restride(
        self,
        func: OpOverload,
        view_op: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A metadata mutation (``as_strided_``, ``t_``) of an intermediate, recorded as the view
        op it amounts to (Note [In-place ops, directly]); of an input: a stop."""
        target = args[0]
        if id(target) in self._inputs:
            raise NeedsFullTrace(f"{func} mutates an input's size or strides")
        with self:
            view = view_op(*args, **kwargs)
        func(*args, **kwargs)  # the target's own size and strides change, as in eager
        _check_same_layout(func, target, view)
        self._nodes[id(target)] = self._nodes[id(view)]
        return target

    def _sharing(self, t: torch.Tensor) -> int:
        """How many traced tensors share ``t``'s storage (counted lazily: only models with
        in-place ops pay for it)."""
        self._storages.update(storage_key(seen) for seen in self._alive[self._counted :])
        self._counted = len(self._alive)
        return self._storages.get(storage_key(t), 0)

    def _check_target(self, func: OpOverload, target: torch.Tensor | None) -> bool:
        """Stop unless ``func`` may write ``target``; is the write one through views?

        (Notes [In-place ops, directly], [Writes through views, directly].)
        """
        if target is None:
            return False
        if id(target) not in self._nodes:
            raise NeedsFullTrace(f"{func} mutates a tensor the trace did not create")
        if may_overlap(target):
            raise NeedsFullTrace(f"{func} mutates a tensor whose elements overlap")
        shared = id(target) in self._aliases or self._sharing(target) != 1
        if shared:
            self._check_view_write(func, target)
        elif self.recorder.in_backward and id(target) in self._inputs:
            raise NeedsFullTrace(f"{func} mutates an input in the backward")
        return shared

    def _check_view_write(self, func: OpOverload, target: torch.Tensor) -> None:
        """Stop unless the write into ``target`` can be scattered into its base."""
        alias = self._aliases.get(id(target)) or self._new_storage(func, target)
        why = invertible(alias.chain)
        if why is not None:
            raise NeedsFullTrace(f"{func}: {why}")
        if alias.storage.members != self._sharing(target):
            raise NeedsFullTrace(f"{func} writes a base some tensor aliases without a view op")
        if self.recorder.in_backward and alias.storage.root in self._inputs:
            raise NeedsFullTrace(f"{func} mutates an input in the backward")

    def _new_storage(self, func: OpOverload, target: torch.Tensor) -> StorageView:
        """Start keeping the views of ``target``'s base (Note [Writes through views, directly])."""
        key = storage_key(target)
        members = [t for t in self._alive if storage_key(t) == key]
        chains = [chain_of(self._nodes[id(t)]) for t in members]
        roots = {id(c[0]) if c is not None else None for c in chains}
        bases = [t for t, c in zip(members, chains, strict=True) if c is not None and not c[1]]
        if len(roots) != 1 or None in roots or not bases:
            raise NeedsFullTrace(f"{func} writes a view whose base the direct trace cannot tell")
        if bases[0].storage_offset() != 0:
            raise NeedsFullTrace(f"{func} writes a view of a base that is itself a view")
        # The base's value, over memory of its own (not recorded: the mode is off here).
        stand_in = torch.empty_strided(
            bases[0].shape, bases[0].stride(), dtype=bases[0].dtype, device=bases[0].device
        )
        self._nodes[id(stand_in)] = self._nodes[id(bases[0])]
        self._stand_ins.append(stand_in)
        storage = Storage(base=stand_in, root=id(bases[0]), members=len(members))
        for t, c in zip(members, chains, strict=True):
            assert c is not None
            self._aliases[id(t)] = StorageView(storage, c[1], storage.generation)
        return self._aliases[id(target)]

    def _write_through(self, target: torch.Tensor, new: torch.Tensor) -> None:
        """``target`` now holds ``new``; its base and other views see it when next read."""
        alias = self._aliases[id(target)]
        storage = alias.storage
        storage.pending.append((new, alias.chain))
        storage.generation += 1  # ``target`` too reads the base again (it is stale)
        if storage.root in self._inputs:
            self.mutated.add(storage.root)

    def sync_values(self, values: Sequence[object], *, replay: bool = False) -> None:
        """Bring each value over a base written through a view up to date, recording the
        scatters and replays (Note [Writes through views, directly]).

        ``replay``: the values are an op's arguments; what their sync records has the
        provenance of their nodes until then, as functionalization's replays have.
        """
        for value in values:
            alias = self._aliases.get(id(value))
            if alias is None or not alias.stale:
                continue
            assert isinstance(value, torch.Tensor)
            node = self._nodes[id(value)] if replay else None
            with below_autograd(), fx_traceback.set_current_replay_node(node):
                self._scatter_pending(alias.storage)
                fresh = alias.storage.base
                for step in alias.chain:
                    fresh = step.replay(fresh)
            _check_same_layout(torch.ops.aten.alias.default, value, fresh)
            self._nodes[id(value)] = self._nodes[id(fresh)]
            alias.generation = alias.storage.generation

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        _check_recordable(func)
        if func in self.decompositions:
            with self:
                out = self.decompositions[func](*args, **kwargs)
            if out is not NotImplemented:  # Note [Random fills keep their layout]
                return out
        if autograd_would_have_decomposed(func, pytree.arg_tree_leaves(*args, **kwargs)):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        node_args = self._arg(func, args)
        node_kwargs = self._arg(func, _without_defaults(func, kwargs))
        self.recorder.note_source()
        self.recorder.note_random(func, args, kwargs)
        out = func(*args, **kwargs)
        name = op_node_name(self.graph, func.overloadpacket.__name__)
        node = self.graph.create_node("call_function", func, node_args, node_kwargs, name=name)
        self._copy_context(node)
        self._output(func, out, node)
        if self._aliases and func.is_view and id(args[0]) in self._aliases:
            self._enroll_views(func, args, kwargs, out)
        return out

    def _enroll_views(
        self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """A view of a tensor over a written base is over that base too."""
        parent = self._aliases[id(args[0])]
        outs = out if isinstance(out, list | tuple) else [out]
        for i, view in enumerate(outs):
            index = i if isinstance(out, list | tuple) else None
            step = ViewStep(func, tuple(args[1:]), dict(kwargs), index, self._nodes[id(view)])
            self._aliases[id(view)] = StorageView(
                parent.storage, (*parent.chain, step), parent.generation
            )
            parent.storage.members += 1

    def _arg(self, func: OpOverload, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self._nodes.get(id(value))
            if node is None:
                raise NeedsFullTrace(f"{func} reads a tensor the trace did not create (a constant)")
            return node
        if isinstance(value, list | tuple):
            return type(value)(self._arg(func, v) for v in value)
        if isinstance(value, dict):
            return {k: self._arg(func, v) for k, v in value.items()}
        if isinstance(value, _SYMBOLIC):
            raise NeedsFullTrace(f"{func} takes symbolic sizes")
        return value

    def _output(self, func: OpOverload, out: Any, node: fx.Node) -> None:
        if isinstance(out, torch.Tensor):
            self._track(out, node)
            return
        if isinstance(out, _SYMBOLIC) or (
            isinstance(out, list | tuple) and any(isinstance(o, _SYMBOLIC) for o in out)
        ):
            raise NeedsFullTrace(f"{func} returns symbolic sizes")
        node.meta["val"] = out
        if not isinstance(out, list | tuple):
            return
        for i, item in enumerate(out):
            if item is None or isinstance(item, torch.Tensor):
                getitem = self.graph.call_function(operator.getitem, (node, i))
            if item is None:  # make_fx names a getitem for it too, then drops it: same names
                self.graph.erase_node(getitem)
            if isinstance(item, torch.Tensor):
                self._copy_context(getitem)
                self._track(item, getitem)

    def _track(self, t: torch.Tensor, node: fx.Node) -> None:
        """``node`` records ``t``: its value and metadata, as the proxy mode's."""
        node.meta["val"] = t
        node.meta["tensor_meta"] = tensor_metadata(t)
        self._nodes[id(t)] = node
        self._alive.append(t)

    def _scatter_pending(self, storage: Storage) -> None:
        """The base's value after its pending writes, recorded as scatters in write order."""
        for new, chain in storage.pending:
            storage.base = scatter(storage.base, new, chain) if chain else new
        storage.pending.clear()

    def _copy_context(self, node: fx.Node) -> None:
        """The metadata ``torch.fx``'s tracer copies from the current node context; a replayed
        view's provenance is its original's (Note [Writes through views, directly])."""
        if not fx_traceback.has_preserved_node_meta():
            return
        current = fx_traceback.get_current_meta()
        for key in COPY_META_FIELDS:
            if key in current:
                node.meta[key] = copy.copy(current[key])
        seq_nr = seq_nr_of(node.name)  # a replay's: its original's
        if seq_nr is not None:
            node.meta["seq_nr"] = seq_nr
        replayed = fx_traceback.get_current_replay_node()
        if replayed is not None:
            node.meta["is_functional_regenerated"] = True
            for key in ("custom", "stack_trace"):
                if key in replayed.meta:
                    node.meta[key] = replayed.meta[key]


def _check_recordable(func: Any) -> None:
    """Stop the direct trace at an op only the full trace handles (Note [Direct tracing])."""
    if not isinstance(func, OpOverload):
        raise NeedsFullTrace(f"{func} is not an aten op overload")
    refuse_in_place_collective(func)  # Note [Collectives]: the full trace would refuse it too
    if func._schema.is_mutable:
        raise NeedsFullTrace(f"{func} mutates a tensor (an in-place or out= op)")
    if func in _CONSTANTS:
        raise NeedsFullTrace(f"{func} lifts a tensor constant the function made (torch.tensor)")
    if torch.Tag.data_dependent_output in func.tags:
        raise NeedsFullTrace(f"{func} reads tensor data")


# Note [Writes a schema does not declare]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aten.native_batch_norm``'s schema declares no write, yet in training mode it
# updates ``running_mean`` and ``running_var`` in place. Recorded as it runs, the
# graph would not be functional (the epilogue would not copy anything back, and a
# compiler that trusts the schema would drop the update). Functionalization knows
# better and records ``_native_batch_norm_legit_functional``, which returns the new
# statistics after its own three results; the direct trace does the same, from this
# table (op -> functional variant, positions of the tensors it writes)::
#
#     F.batch_norm(x, rm, rv, training=True)
#     recorded:  bn = _native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-05)
#                out, mean, rstd = bn[0], bn[1], bn[2]; rm, rv now read bn[3], bn[4]
_UNANNOTATED_WRITES: dict[Any, tuple[OpOverload, tuple[int, ...]]] = {
    torch.ops.aten.native_batch_norm.default: (
        torch.ops.aten._native_batch_norm_legit_functional.default,
        (3, 4),
    ),
}


def _writes_unannotated(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Does ``func`` write a tensor its schema does not mark (Note [Writes a schema does not declare])?"""
    if func not in _UNANNOTATED_WRITES:
        return False
    if kwargs or len(args) != len(func._schema.arguments):
        return True  # not the positional call this check reads: _functional_variant stops
    training, running = args[5], (args[3], args[4])
    return bool(training) and all(isinstance(t, torch.Tensor) for t in running)


def _functional_variant(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[OpOverload, list[torch.Tensor | None]]:
    """The functional op recording ``func`` and the tensors ``func`` writes, or a stop.

    ``add_.Tensor`` -> ``add.Tensor`` (writes ``self``); ``_native_batch_norm_legit`` ->
    ``_native_batch_norm_legit_functional`` (writes the running stats, whose new values
    it returns after its own results). Note [In-place ops, directly].
    """
    stop = NeedsFullTrace(f"{func} mutates a tensor (an in-place or out= op)")
    schema = func._schema
    if func in _UNANNOTATED_WRITES:
        if kwargs or len(args) != len(schema.arguments):
            raise stop
        table_variant, positions = _UNANNOTATED_WRITES[func]
        return table_variant, [args[i] for i in positions]
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise stop  # random fills keep their layout in the full trace (Note [Random fills keep their layout])
    written = [
        (i, a)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    if any(a.kwarg_only for _, a in written):
        raise stop  # out= ops
    targets = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in written]
    name = func.overloadpacket.__name__
    if name.endswith("_") and [i for i, _ in written] == [0]:
        variant = _overload(name[:-1], func._overloadname)
        if variant is not None and _same_arguments(variant, func) and _returns_self(func):
            return variant, targets
        raise stop
    functional = _overload(f"{name}_functional", func._overloadname)
    if functional is None or any(r.alias_info is not None for r in schema.returns):
        raise stop
    if len(functional._schema.returns) != len(schema.returns) + len(written):
        raise stop
    return functional, targets


def _overload(packet: str, overload: str) -> OpOverload | None:
    found = getattr(getattr(torch.ops.aten, packet, None), overload, None)
    return found if isinstance(found, OpOverload) and not found._schema.is_mutable else None


def _same_arguments(functional: OpOverload, func: OpOverload) -> bool:
    names = [(a.name, a.kwarg_only) for a in functional._schema.arguments]
    return names == [(a.name, a.kwarg_only) for a in func._schema.arguments]


def _returns_self(func: OpOverload) -> bool:
    returns = func._schema.returns
    return (
        len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write
    )


def _check_same_layout(
    func: OpOverload, target: torch.Tensor, new: torch.Tensor, *, strides: bool = True
) -> None:
    """The new value must be what the target now holds: same size, strides, dtype, device.

    (A view written through is replayed from its base right after: its strides come back.)
    """
    same = (
        isinstance(new, torch.Tensor)
        and new.shape == target.shape
        and (not strides or new.stride() == target.stride())
        and new.dtype == target.dtype
        and new.device == target.device
    )
    if not same:
        raise NeedsFullTrace(f"{func} writes a value of another layout or dtype than its target's")


def _without_defaults(func: OpOverload, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword-only arguments equal to their default are left out, as ``make_fx`` records them.

    (An op called from C++, as the backward's are, passes every argument.)
    """
    if not kwargs:
        return kwargs
    defaults = {
        a.name: a.default_value
        for a in func._schema.arguments
        if a.kwarg_only and a.has_default_value()
    }
    return {
        k: v for k, v in kwargs.items() if not (k in defaults and _same_constant(v, defaults[k]))
    }


def _same_constant(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    return type(value) in (bool, int, float, str) and value == default


__all__ = ["DirectTracer"]
