"""The user-facing entry points: ``trace``, ``aot_function``, ``aot_module``."""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad.cache import CacheInfo, ambient_key, explain_miss
from aotgrad.capture import Body, JointGraph, TracerChoice, capture, capturing, check_tracer_choice
from aotgrad.capture.autocast import autocast_state
from aotgrad.capture.dynamic import all_dims, has_marks, marked_dims
from aotgrad.errors import CallError, user_frame_of_function
from aotgrad.lifting import NOTHING, Arguments, State
from aotgrad.partition import Budget, Partitioned, SavedValue, partition
from aotgrad.report import SeqTable, memory_report, seq_table
from aotgrad.runtime import CompiledGraphs, compile_partitioned
from aotgrad.runtime.boxing import Compiler
from aotgrad.signature import (
    FlatInputs,
    PlainTensorsGuard,
    Signature,
    alias_key,
    call_key,
    dynamic_call_key,
    flatten_inputs,
    leaf_names,
    register_dataclasses,
)

Decompositions = Mapping[Any, Callable[..., Any]]
PartitionFn = Callable[[JointGraph], Partitioned]
PartitionArg = Literal["save_all", "mincut"] | Budget | PartitionFn


@dataclass(frozen=True)
class Traced:
    """The forward and backward graphs of one call, with everything aotgrad decided.

    >>> import torch, aotgrad
    >>> def f(x, w):
    ...     return (x @ w).sin()
    >>> t = aotgrad.trace(f, torch.ones(2, 3), torch.ones(3, 4, requires_grad=True))
    >>> [str(d) for d in t.signature.forward_inputs]
    ['x', 'w']
    >>> [str(g) for g in t.signature.backward_outputs]
    ['None', 'grad of w']
    """

    partitioned: Partitioned
    # Runs the graphs (uncompiled) on real inputs of the same specialization.
    _compiled: CompiledGraphs
    _lifted: tuple[torch.Tensor, ...]
    # The autocast the graphs were captured under; calls must match it (Note [Autocast]).
    _autocast: tuple[tuple[str, torch.dtype], ...] = ()

    @property
    def joint(self) -> fx.GraphModule:
        """The joint graph: ``(*primals, *cotangents) -> (*outputs, ..., *grads)``."""
        return self.partitioned.joint.gm

    @property
    def forward(self) -> fx.GraphModule:
        return self.partitioned.forward

    @property
    def backward(self) -> fx.GraphModule | None:
        return self.partitioned.backward

    @property
    def signature(self) -> Signature:
        return self.partitioned.signature

    @property
    def saved(self) -> tuple[SavedValue, ...]:
        return self.partitioned.saved

    @property
    def tracer(self) -> str:
        """The tracer that made the graphs: ``"direct"`` or ``"full"`` (Note [Choosing a tracer]).

        >>> import torch, aotgrad
        >>> aotgrad.trace(lambda x: x.sin(), torch.ones(2)).tracer
        'direct'
        """
        return self.partitioned.joint.tracer.name

    @property
    def fallback_reason(self) -> str | None:
        """Why the full trace made the graphs; None when the direct trace did.

        >>> import torch, aotgrad
        >>> aotgrad.trace(lambda x: x.mul_(2), torch.ones(2)).fallback_reason
        'the direct trace stopped: aten.mul_.Tensor mutates a tensor (an in-place or out= op)'
        """
        return self.partitioned.joint.tracer.fallback_reason

    def compile(
        self,
        fw_compiler: Compiler | None = None,
        bw_compiler: Compiler | None = None,
        inference_compiler: Compiler | None = None,
    ) -> Traced:
        """The same graphs, handed to these compilers; call the result like this ``Traced``.

        >>> import torch, aotgrad
        >>> traced = aotgrad.trace(lambda x: x.cos(), torch.zeros(2))
        >>> traced.compile(aotgrad.compilers.nop)(torch.zeros(2))
        tensor([1., 1.])
        """
        compiled = compile_partitioned(
            self.partitioned, fw_compiler, bw_compiler, inference_compiler
        )
        return Traced(self.partitioned, compiled, self._lifted)

    def seq_table(self) -> SeqTable:
        """Every op of the joint graph with its forward op's number and module (data; prints as a table)."""
        return seq_table(self.joint)

    def memory_report(self, by_module: bool = False) -> str:
        """The saved values, largest first, with the total of unique storages."""
        return memory_report(self.saved, by_module=by_module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the traced graphs on new inputs of the same structure and metadata."""
        flat = self.partitioned.joint.inputs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != flat.spec:
            raise CallError(
                f"this Traced was captured for arguments structured as {flat.spec}, got {spec};"
                " call aotgrad.trace again (or use aotgrad.aot_function, which re-traces)"
            )
        for leaf, constant in zip(leaves, flat.constants, strict=True):
            if isinstance(constant, torch.nn.Module) and leaf is not constant:
                raise CallError(  # its state was lifted at capture (Note [Module arguments])
                    f"this Traced was captured with the module {type(constant).__name__} as an"
                    " argument and runs on that module's parameters and buffers; got another"
                    " module object. Call aotgrad.trace again (or use aotgrad.aot_function,"
                    " which re-traces for another module)"
                )
        if autocast_state() != self._autocast:
            raise CallError(
                f"this Traced was captured with autocast {_autocast_text(self._autocast)} and is"
                f" called with autocast {_autocast_text(autocast_state())}: its graphs hold the"
                " casts of the capture's autocast (Note [Autocast]); call aotgrad.trace again under"
                " the autocast you call it with (or use aotgrad.aot_function, which re-traces)"
            )
        tensors = [leaves[i] for i in flat.tensor_positions]
        return self._compiled([*self._lifted, *tensors])

    def __str__(self) -> str:
        parts = [str(self.signature), "# forward", self.forward.code.strip()]
        if self.backward is not None:
            parts += ["# backward", self.backward.code.strip()]
        return "\n\n".join(parts)


def trace(
    fn: Callable[..., Any],
    *args: Any,
    partition: PartitionArg = "save_all",
    dynamic: bool = False,
    tracer: TracerChoice = "auto",
    **kwargs: Any,
) -> Traced:
    """Capture the forward and backward graphs of ``fn(*args, **kwargs)`` on fake tensors.

    ``fn`` is a function or an ``nn.Module`` (its parameters and buffers become
    the first inputs). The example inputs' data is never read: they may live
    on any device, ``meta`` included. See ``docs/calling-convention.md``.
    ``partition`` ("save_all", "mincut", ``aotgrad.budget(x)`` or a callable
    taking the JointGraph) chooses what the backward saves; the keyword is
    aotgrad's, not passed on to ``fn``. ``dynamic=True`` (or dimensions marked with
    ``aotgrad.dynamic``) traces symbolic sizes (Note [Dynamic shapes]), also reserved,
    as is ``tracer`` ("auto", "direct" or "full": Note [Choosing a tracer]).

    >>> import torch, aotgrad
    >>> def fn(carry, x):
    ...     return torch.sin(carry["a"] @ x["w"])
    >>> carry = {"a": torch.ones(2, 3, device="meta", requires_grad=True)}
    >>> traced = aotgrad.trace(fn, carry, {"w": torch.ones(3, 3, device="meta")})
    >>> [str(d) for d in traced.signature.forward_outputs]
    ['output', 'saved: x_w', 'saved: mm']
    >>> [str(d) for d in traced.signature.backward_outputs]
    ["grad of carry['a']", 'None']
    """
    fn = _as_module(fn)
    lifting = State(fn)
    leaves, spec = _flatten_call(args, kwargs)
    lifted = lifting.read(_module_arguments(fn, args, kwargs, leaves, spec, {}))
    state = lifted.tensors
    flat, tensors = flatten_inputs(_signature_target(fn), args, kwargs, lifted.descriptors)
    dims = _dynamic_dims(tensors, dynamic)
    dynamic_dims = None if dims is None else {id(t): d for t, d in zip(tensors, dims, strict=True)}
    body = lifting.body(fn, lifted, flat)
    partitioned = _capture_and_partition(
        fn, body, flat, [*state, *tensors], None, partition, False, dynamic_dims, tracer=tracer
    )
    return Traced(partitioned, compile_partitioned(partitioned), state, autocast_state())


def _autocast_text(state: tuple[tuple[str, torch.dtype], ...]) -> str:
    return (
        ", ".join(f"{device}/{str(dtype).removeprefix('torch.')}" for device, dtype in state)
        or "off"
    )


def aot_function(
    fn: Callable[..., Any],
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    *,
    partition_fn: PartitionFn | None = None,
    decompositions: Decompositions | None = None,
    inference_compiler: Compiler | None = None,
    keep_inference_input_mutations: bool = False,
    partition: PartitionArg = "save_all",
    cache_limit: int = 8,
    dynamic: bool = False,
    tracer: TracerChoice = "auto",
) -> AOTFunction:
    """Compile ``fn``'s forward and backward graphs with the given compilers.

    Call-compatible with PyTorch's ``aot_function`` (functorch's compile module). Each new input
    structure or tensor metadata (shape, stride, dtype, device,
    requires_grad) or non-tensor value traces and compiles once; later
    calls with the same ones reuse it (``aotgrad.cache_info`` tells hits, misses and why);
    past ``cache_limit`` specializations, new ones run eagerly with a warning. ``partition`` (or ``partition_fn``)
    chooses what the backward saves, as for :func:`trace`. With ``keep_inference_input_mutations``,
    inference graphs (no backward) write input mutations themselves with
    ``aten.copy_`` instead of returning new values. ``tracer`` ("auto", "direct" or
    "full") chooses how capture traces (Note [Choosing a tracer]).

    >>> import torch, aotgrad
    >>> f = aotgrad.aot_function(lambda x: x.sin().sum())
    >>> x = torch.ones(3, requires_grad=True)
    >>> f(x).backward(); torch.allclose(x.grad, torch.ones(3).cos())
    True
    """
    options = Options(
        fw_compiler,
        bw_compiler,
        inference_compiler,
        partition_fn or partition,
        decompositions,
        keep_inference_input_mutations,
        cache_limit,
        dynamic,
        tracer=tracer,
    )
    return AOTFunction(fn, options)


@dataclass(frozen=True)
class Options:
    """How an ``AOTFunction`` compiles: the arguments of ``aot_function``, in one place."""

    fw_compiler: Compiler | None
    bw_compiler: Compiler | None
    inference_compiler: Compiler | None
    partition: Any
    decompositions: Decompositions | None
    keep_inference_input_mutations: bool
    cache_limit: int
    dynamic: bool = False
    # Which tracer captures (Note [Choosing a tracer]).
    tracer: TracerChoice = "auto"

    def __post_init__(self) -> None:
        check_tracer_choice(self.tracer)


# Note [The last entry]
# ~~~~~~~~~~~~~~~~~~~~~
# Most callers call with the same kinds of tensors every time. After a cache
# hit on a plain call -- positional tensors only, none a view or repeated,
# a function rather than a module, static shapes -- the entry is remembered
# with a guard on its tensors' fields (``PlainTensorsGuard``: Dynamo's C++
# tensor check plus offsets and aliasing), tried before building any key:
#
#     f(x, w)   miss: trace, compile, cache[key] = entry
#     f(x, w)   hit through the dict; entry remembered as the last one
#     f(x2, w)  same fields as the last entry's keys: run it (no key, no hash)
#     f(x3, w)  x3 is float64: the full key, the dict, maybe a miss
#
# It answers exactly when the full key would find that entry; it only skips
# the work of building and hashing the key (microseconds of a ~25 us call).
@dataclass(frozen=True)
class _LastEntry:
    guard: PlainTensorsGuard
    ambient: Any  # Note [Ambient state]
    call: Callable[[Sequence[torch.Tensor]], Any]


class AOTFunction:
    """``aot_function``'s result: call it like the function; one compiled graph pair per specialization.

    ``seq_table()``, ``memory_report()`` and ``partitioned`` describe the most
    recent specialization; ``cache`` holds them all.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: Options,
        input_names: Sequence[str] | None = None,
        read_environment: bool = True,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn = _as_module(fn)
        self._options = options
        # Names for the tensor inputs, when the caller knows better than fn's signature.
        self._input_names = input_names
        # Module state, closed-over tensors and guarded values (Note [Closed-over tensors]).
        # ``read_environment=False``: the caller (Dynamo) guards and lifts those itself.
        self._state = State(fn, read_environment)
        self._lifted = NOTHING
        # The call's module arguments (Note [Module arguments]), and leaf names by structure.
        self._arguments: Arguments = ()
        self._names: dict[Any, list[str]] = {}
        # key -> (compiled graphs, leaf positions of the graph's inputs after the module
        # state; None when the inputs are exactly the leaves)
        self.cache: dict[Any, tuple[CompiledGraphs, tuple[int, ...] | None]] = {}
        self.partitioned: Partitioned | None = None
        self.info = CacheInfo()
        self._last_key: tuple[Any, ...] | None = None
        self._is_module = isinstance(fn, torch.nn.Module)
        self._last_entry: _LastEntry | None = None
        self._warned_full = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if capturing():  # called by code being traced: trace through (Note [Capture sessions])
            return self._fn(*args, **kwargs)
        last = self._last_entry
        if last is not None and not kwargs and ambient_key() == last.ambient and last.guard(args):
            self.info.hits += 1
            return last.call(args)
        leaves, spec = _flatten_call(args, kwargs)
        dims = _dynamic_dims(leaves, self._options.dynamic)
        self._arguments = _module_arguments(self._fn, args, kwargs, leaves, spec, self._names)
        self._lifted = lifted = self._state.read(self._arguments)
        state = lifted.tensors
        key = (
            spec,
            call_key(leaves) if dims is None else dynamic_call_key(leaves, dims),
            lifted.key,
            alias_key([*state, *leaves] if state else leaves),
            ambient_key(),
        )
        entry = self.cache.get(key)
        if entry is not None and dims is None:
            self.info.hits += 1
            compiled, positions = entry
            if positions is None and key[3] is None and not kwargs and self._state.empty:
                call = compiled.direct_call() or compiled
                self._last_entry = _LastEntry(PlainTensorsGuard(leaves), key[4], call)
            return compiled(_graph_inputs(state, leaves, positions))
        return self._call_slow(key, entry, state, dims, args, kwargs, leaves)

    def _call_slow(
        self,
        key: tuple[Any, ...],
        entry: tuple[CompiledGraphs, tuple[int, ...] | None] | None,
        state: tuple[torch.Tensor, ...],
        dims: list[tuple[int, ...]] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: Sequence[Any],
    ) -> Any:
        """A miss, or a dynamic entry whose shape guards must be checked."""
        slot, failed = key, None
        if entry is not None:  # Note [Entries with shape guards]
            entry, slot, failed = self._guarded_entry(key, entry, state, leaves)
        if entry is None:
            if not self._miss(key, args, kwargs, failed):
                return self._fn(*args, **kwargs)
            extra = slot[
                len(key) :
            ]  # the n-th trace under one key (Note [Entries with shape guards])
            entry = self._specialize(state, args, kwargs, dims)
            settled = self._state.settle(self._lifted, self._arguments)
            key = self._last_key = (*key[:2], settled.key, *key[3:])
            self.cache[(*key, *extra)] = entry
            self.info.entries = len(self.cache)
        else:
            self.info.hits += 1
        compiled, positions = entry
        return compiled(_graph_inputs(state, leaves, positions))

    # Note [Entries with shape guards]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A dynamic trace serves the sizes its shape guards allow (Note [Dynamic
    # shapes]); calls outside them have the same key but need another trace.
    # Those traces sit under the key extended by a count, tried in order:
    #
    #     f(ones(2, 4))   key K: traced, guards y.size()[1] == 4  -> cache[K]
    #     f(ones(2, 6))   cache[K] fails y.size()[1] == 4; traced -> cache[(*K, 1)]
    #     f(ones(2, 4))   cache[K] passes: a hit
    def _guarded_entry(
        self,
        key: tuple[Any, ...],
        entry: tuple[CompiledGraphs, tuple[int, ...] | None] | None,
        state: tuple[torch.Tensor, ...],
        leaves: Sequence[Any],
    ) -> tuple[Any, tuple[Any, ...], str | None]:
        """The first entry under ``key`` whose guards pass; else None, a free slot, the failed guard."""
        slot, first_failed, count = key, None, 0
        while entry is not None:
            compiled, positions = entry
            failed = compiled.failed_guard(_graph_inputs(state, leaves, positions))
            if failed is None:
                return entry, slot, None
            first_failed = first_failed or failed
            count += 1
            slot = (*key, count)
            entry = self.cache.get(slot)
        return None, slot, f"shape guard {first_failed} failed"

    def _miss(
        self,
        key: tuple[Any, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str | None = None,
    ) -> bool:
        """Record the miss and its reason; False when the cache is full (run eagerly)."""
        if reason is None:
            names = leaf_names(_signature_target(self._fn), args, kwargs)
            reason = explain_miss(key, self._last_key, names)
        self.info.misses += 1
        self.info.reasons.append(reason)
        self._last_key = key
        limit = self._options.cache_limit
        if len(self.cache) < limit:
            return True
        self.info.fallbacks += 1
        if self._warned_full:
            return False
        self._warned_full = True
        warnings.warn(
            f"aotgrad: {getattr(self._fn, '__name__', type(self._fn).__name__)} has {limit}"
            f" compiled specializations (cache_limit); running this call eagerly. Last miss:"
            f" {reason}. Pass values that change between calls as tensors (a Python number is"
            " baked into the graph), or raise cache_limit. (Warned once; aotgrad.cache_info"
            " counts the eager calls.)",
            stacklevel=3,
        )
        return False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as the function and the options; compiled graphs are made again on use."""
        return (AOTFunction, (self._fn, self._options, self._input_names))

    def seq_table(self) -> SeqTable:
        return seq_table(self._last().joint.gm)

    def memory_report(self, by_module: bool = False) -> str:
        return memory_report(self._last().saved, by_module=by_module)

    def _last(self) -> Partitioned:
        if self.partitioned is None:
            raise CallError("no specialization yet: call the compiled function first")
        return self.partitioned

    def _specialize(
        self,
        state: tuple[torch.Tensor, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dims: list[tuple[int, ...]] | None = None,
    ) -> tuple[CompiledGraphs, tuple[int, ...] | None]:
        fn, options = self._fn, self._options
        lifted = self._lifted
        flat, tensors = flatten_inputs(_signature_target(fn), args, kwargs, lifted.descriptors)
        if self._input_names is not None:
            flat = flat.renamed(self._input_names)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        self.partitioned = _capture_and_partition(
            fn,
            self._state.body(fn, lifted, flat),
            flat,
            [*state, *tensors],
            options.decompositions,
            options.partition,
            options.keep_inference_input_mutations,
            None if dims is None else {id(leaves[i]): dims[i] for i in flat.tensor_positions},
            tracer=options.tracer,
        )
        compiled = compile_partitioned(
            self.partitioned, options.fw_compiler, options.bw_compiler, options.inference_compiler
        )
        positions = flat.tensor_positions
        if not state and positions == tuple(range(len(leaves))):
            return compiled, None
        return compiled, positions


def _graph_inputs(
    state: tuple[torch.Tensor, ...], leaves: Sequence[Any], positions: tuple[int, ...] | None
) -> Sequence[Any]:
    """The compiled graphs' inputs: module state, then the tensor leaves (all of them if None)."""
    return leaves if positions is None else [*state, *map(leaves.__getitem__, positions)]


def _dynamic_dims(leaves: Sequence[Any], everything: bool) -> list[tuple[int, ...]] | None:
    """Per leaf, its dynamic dimensions (Note [Dynamic shapes]); None when nothing is dynamic."""
    if not everything and not has_marks():
        return None
    dims = [
        (all_dims(leaf) if everything else marked_dims(leaf))
        if isinstance(leaf, torch.Tensor)
        else ()
        for leaf in leaves
    ]
    return dims if any(dims) else None


_SCALAR_TYPES = frozenset({int, float, bool, str, type(None)})


def _flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Sequence[Any], Any]:
    """The call's leaves and a hashable structure key; skips pytree for flat positional calls.

    A call of tensors and scalars only, without keywords, has leaves ``args``
    in the same order ``pytree`` would give; its structure key is the count.
    """
    if not kwargs and all(isinstance(a, torch.Tensor) or type(a) in _SCALAR_TYPES for a in args):
        return args, len(args)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if register_dataclasses(leaves):  # Note [Dataclass arguments]
        leaves, spec = pytree.tree_flatten((args, kwargs))
    return leaves, spec


def _module_arguments(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    spec: Any,
    names: dict[Any, list[str]],
) -> Arguments:
    """The modules among the call's leaves, by argument path (Note [Module arguments]).

    ``names`` caches the leaf names by call structure: they are found once per structure.
    """
    if isinstance(spec, int):  # a flat call of tensors and scalars (``_flatten_call``)
        return ()
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.nn.Module)]
    if not positions:
        return ()
    if spec not in names:
        names[spec] = leaf_names(_signature_target(fn), args, kwargs)
    return tuple((names[spec][i], leaves[i]) for i in positions)


class AOTModule(torch.nn.Module):
    """``aot_module``'s result: the original module, run through compiled graphs."""

    def __init__(self, module: torch.nn.Module, compiled: AOTFunction) -> None:
        super().__init__()
        self.orig_module = module
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    # Note [The wrapper runs no global hooks]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The wrapped module's hooks, and the global module hooks
    # (``nn.modules.module.register_module_forward_hook``), run inside the graphs,
    # where eager runs them: once per module call. Called as an ``nn.Module``,
    # the wrapper would run the global hooks a second time, on itself::
    #
    #     register_module_forward_hook(lambda m, args, out: out + 1)
    #     model(x)                -> hook on model: f(x) + 1
    #     aot_module(model)(x)    -> hook traced in: f(x) + 1, then on the wrapper: + 1 again
    #
    # So the wrapper is called without ``nn.Module``'s hook machinery unless the user
    # registered hooks on the wrapper itself; then the global hooks must be absent.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not any(getattr(self, name) for name in _HOOK_DICTS):
            return self.compiled(*args, **kwargs)
        if any(getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOK_DICTS):
            raise CallError(
                "hooks are registered both on the aot_module wrapper and globally"
                " (register_module_forward_hook ...): the global ones would run twice, on the"
                " wrapped module inside the graph and on the wrapper. Register the hooks on the"
                " wrapped module instead (they run inside the graph, as in eager)."
            )
        return super().__call__(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (and deep-copies) as the wrapped module plus options, compiled again on use."""
        return (_rebuild_aot_module, (self.orig_module, self.compiled._options))

    def seq_table(self) -> SeqTable:
        return self.compiled.seq_table()

    def memory_report(self, by_module: bool = False) -> str:
        return self.compiled.memory_report(by_module)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _HOOK_DICTS)


def _rebuild_aot_module(module: torch.nn.Module, options: Options) -> AOTModule:
    return AOTModule(module, AOTFunction(module, options))


def aot_module(
    module: torch.nn.Module,
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    *,
    partition_fn: PartitionFn | None = None,
    decompositions: Decompositions | None = None,
    inference_compiler: Compiler | None = None,
    keep_inference_input_mutations: bool = False,
    partition: PartitionArg = "save_all",
    cache_limit: int = 8,
    dynamic: bool = False,
    tracer: TracerChoice = "auto",
) -> AOTModule:
    """``aot_function`` for an ``nn.Module``: parameters and buffers become graph inputs.

    Inputs are named by qualified name (``Param("fc1.weight")``). Tied
    parameters (the same tensor under two names) are one input with one,
    summed, gradient.

    >>> import torch, aotgrad
    >>> model = aotgrad.aot_module(torch.nn.Linear(3, 2))
    >>> model(torch.ones(4, 3)).sum().backward()
    >>> model.orig_module.weight.grad.shape
    torch.Size([2, 3])
    """
    compiled = aot_function(
        module,
        fw_compiler,
        bw_compiler,
        partition_fn=partition_fn,
        decompositions=decompositions,
        inference_compiler=inference_compiler,
        keep_inference_input_mutations=keep_inference_input_mutations,
        partition=partition,
        cache_limit=cache_limit,
        dynamic=dynamic,
        tracer=tracer,
    )
    return AOTModule(module, compiled)


# Note [No garbage collection during capture]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A capture allocates some 10^5 short-lived Python objects (fake tensors, fx
# nodes, dispatch keys), and CPython's collector runs a generation-2 pass, which
# walks every object in the process (torch alone brings ~10^6), each time enough
# survivors pile up. On the first capture of gpt4 that was 2 full passes and
# ~200 young ones: 0.39 s of a 2.8 s capture, for garbage that is mostly freed
# by reference counting anyway. The collector is paused while one capture runs
# and resumed as it was; cycles made meanwhile are collected by its next pass.
# (``torch.distributed.checkpoint`` does the same around its state-dict walks.)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for one capture (Note [No garbage collection during capture])."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@_collector_paused()
def _capture_and_partition(
    fn: Callable[..., Any],
    body: Body,
    flat: FlatInputs,
    primals: list[torch.Tensor],
    decompositions: Decompositions | None,
    strategy: Any,
    keep_input_mutations: bool = False,
    dynamic_dims: Mapping[int, Sequence[int]] | None = None,
    *,
    tracer: TracerChoice = "auto",
) -> Partitioned:
    # Under no_grad too: an enable_grad() region inside the function makes outputs that
    # require grad (Note [Grad mode regions]); the trace tells, from the outputs.
    with_backward = any(p.requires_grad for p in primals)
    joint = capture(
        body,
        flat,
        primals,
        with_backward=with_backward,
        decompositions=decompositions,
        where=user_frame_of_function(fn),
        root=fn,
        dynamic_dims=dynamic_dims,
        tracer=tracer,
    )
    return partition(joint, strategy, keep_input_mutations=keep_input_mutations)


def _as_module(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``model.forward`` (a bound method) is traced as ``model``: its state becomes inputs."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") == "forward":
        return owner
    return fn


def _signature_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn.forward if isinstance(fn, torch.nn.Module) else fn
