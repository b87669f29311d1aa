"""Record provenance while the trace runs; stamp it onto the graph afterwards.

See Note [Sequence numbers] and Note [Module paths and source lines] in
``capture/provenance.py``. During the trace, facts ride on ``torch.fx.traceback``'s
node metadata (``seq_nr``, and our keys under ``custom``); :func:`stamp`
turns them into one typed :class:`NodeInfo` per node.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from aotgrad._torch_compat import (
    SHALLOW_COPY_DATA,
    FunctionalTensor,
    FunctionalTensorMode,
    autograd_node_number,
    disable_current_modes,
    from_functional_tensor,
    sync,
)
from aotgrad.capture.analyses.backward_state import BackwardSite
from aotgrad.capture.analyses.collectives import refuse_in_place_collective
from aotgrad.capture.analyses.mutation import (
    check_no_partial_overlap,
    check_writable,
    resize_keeps_layout,
)
from aotgrad.capture.analyses.random import FILL_RANDOM, MANUAL_SEED, strided_fill
from aotgrad.capture.analyses.set_storage import SET_OPS, StorageSets, data_assigned
from aotgrad.capture.provenance import META_KEY, Kind, NodeInfo, Phase, set_info
from aotgrad.capture.tracing.rng import restores_checked_by, step_seed
from aotgrad.capture.user_state import closed_over
from aotgrad.capture.user_state.host_checks import HostChecks
from aotgrad.errors import (
    Origin,
    UnsupportedOpError,
    UserFrame,
    format_error,
    frame_origin,
    user_frame_from_stack,
)
from aotgrad.ops.table import draws_random, is_error_check

aten = torch.ops.aten

_MODULE = MODULE_KEY = "aotgrad_module"
_SOURCE = SOURCE_KEY = "aotgrad_source"
SOURCE_FIXED_KEY = "aotgrad_source_fixed"
_IN_NODE = "aotgrad_in_node"
_RECOMPUTE = "aotgrad_recompute"
_RNG = "aotgrad_rng"
# Where a random op sits in the CPU generator's stream (Note [Recomputed random ops]).
RNG_POSITION_KEY = "aotgrad_rng_position"

# aotgrad's files that only pass the user's call on, walked past like torch's (Note [User
# frames]): the recording machinery itself (this file, the direct tracer and its replays of views)
# and the closed-over swap.
_FORWARDING_FILES = (
    __file__,
    os.path.join(os.path.dirname(__file__), "fast", "direct.py"),
    os.path.join(os.path.dirname(__file__), "fast", "view_writes.py"),
    closed_over.__file__,
)


def _user_frame() -> tuple[str, int, str] | None:
    """The innermost user frame calling into torch, or None if aotgrad itself is the caller."""
    frame = sys._getframe(3)
    while frame is not None:
        filename = frame.f_code.co_filename
        origin = frame_origin(filename)
        if origin is Origin.USER:
            return filename, frame.f_lineno, frame.f_code.co_name
        if origin is Origin.AOTGRAD and filename not in _FORWARDING_FILES:
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class ProvenanceMode(FunctionalTensorMode):
    """Functionalization that also notes, for every op, the user's line that issued it.

    Functionalization already sees every aten op in Python; noting the line
    there costs a frame walk per op and adds no dispatch layer.
    """

    def __init__(self, recorder: Recorder, *, note_real_leaves: bool = False) -> None:
        super().__init__()
        self.recorder = recorder
        self.note_real_leaves = note_real_leaves
        self.storage_sets = StorageSets()  # Note [set_() on an input]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        refuse_in_place_collective(func)  # Note [Collectives]
        self.recorder.note_source()
        if func is MANUAL_SEED:
            self.recorder.check_reseed()  # Note [Reseeding inside the function]
        answer = self.recorder.host_checks.answer(  # Note [Host checks]
            func,
            args,
            lambda op, *a, **k: super(ProvenanceMode, self).__torch_dispatch__(op, types, a, k),
        )
        if answer is not None:
            return answer
        schema = getattr(func, "_schema", None)
        if resize_keeps_layout(func, args, kwargs or {}):  # Note [resize_() to the same size]
            return args[0]
        if func is SHALLOW_COPY_DATA:  # torch >= 2.14's Dynamo writes ``t.data = x`` so
            with data_assigned(args[0]):
                return self.__torch_dispatch__(aten.set_.source_Tensor, types, args[:2], {})
        if func in SET_OPS:  # Note [set_() on an input]
            # A module's real parameter reaches dispatch as itself (Note [Real tensors in a trace])
            self.storage_sets.note_real_target(args[0])
            args, kwargs = closed_over.swapped_arguments(func, args, kwargs or {})
            self.recorder.note_mutation(args[0])
            return self.storage_sets.set_(
                func,
                args,
                kwargs,
                lambda op, *a, **k: super(ProvenanceMode, self).__torch_dispatch__(op, types, a, k),
            )
        if schema is not None and schema.is_mutable and args:
            self.recorder.note_mutation(args[0])
            # Notes [Writes through overlapping views], [Writes that read overlapping memory]
            check_writable(func, args, kwargs or {}, self.recorder.mutation_sites.get(id(args[0])))
            check_no_partial_overlap(func, args, kwargs or {})
        self.recorder.note_random(func, args, kwargs)
        if self.note_real_leaves:
            self.recorder.note_real_leaves(args, kwargs)
        if is_error_check(func):
            return _record_error_check(func, args, kwargs)
        fill = strided_fill(func, args, kwargs)
        if fill is not None:  # Note [Random fills keep their layout]
            value = super().__torch_dispatch__(FILL_RANDOM, types, (args[0], *fill), {})
            return super().__torch_dispatch__(aten.copy_.default, types, (args[0], value), {})
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.recorder.host_checks.note(func, out)
        return out


def _record_error_check(func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    """Record an error check (``aten._linalg_check_errors``) as a plain call, no effect token.

    It returns nothing and reads only its inputs: on the functional tensors'
    current values it is a pure check, recorded where it ran, as the direct
    trace records it; at run time it raises eager's error on bad input.
    """

    def unwrap(t: FunctionalTensor) -> torch.Tensor:
        sync(t)
        return from_functional_tensor(t.elem)

    args, kwargs = pytree.tree_map_only(FunctionalTensor, unwrap, (args, kwargs or {}))
    return func(*args, **kwargs)


class Recorder:
    """Collects provenance during one trace."""

    def __init__(self, root: Any, module_paths: Mapping[int, str] | None = None) -> None:
        self.root_name = getattr(root, "__name__", type(root).__name__)  # a function's name
        # Module paths by id (Note [Module paths as the signature names them]).
        self.module_names: Mapping[int, str] = module_paths or {}
        if isinstance(root, torch.nn.Module):
            self.root_name = type(root).__name__
            if module_paths is None:
                self.module_names = {id(m): n for n, m in root.named_modules()}
        self.module_stack: list[AbstractContextManager[None]] = []
        self.node_contexts: list[AbstractContextManager[None]] = []
        self.in_backward = False
        # Per tensor (by id), the user's line of the first in-place op on it: errors about
        # a mutated input point there, not at the function's ``def``.
        self.mutation_sites: dict[int, UserFrame | None] = {}
        # Per tensor (by id), what changed it in place first in the backward (Note [State
        # updated by the backward]); and the autograd nodes running, innermost last.
        self.backward_sites: dict[int, BackwardSite] = {}
        self.running_nodes: list[Any] = []
        # Sequence numbers of the autograd nodes the backward runs (Note [In-place ops' numbers]).
        self.live_numbers: list[int] = []
        # Real tensors requiring grad that ops read (closed over, not inputs), by id.
        self.real_leaves: dict[int, torch.Tensor] = {}
        # Random ops the forward has drawn so far, and whether it reseeded (Note [Reseeding
        # inside the function]).
        self.random_draws = 0
        self.reseeded = False
        self.host_checks = HostChecks()  # Note [Host checks]

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around the whole trace: node metadata on, module hooks in."""
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(self._exit_module)
        try:
            with (
                restores_checked_by(self.check_rng_restore),
                fx_traceback.preserve_node_meta(),
                fx_traceback.annotate({_MODULE: self.root_name}),
            ):
                try:
                    yield
                finally:
                    self._close_open_contexts()
        finally:
            pre.remove()
            post.remove()

    def _close_open_contexts(self) -> None:
        """Close what a trace that stopped mid-way left open, innermost first.

        (A failed direct trace, Note [Direct tracing], or the user's own error.)
        Left open, an annotation context would write its stale metadata into the
        global node context whenever the collector finalizes it, long after the
        trace; closed here, inside ``preserve_node_meta``, its writes are undone.
        """
        for stack in (self.node_contexts, self.module_stack):
            while stack:
                stack.pop().__exit__(None, None, None)

    def note_source(self) -> None:
        """Stamp the op being dispatched with the user's line (and whether it is recomputed)."""
        custom = fx_traceback.current_meta.get("custom")
        if custom is None or custom.get(SOURCE_FIXED_KEY):
            return  # no node context; or a frontend that knows better (Dynamo's backend) set it
        where = _user_frame()
        custom[_SOURCE] = where
        # Forward code re-run by the backward (a checkpointed region): user code, grad mode on.
        custom[_RECOMPUTE] = self.in_backward and where is not None and torch.is_grad_enabled()

    def note_mutation(self, target: object) -> None:
        """Remember the user's line of the first in-place op on ``target`` (and, in the
        backward, what ran it)."""
        if id(target) not in self.mutation_sites:
            where = _user_frame()
            self.mutation_sites[id(target)] = None if where is None else _as_user_frame(where)
        if self.in_backward and id(target) not in self.backward_sites:
            where = _user_frame()
            node = self.running_nodes[-1] if self.running_nodes else None
            self.backward_sites[id(target)] = BackwardSite.of(
                node, None if where is None else _as_user_frame(where)
            )

    def note_random(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> None:
        """Stamp a random op with its place in the generator's stream, and move the stream on
        (fake ops draw nothing: Note [Recomputed random ops]; ``rng.generator_restored``)."""
        drawing = draws_random(func, args, kwargs or {})
        if drawing and not self.in_backward:
            self.random_draws += 1  # Note [Reseeding inside the function]
        custom = fx_traceback.current_meta.get("custom")
        if custom is None:
            return
        if not drawing:
            custom.pop(_RNG, None)
            return
        generator = torch.default_generator
        with disable_current_modes():
            position = hash(generator.get_state().numpy().tobytes())
        custom[_RNG] = position
        step_seed(generator, position & 0xFFFF_FFFF_FFFF)

    def check_reseed(self) -> None:
        """Refuse a reseed that one op at its place in the forward cannot replay (Note
        [Reseeding inside the function])."""
        why = None
        if self.in_backward:
            why = (
                "inside a checkpointed region, which the backward runs again: the"
                " recompute would reseed in the middle of the backward"
            )
        elif self.random_draws:
            why = (
                f"after {self.random_draws} random op(s) of the function: their numbers come"
                " from the caller's stream, the later ones from the seed; only a reseed before"
                " every random op can be replayed at each call"
            )
        if why is not None:
            raise UnsupportedOpError(
                format_error(
                    f"the function reseeds torch's random generator (torch.manual_seed) {why}",
                    user_frame_from_stack(),
                    "Reseed at the start of the function (before its first random op), seed"
                    " before calling the compiled function, or pass a torch.Generator made"
                    " outside the function to the random ops.",
                )
            )
        self.reseeded = True

    def check_rng_restore(self) -> None:
        """Refuse ``torch.set_rng_state`` in a forward that reseeded (``fork_rng``'s exit)."""
        if not self.reseeded or self.in_backward:
            return
        raise UnsupportedOpError(
            format_error(
                "the function sets torch's random generator state (torch.set_rng_state, or"
                " torch.random.fork_rng restoring it) after reseeding it: the reseed runs at"
                " every call, but restoring a state read at capture would not",
                user_frame_from_stack(),
                "Reseed outside torch.random.fork_rng, or seed before calling the compiled"
                " function.",
            )
        )

    def note_real_leaves(self, args: tuple[Any, ...], kwargs: Any) -> None:
        """Remember real tensors that require grad among an op's arguments."""
        for value in pytree.tree_leaves((args, kwargs)):
            if (
                type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)
            ) and value.requires_grad:
                self.real_leaves.setdefault(id(value), value)

    def backward_hooks(self, targets: Sequence[torch.Tensor]) -> None:
        """Hook every autograd node behind ``targets`` (Note [Sequence numbers])."""
        self.in_backward = True
        nodes = autograd_nodes(targets)
        self.live_numbers = sorted(autograd_node_number(node) for node in nodes)
        for node in nodes:
            node.register_prehook(functools.partial(self._enter_node, node))
            node.register_hook(self._exit_node)

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        # Not another thread's module call (Note [Captures and other threads]).
        if not closed_over.in_capture():
            return
        name = self.module_names.get(id(module), type(module).__name__)
        context = fx_traceback.annotate({_MODULE: name or self.root_name})
        context.__enter__()
        self.module_stack.append(context)

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.module_stack and closed_over.in_capture():
            self.module_stack.pop().__exit__(None, None, None)

    def _enter_node(self, node: Any, grad_outputs: Any) -> None:
        fx_traceback.set_grad_fn_seq_nr(autograd_node_number(node))
        context = fx_traceback.annotate({_IN_NODE: True})
        context.__enter__()
        self.node_contexts.append(context)
        self.running_nodes.append(node)

    def _exit_node(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.node_contexts.pop().__exit__(None, None, None)
        if self.running_nodes:
            self.running_nodes.pop()
        fx_traceback.reset_grad_fn_seq_nr()


def autograd_nodes(targets: Sequence[torch.Tensor]) -> list[Any]:
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in targets if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(seen.values())


def stamp(gm: fx.GraphModule, recorder: Recorder) -> None:
    """Replace the raw metadata by one :class:`NodeInfo` per node (phases already set)."""
    ranks: dict[int, int] = {}
    first_forward: dict[int, fx.Node] = {}
    infos: dict[fx.Node, NodeInfo] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        info: NodeInfo = node.meta[META_KEY]
        custom = node.meta.get("custom", {})
        raw = node.meta.get("seq_nr")
        if node.op == "placeholder":
            infos[node] = replace(info, kind=Kind.INPUT, module=recorder.root_name)
        elif info.phase is Phase.FORWARD:
            seq = ranks.setdefault(raw, len(ranks)) if raw is not None else None
            if seq is not None:
                first_forward.setdefault(seq, node)
            infos[node] = replace(
                info,
                seq_nr=seq,
                module=custom.get(_MODULE, recorder.root_name),
                source=_frame(custom),
            )
        elif custom.get(_RECOMPUTE):
            infos[node] = replace(
                info,
                phase=Phase.RECOMPUTE,
                kind=Kind.RECOMPUTE,
                seq_nr=ranks.get(raw),
                module=custom.get(_MODULE, recorder.root_name),
                source=_frame(custom),
            )
        elif custom.get(_IN_NODE):
            seq = _rank_of_node(raw, ranks, recorder.live_numbers)
            origin = first_forward.get(seq) if seq is not None else None
            origin_info = infos[origin] if origin is not None else info
            infos[node] = replace(
                info,
                seq_nr=seq,
                module=origin_info.module or recorder.root_name,
                source=origin_info.source,
            )
        else:
            infos[node] = replace(info, kind=Kind.ACCUMULATE, module=recorder.root_name)
    _attribute_accumulations(infos)
    for node, info in infos.items():
        set_info(node, info)
        custom = node.meta.pop("custom", {})
        if _RNG in custom:
            node.meta[RNG_POSITION_KEY] = custom[_RNG]


# Note [In-place ops' numbers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward op records the number of the last autograd node *created*, which
# is not always a node the backward runs. An in-place op whose derivative
# needs the old value (``F.silu(x, inplace=True)``, ``Hardswish(inplace=True)``)
# gets its node, then autograd clones ``x`` and creates (and drops) a node
# for the clone::
#
#     node 6  SiluBackward0        (runs in the backward)
#     node 7  CloneBackward0       (dropped)
#     forward:  clone  seq 7,  silu  seq 7
#     backward: silu_backward under node 6: no forward op has 6
#
# A backward op under node N belongs to the forward ops recorded next after N
# (the smallest number r >= N some forward op has), provided no node the
# backward runs lies in (N, r]: those forward ops ran while N was the newest
# live node.


def _rank_of_node(raw: int | None, ranks: dict[int, int], live: Sequence[int]) -> int | None:
    """The rank of the forward ops autograd node ``raw`` differentiates (Note [In-place ops' numbers])."""
    if raw is None or raw in ranks:
        return ranks.get(raw) if raw is not None else None
    later = [r for r in ranks if r > raw]
    if not later:
        return None
    first = min(later)
    at = bisect.bisect_right(live, raw)
    if at < len(live) and live[at] <= first:
        return None  # another live node came first: those ops are its
    return ranks[first]


def _attribute_accumulations(infos: dict[fx.Node, NodeInfo]) -> None:
    """A gradient sum belongs where the summed gradient goes: the producer's backward.

    ``y = x + x`` sends two gradients to ``x``; their sum feeds the backward of
    the op that produced ``x``, so the sum takes that op's module and line (it
    keeps ``kind=accumulate`` and no sequence number). Walked in reverse so
    chains of sums inherit from their last user.
    """
    for node in reversed(list(infos)):
        info = infos[node]
        if info.kind is not Kind.ACCUMULATE:
            continue
        # Its consumer's op; else (a gradient returned as is) the op producing a summand.
        for neighbour in (*node.users, *node.all_input_nodes):
            owner = infos.get(neighbour)
            if owner is not None and owner.source is not None:
                infos[node] = replace(info, module=owner.module, source=owner.source)
                break


def _frame(custom: dict[str, Any]) -> UserFrame | None:
    where = custom.get(_SOURCE)
    return None if where is None else _as_user_frame(where)


def _as_user_frame(where: tuple[str, int, str]) -> UserFrame:
    filename, lineno, name = where
    return UserFrame(filename, lineno, name, linecache.getline(filename, lineno).strip())


__all__ = ["Callable", "Recorder", "autograd_nodes", "stamp"]
