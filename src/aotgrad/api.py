"""The user-facing entry points: ``trace``, ``aot_function``, ``aot_module``, ``load``."""

from __future__ import annotations

import functools
import os
import pathlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotgrad._torch_compat import MODULE_HOOKS, functorch_transforms_active, global_module_hooks
from aotgrad.cache import CacheInfo, Entry, KeyedCall, Miss, SpecializationCache, keyed_call
from aotgrad.cache.traced import Capture, Specialization, capture_of, refuse_other_tensors
from aotgrad.capture.analyses.autocast import autocast_state
from aotgrad.capture.analyses.dynamic import DynamicDims, requested_dims
from aotgrad.capture.analyses.input_aliases import memory_sharing
from aotgrad.capture.tracing.session import capturing
from aotgrad.capture.tracing.tracers import TracerChoice
from aotgrad.capture.user_state.side_effects import Replay, Watch
from aotgrad.errors import CallError, CaptureError, StoreError
from aotgrad.partition import Partitioned
from aotgrad.pipeline import (
    Traceable,
    capture_and_partition,
    compile_stage,
    differentiable_backward_driver,
    run,
    signature_stage,
    watch_of,
)
from aotgrad.report import SeqTable, memory_report, peak_report, seq_table
from aotgrad.report.html import render_html
from aotgrad.runtime import CompiledGraphs
from aotgrad.runtime.boxing import Compiler
from aotgrad.runtime.transforms import (
    dual_positions,
    has_tangent,
    join_duals,
    jvp_body,
    split_duals,
    transform_active,
)
from aotgrad.settings import (
    Decompositions,
    Options,
    PartitionArg,
    PartitionFn,
    options_of,
    with_option_keywords,
)
from aotgrad.signature import leaf_names
from aotgrad.signature.lifting import (
    Arguments,
    Lifted,
    State,
    as_module,
    call_target,
)
from aotgrad.store.disk import read_regular_file
from aotgrad.store.format import loads
from aotgrad.store.loaded import Loaded, TraceView, save_traced
from aotgrad.store.persist import DiskCacheUse, HitCall
from aotgrad.wrappers import Wrapping, refuse_reached_wrappers, wrapping_of

if TYPE_CHECKING:
    from aotgrad.export import ExportedGraphs


class _Reports:
    """The reports of a trace, or of a compiled function's last specialization (after its
    first call: a ``CallError`` before)."""

    def _reported(self) -> Partitioned:
        raise NotImplementedError

    def _lifted_for_export(self, partitioned: Partitioned) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def export(
        self,
        joint: bool = False,
        flat: bool = False,
        decompositions: Decompositions | str | None = None,
        random: str | None = None,
    ) -> ExportedGraphs:
        """The forward and backward graphs as ``torch.export.ExportedProgram`` s, named in
        ``torch.export``'s vocabulary (Note [Export signatures]; docs/export.md); with
        ``joint``, the joint graph as a third; with ``flat``, every program a pure function
        of tensors (parameters and buffers passed in, mutations and gradients returned: the
        form ONNX and IREE compile, docs/backends.md); with ``decompositions``
        (``"core_aten"`` or a dict from op to function), every program decomposed with that
        table, whatever the trace was captured with (Note [Decomposing a captured graph]);
        with ``random="inputs"`` (the default for flat programs and Core ATen), each random
        draw of the forward an input that ``ExportedGraphs.draw()`` makes with torch, as
        eager draws it (``"ops"``: random ops kept; Note [Random draws as inputs]).

        >>> import torch, aotgrad
        >>> t = aotgrad.trace(torch.nn.Linear(2, 3), torch.ones(1, 2))
        >>> programs = t.export()
        >>> [s.target for s in programs.forward.graph_signature.input_specs]
        ['weight', 'bias', None]
        >>> [s.target for s in programs.backward.graph_signature.output_specs]
        ['weight', 'bias']
        >>> flat = t.export(flat=True)
        >>> [str(d) for d in flat.forward_inputs], len(flat.lifted)
        (['param weight', 'param bias', 'input'], 2)
        >>> [s.kind.name for s in flat.backward.graph_signature.output_specs]
        ['USER_OUTPUT', 'USER_OUTPUT']
        >>> t = aotgrad.trace(torch.nn.SiLU(), torch.ones(2, requires_grad=True))
        >>> core = t.export(decompositions="core_aten")
        >>> [n.name for n in core.forward.graph.nodes if n.op == "call_function"]
        ['sigmoid', 'mul']
        """
        from aotgrad.export import export_graphs  # torch.export loads with the feature

        partitioned = self._reported()
        lifted = self._lifted_for_export(partitioned)
        return export_graphs(
            partitioned,
            lifted,
            joint=joint,
            flat=flat,
            decompositions=decompositions,
            random=random,
        )

    def seq_table(self) -> SeqTable:
        """Every op of the joint graph with its forward op's number and module (data; prints as a table)."""
        return seq_table(self._reported().joint.gm)

    def memory_report(self, by_module: bool = False) -> str:
        """The saved values, largest first, with the total of unique storages; then the
        predicted peak of a step ``f(*inputs).backward()``: its bytes, where in the step it
        occurs (graph, op, module, source line) and what is live then, largest first.

        >>> import torch, aotgrad
        >>> t = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(1000, requires_grad=True))
        >>> saved, peak = t.memory_report().split("\\n\\n")
        >>> saved.splitlines()[-1]
        'total: 3.9 KiB in 1 storage(s) (0 B beyond the inputs)'
        >>> peak.splitlines()[0]
        'peak of a step (forward, then .backward(), every .grad None): 11.7 KiB (12008 B)'
        """
        partitioned = self._reported()
        saved = memory_report(partitioned.saved, by_module=by_module)
        return f"{saved}\n\n{peak_report(partitioned)}"

    def to_html(self, path: str | os.PathLike[str], profile: Any = None) -> None:
        """Write the graphs, saved values and calling convention as one self-contained HTML page.

        >>> import torch, aotgrad, tempfile, pathlib
        >>> t = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "report.html"
        >>> t.to_html(out)
        >>> out.read_text().startswith("<!DOCTYPE html>")
        True
        >>> f = aotgrad.aot_function(lambda x: x.cos())
        >>> _ = f(torch.ones(2, requires_grad=True))
        >>> f.to_html(out)
        >>> "cos" in out.read_text()
        True
        >>> m = aotgrad.aot_module(torch.nn.Linear(2, 3))
        >>> _ = m(torch.ones(1, 2))
        >>> m.to_html(out)
        >>> "addmm" in out.read_text()
        True
        """
        pathlib.Path(path).write_text(render_html(self._reported(), profile), encoding="utf-8")


@dataclass(frozen=True, kw_only=True)
class Traced(TraceView, _Reports):
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
    # A DDP or FSDP2 wrapper run around every call (Note [Wrappers run around the graphs]).
    _wrapping: Wrapping | None = None
    # The call it was captured for, which every call must keep to (Note [A Traced keeps to
    # its capture]); None for a scan body's graphs, which only the scan runs.
    _capture: Capture | None = None
    # The traced function, run under torch.func transforms and forward-mode AD, and how
    # many calls ran it (Note [Transforms run the function]).
    _fn: Callable[..., Any] | None = None
    _transform_runs: list[int] = field(default_factory=lambda: [0])
    # The stores in the user's objects done at every call (Note [Side effects replayed]).
    _replay: Replay | None = None
    # The options it was traced with (a create_graph backward captures under them too).
    _options: Options = field(default_factory=Options)
    # The capture's one entry and the check of each call against it; made from the fields
    # above, again by ``compile``'s ``replace``.
    _specialization: Specialization | None = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        if self._capture is None:
            return
        entry = Entry.of(
            self._compiled,
            self.partitioned.joint.inputs,
            lifted=bool(self._lifted),
            replay=self._replay,  # Note [Side effects replayed]
            environ=self.partitioned.joint.environ,  # Note [Environment read at capture]
        )
        owner = getattr(self._capture.target, "__name__", "the traced function")
        special = Specialization(self._capture, entry, owner)
        object.__setattr__(self, "_specialization", special)

    @property
    def transform_runs(self) -> int:
        """Calls that ran the function itself under a transform (Note [Transforms run the function]).

        >>> import torch, aotgrad
        >>> traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2))
        >>> torch.func.grad(lambda x: traced(x).sum())(torch.zeros(2)).tolist()
        [1.0, 1.0]
        >>> traced.transform_runs
        1
        """
        return self._transform_runs[0]

    @property
    def info(self) -> CacheInfo:
        """What ``aotgrad.cache_info`` says of a trace: one specialization, captured once, and
        no cache (a call runs it; ``aot_function`` traces again for other inputs).

        >>> import torch, aotgrad
        >>> info = aotgrad.cache_info(aotgrad.trace(lambda x: x.sin(), torch.ones(2)))
        >>> info.misses, info.entries, info.reasons
        (1, 1, ['captured by aotgrad.trace: one specialization, no cache'])
        """
        return CacheInfo(
            misses=1,
            entries=1,
            reasons=["captured by aotgrad.trace: one specialization, no cache"],
            transform_runs=self.transform_runs,
            disk_skipped="aotgrad.trace keeps no disk cache (Traced.save writes a file)",
        )

    @property
    def joint(self) -> fx.GraphModule:
        """The joint graph: ``(*primals, *cotangents) -> (*outputs, ..., *grads)``."""
        return self.partitioned.joint.gm

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
        >>> aotgrad.trace(lambda x: x.split(1)[0].mul_(2), torch.ones(2)).fallback_reason
        'the direct trace stopped: aten.mul_.Tensor: a write through a view made by aten.split.Tensor (no scatter for it)'
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
        options = replace(
            self._options,
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            inference_compiler=inference_compiler,
        )
        return replace(self, _compiled=compile_stage(self.partitioned, options))

    def _trace(self) -> Partitioned:
        return self.partitioned

    def _reported(self) -> Partitioned:
        return self.partitioned

    def _lifted_for_export(self, partitioned: Partitioned) -> tuple[torch.Tensor, ...]:
        return self._lifted_now()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graphs, signature, provenance and saved plan to ``path``, for :func:`aotgrad.load`.

        The file is checked JSON that runs no code when read (Note [Files run no code]);
        a module's parameters and buffers are not in it (Note [Loaded module state]).

        >>> import torch, aotgrad, tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "sin.aotgrad"
        >>> aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True)).save(path)
        >>> aotgrad.load(path)(torch.zeros(2, requires_grad=True)).tolist()
        [0.0, 0.0]
        """
        if self._wrapping is not None:
            raise StoreError("a trace of a DDP or fully_shard module cannot be saved")
        if self._replay is not None:
            stores = ", ".join(str(d) for d in self._replay.descriptors)
            raise StoreError(
                f"this trace stores tensors in the user's objects at every call ({stores}:"
                " Note [Side effects replayed]); a file cannot hold those objects. Return the"
                " tensors from the function instead to save it"
            )
        environ = self.partitioned.joint.environ
        if environ is not None:  # Note [Environment read at capture]
            raise StoreError(
                f"the function read {environ.what} at capture, and"
                " its graphs hold what it read; a file cannot tell its reader which environment"
                " they assume. Pass the setting as an argument (or read it outside the"
                " function) to save the trace"
            )
        if self._capture is None:
            raise StoreError(
                "a scan body's graphs cannot be saved alone; trace the body function to save it"
            )
        save_traced(
            path,
            partitioned=self.partitioned,
            plan=self._compiled.plan,
            autocast=self._autocast,
            layout=self._capture.layout,
            state=self._capture.key.state,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the traced graphs on new inputs of the capture's specialization: a call whose
        shapes, dtypes, flags or values differ is a ``CallError`` (Note [A Traced keeps to
        its capture]).

        >>> import torch, aotgrad
        >>> t = aotgrad.trace(lambda x: x.sum(0), torch.ones(3, 4))
        >>> t(torch.zeros(3, 4)).tolist()
        [0.0, 0.0, 0.0, 0.0]
        >>> t(torch.ones(5, 4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        aotgrad.errors.CallError: this call differs from the one this Traced was captured for: input x: shape (3, 4) != (5, 4) (captured float32[3, 4], got float32[5, 4]). ...
        """
        if self._fn is not None and transform_active():  # Note [Transforms run the function]
            self._transform_runs[0] += 1
            return self._fn(*args, **kwargs)
        if self._wrapping is not None:
            if capturing():
                raise CallError(
                    "a Traced of a DDP or fully_shard module was called by code aotgrad is"
                    " capturing: the wrapper's hooks cannot run inside a graph (see Note"
                    " [Wrappers run around the graphs]). Compile the outer function without"
                    " it, or trace only the wrapped model."
                )
            return self._wrapping.call(self._run, args, kwargs)
        return self._run(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is not None and self._wrapping is None and capturing():
            return self._fn(*args, **kwargs)  # called by code being traced: traced through
        special = self._specialization
        if special is None:
            raise CallError(
                "this Traced holds a scan body's graphs, which the scan runs once per step;"
                " call the scan, or aotgrad.trace the body function to run it alone"
            )
        if not kwargs:
            fast = special.fast(args)  # Note [The last entry]
            if fast is not None:
                return fast(args)
        call = special.find(args, kwargs)
        tensors = call.lifted.tensors
        if self._wrapping is not None:  # Note [Wrappers run around the graphs]
            refuse_other_tensors(tensors, self._lifted)
        special.remember(call, kwargs)
        return call.entry(tensors, call.leaves)

    def _lifted_now(self) -> tuple[torch.Tensor, ...]:
        """The lifted tensors: a wrapper's module state must still be the traced tensors."""
        if self._wrapping is None or self._capture is None:
            return self._lifted
        refuse_other_tensors(self._capture.state.read().tensors, self._lifted)
        return self._lifted


def trace(
    fn: Callable[..., Any],
    *args: Any,
    partition: PartitionArg = "save_all",
    dynamic: bool = False,
    tracer: TracerChoice = "auto",
    fast: bool | None = None,
    check: bool | None = None,
    decompositions: Decompositions | str | None = None,
    **kwargs: Any,
) -> Traced:
    """Capture the forward and backward graphs of ``fn(*args, **kwargs)`` on fake tensors.

    ``fn`` is a function or an ``nn.Module`` (its parameters and buffers become
    the first inputs). The example inputs' data is never read: they may live
    on any device, ``meta`` included. See ``docs/calling-convention.md``.
    ``partition`` ("save_all", "mincut", ``aotgrad.budget(x)`` or a policy,
    Note [Partition policies]) chooses what the backward saves; the keyword is
    aotgrad's, not passed on to ``fn``. ``dynamic=True`` (or dimensions marked with
    ``aotgrad.dynamic``) traces symbolic sizes (Note [Dynamic shapes]), also reserved,
    as are ``tracer`` ("auto", "direct" or "full": Note [Choosing a tracer]), ``fast``
    (False: no fast path, as ``AOTGRAD_FAST=0``), ``check`` (Note [Stage checks]) and
    ``decompositions`` (a dict from op to function, or ``"core_aten"``: every op of the
    graphs in PyTorch's Core ATen opset, Note [Core ATen graphs]).

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
    given = dict(
        partition=partition,
        dynamic=dynamic,
        tracer=tracer,
        fast=fast,
        check=check,
        decompositions=decompositions,
    )
    options = options_of(given, "trace")
    fn = as_module(fn)
    wrapping = wrapping_of(fn) if isinstance(fn, torch.nn.Module) else None
    if wrapping is None:
        return _trace(fn, args, kwargs, options, fn=fn, wrapping=None)
    with wrapping.capturing():  # Note [Wrappers run around the graphs]
        return _trace(wrapping.inner, args, kwargs, options, fn=fn, wrapping=wrapping)


def _trace(
    traced_fn: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    options: Options,
    *,
    fn: Callable[..., Any],
    wrapping: Wrapping | None,
) -> Traced:
    """The trace of ``traced_fn`` (a wrapper's inner module, or ``fn`` itself)."""
    lifting = State(traced_fn)
    target = call_target(traced_fn)
    # Keyed before the trace, as aot_function keys a call (Note [A Traced keeps to its capture]).
    called = keyed_call(
        *(target, lifting, args, kwargs, {}),
        dims=lambda leaves: requested_dims(leaves, everything=options.dynamic),
    )
    arguments, lifted, dims, key = called.arguments, called.lifted, called.dims, called.key
    refuse_reached_wrappers(_reached(lifting, arguments))
    watch = watch_of(traced_fn, arguments)
    traceable = signature_stage(
        *(traced_fn, target, args, kwargs, lifting, lifted),
        dims=dims,
        effects=watch,
        arguments=arguments,
    )
    partitioned, compiled = run(traceable, options)
    settled = lifting.settle(lifted, arguments)
    capture = capture_of(
        target=target,
        args=args,
        kwargs=kwargs,
        key=key._replace(state=settled.key),
        dims=dims,
        state=lifting,
        sharing=memory_sharing(traceable.primals),
        descriptors=partitioned.joint.inputs.descriptors,
    )
    return Traced(
        partitioned=partitioned,
        _compiled=compiled,
        _lifted=lifted.tensors,
        _autocast=autocast_state(),
        _wrapping=wrapping,
        _capture=capture,
        _replay=watch.replay,
        _options=options,
        _fn=fn,
    )


def load(
    path: str | os.PathLike[str],
    module: torch.nn.Module | None = None,
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    inference_compiler: Compiler | None = None,
) -> Loaded:
    """Read graphs ``Traced.save`` wrote; call the result as the ``Traced`` that saved them.

    No tracing, and no code from the file runs (Note [Files run no code]). A module's
    parameters and buffers are read from ``module`` at every call (Note [Loaded module
    state]); the compilers run now, on the loaded graphs.

    >>> import torch, aotgrad, tempfile, pathlib
    >>> model = torch.nn.Linear(3, 2)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "linear.aotgrad"
    >>> aotgrad.trace(model, torch.ones(4, 3)).save(path)
    >>> loaded = aotgrad.load(path, module=model)
    >>> torch.allclose(loaded(torch.ones(4, 3)), model(torch.ones(4, 3)))
    True
    """
    where = str(path)
    try:
        data = read_regular_file(path)
    except OSError as e:
        raise StoreError(f"cannot read {where}: {e}") from None
    options = Options(
        fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler
    )
    return Loaded(loads(data, where), module, options, differentiable_backward_driver(options))


def aot_function(
    fn: Callable[..., Any],
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    *,
    partition_fn: PartitionFn | None = None,
    **options: Any,
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
    "full") chooses how capture traces (Note [Choosing a tracer]). Specializations are
    also kept on disk across processes where a stable key exists (``disk_cache=False``
    or ``AOTGRAD_CACHE=0`` turns it off; Note [The disk cache], docs/caching.md).
    The keyword options are the fields of :class:`aotgrad.settings.Options`.

    >>> import torch, aotgrad
    >>> f = aotgrad.aot_function(lambda x: x.sin().sum())
    >>> x = torch.ones(3, requires_grad=True)
    >>> f(x).backward(); torch.allclose(x.grad, torch.ones(3).cos())
    True
    """
    if partition_fn is not None:
        options["partition"] = partition_fn
    given = dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler, **options)
    return AOTFunction(fn, options_of(given, "aot_function"))


class AOTFunction(_Reports):
    """``aot_function``'s result: call it like the function; one compiled graph pair per specialization.

    ``seq_table()``, ``memory_report()`` and ``partitioned`` describe the most
    recent specialization; ``cache`` (a :class:`SpecializationCache`) holds them all.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: Options,
        input_names: Sequence[str] | None = None,
        read_environment: bool = True,
        dynamic_dims: DynamicDims | None = None,
        code_key: tuple[Any, set[str]] | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        fn = self._given = as_module(fn)
        # A DDP or FSDP2 wrapper runs around the graphs of its inner module (Note [Wrappers
        # run around the graphs]); Dynamo's graphs never hold one.
        self._wrapping = (
            wrapping_of(fn) if read_environment and isinstance(fn, torch.nn.Module) else None
        )
        if self._wrapping is not None:
            fn = self._wrapping.inner
        # Per thread, inside the wrapper's call: run the graphs.
        self._in_wrapper = threading.local()
        self._fn = fn
        self._target = call_target(fn)
        self._options = options
        # Names for the tensor inputs, when the caller knows better than fn's signature.
        self._input_names = input_names
        # Module state, closed-over tensors and guarded values (Note [Closed-over tensors]).
        # ``read_environment=False``: the caller (Dynamo) guards and lifts those itself.
        self._read_environment = read_environment
        self._state = State(fn, read_environment)
        # Every call's dynamic dimensions, when the caller (Dynamo) knows them once for all
        # calls; else read from each call (Note [Marking dimensions dynamic]).
        self._dynamic_dims = dynamic_dims
        # Leaf names by call structure, for module arguments (Note [Module arguments]).
        self._names: dict[Any, list[str]] = {}
        self.cache = SpecializationCache(
            limit=options.cache_limit, owner=getattr(fn, "__name__", type(fn).__name__)
        )
        # The code a trace runs, as the disk cache keys it, when the caller (Dynamo) gives it.
        self._code_key = code_key
        self._disk = DiskCacheUse(
            fn=fn,
            code_key=code_key,
            input_names=input_names,
            options=options,
            driver=differentiable_backward_driver(options),
        )
        self._partitioned: Partitioned | None = None
        # The last call, when a disk hit served it: what its reports trace (Note [Reports
        # after a disk hit]).
        self._hit: HitCall | None = None
        # Compiled JVP bodies for dual calls, by structure and dual positions (None: capture
        # refused); a JVP body itself runs under the forward-AD level like any call (Note
        # [Forward mode captures a JVP graph]).
        self._jvps: dict[tuple[Any, tuple[int, ...]], AOTFunction | None] = {}
        self._is_jvp_body = False
        # Held from a miss to its entry's storing (Note [Concurrent calls]).
        self._missing = threading.RLock()

    @property
    def info(self) -> CacheInfo:
        """Hits, misses and why (``aotgrad.cache_info``)."""
        return self.cache.info

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._wrapping is not None and not getattr(self._in_wrapper, "active", False):
            return self._wrapped(args, kwargs)
        if not kwargs:  # Note [The last entry]: never in a capture or under a transform
            last = self.cache.last_entry(args)
            if last is not None:
                return last(args)
        if capturing():  # called by code being traced: trace through (Note [Capture sessions])
            return self._fn(*args, **kwargs)
        if transform_active() and not self._is_jvp_body:
            return self._under_transform(args, kwargs)
        leaves, _, arguments, lifted, _, key = self._keyed(args, kwargs, self._dims)
        found = self.cache.find(key, lifted.tensors, leaves)
        if isinstance(found, Miss):
            missed = _Call(
                args=args, kwargs=kwargs, leaves=leaves, lifted=lifted, arguments=arguments
            )
            return self._miss(found, missed)
        if not kwargs and self._state.empty:
            self.cache.remember(key, found, leaves)
        return found(lifted.tensors, leaves)

    def _keyed(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dims: Callable[[Sequence[Any]], DynamicDims | None],
    ) -> KeyedCall:
        """The call read and keyed, as every specialization is (``keyed_call``)."""
        return keyed_call(self._target, self._state, args, kwargs, self._names, dims)

    def _dims(self, leaves: Sequence[Any]) -> DynamicDims | None:
        """A call's dynamic dimensions (Note [Marking dimensions dynamic])."""
        if self._dynamic_dims is not None:
            return self._dynamic_dims
        return requested_dims(leaves, everything=self._options.dynamic)

    def _under_transform(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call under a torch.func transform or a forward-AD level.

        Dual arguments go through a compiled JVP body (Note [Forward mode captures a JVP
        graph]); everything else runs the function (Note [Transforms run the function]).
        """
        if not functorch_transforms_active() and self._wrapping is None:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            positions = dual_positions(leaves)
            jvp = self._jvp(spec, positions) if positions else None
            # Not when the module state or a closed-over tensor carries a tangent.
            if jvp is not None and not has_tangent(
                self._keyed(args, kwargs, self._dims).lifted.tensors
            ):
                primals, tangents = split_duals(leaves, positions)
                try:
                    out = jvp(primals, tangents)
                except CaptureError as e:  # eager may run what capture refuses
                    self._jvps[spec, positions] = None
                    self.cache.info.jvp_skipped = f"{type(e).__name__}: {e}"
                else:
                    self.cache.info.jvp_runs += 1
                    return join_duals(*out)
        self.cache.info.transform_runs += 1
        return self._fn(*args, **kwargs)

    def _jvp(self, spec: pytree.TreeSpec, positions: tuple[int, ...]) -> AOTFunction | None:
        """The compiled JVP body for duals at ``positions`` (Note [Forward mode captures a JVP
        graph]); None once its capture failed (``cache_info(f).jvp_skipped`` says why)."""
        if (spec, positions) not in self._jvps:
            body = jvp_body(self._fn, spec, positions)
            options = replace(self._options, disk_cache=False)
            found = self._jvps[spec, positions] = AOTFunction(body, options)
            found._is_jvp_body = True
        return self._jvps[spec, positions]

    def _wrapped(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a DDP or FSDP2 module: its logic around ``self`` (Note [Wrappers run
        around the graphs])."""
        assert self._wrapping is not None
        if capturing():
            raise CallError(
                "an aot_module of a DDP or fully_shard module was called by code aotgrad is"
                " capturing: the wrapper's hooks cannot run inside a graph (see Note"
                " [Wrappers run around the graphs]). Compile the outer function without it,"
                " or compile only the wrapped model."
            )
        self._in_wrapper.active = True
        try:
            return self._wrapping.call(self, args, kwargs)
        finally:
            self._in_wrapper.active = False

    def _miss(self, miss: Miss, call: _Call) -> Any:
        """Trace, compile and run a new entry (or load it from disk); run eagerly when the cache is full."""
        with self._missing:  # Note [Concurrent calls]
            entry = self._entry_for(miss, call)
        if entry is None:
            return self._fn(*call.args, **call.kwargs)
        return entry(call.lifted.tensors, call.leaves)

    def _entry_for(self, miss: Miss, call: _Call) -> Entry | None:
        """The entry serving a call that missed: stored meanwhile by another thread, loaded from
        disk, or traced now; None when the cache is full (the call runs eagerly)."""
        found = self.cache.find(miss.key._replace(retrace=0), call.lifted.tensors, call.leaves)
        if isinstance(found, Entry):
            return found
        miss = found
        args, kwargs = call.args, call.kwargs
        if not self.cache.admit(miss, lambda: leaf_names(self._target, args, kwargs)):
            return None
        info = self.cache.info
        slot = self._disk.slot(miss.key, info, wrapped=self._wrapping is not None)
        entry = self._disk.load(slot, info) if slot is not None else None
        if entry is not None:
            self.cache.add(miss.key, entry)
            # Traced again when a report asks (Note [Reports after a disk hit]).
            self._partitioned = None
            self._hit = HitCall.of(call.args, call.kwargs, miss.key)
            return entry
        entry = self._specialize(call, miss.key.dynamic_dims)
        settled = self._state.settle(call.lifted, call.arguments)
        if slot is not None:
            self._disk.store(slot, entry, same_key=settled.key == call.lifted.key, info=info)
        self.cache.add(miss.key._replace(state=settled.key), entry)
        return entry

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as the function and the options; compiled graphs are made again on use."""
        arguments = (self._input_names, self._read_environment, self._dynamic_dims, self._code_key)
        return (AOTFunction, (self._given, self._options, *arguments))

    @property
    def partitioned(self) -> Partitioned | None:
        """The last specialization's graphs and what aotgrad decided; None before the first
        call. After a disk hit, traced again on first use (Note [Reports after a disk hit])."""
        if self._partitioned is None and self._hit is not None:
            self._partitioned = self._describe(self._hit)
        return self._partitioned

    def _reported(self) -> Partitioned:
        partitioned = self.partitioned
        if partitioned is None:
            raise CallError("no specialization yet: call the compiled function first")
        return partitioned

    def _lifted_for_export(self, partitioned: Partitioned) -> tuple[torch.Tensor, ...]:
        lifted = self._state.read()
        leading = partitioned.signature.forward_inputs[: len(lifted.descriptors)]
        if tuple(lifted.descriptors) != tuple(leading):
            raise CallError(
                "the function's module state and closed-over tensors now are"
                f" {[str(d) for d in lifted.descriptors]}, and its last specialization's graphs"
                f" take {[str(d) for d in leading]}; call it again before exporting"
            )
        return lifted.tensors

    def _describe(self, hit: HitCall) -> Partitioned:
        """The graphs of a disk hit, traced again for the reports (Note [Reports after a disk
        hit]): on tensors of the hit's metadata, under its grad mode; nothing is compiled."""
        args, kwargs = hit.call()
        with torch.set_grad_enabled(hit.grad_mode):
            leaves, _, arguments, lifted, _, key = self._keyed(args, kwargs, lambda _: None)
            if key != hit.key:
                names = leaf_names(self._target, args, kwargs)
                raise CallError(
                    "the last call's graphs came from the disk cache, and the reports trace"
                    " them again to describe them; now the call's key differs"
                    f" ({key.explain(hit.key, names)}). Ask for the report under the torch"
                    " state of that call, or compile with disk_cache=False (docs/caching.md)"
                )
            call = _Call(
                args=args, kwargs=kwargs, leaves=leaves, lifted=lifted, arguments=arguments
            )
            return capture_and_partition(self._traceable(call, None)[0], self._options)

    def _specialize(self, call: _Call, dims: DynamicDims | None) -> Entry:
        traceable, watch = self._traceable(call, dims)
        partitioned, compiled = run(traceable, self._options)
        self._partitioned, self._hit = partitioned, None
        return Entry.of(
            compiled,
            traceable.flat,
            lifted=bool(call.lifted.tensors),
            replay=None if watch is None else watch.replay,  # Note [Side effects replayed]
            environ=partitioned.joint.environ,  # Note [Environment read at capture]
        )

    def _traceable(self, call: _Call, dims: DynamicDims | None) -> tuple[Traceable, Watch | None]:
        """One call as capture traces it, and what watches the user's objects meanwhile."""
        refuse_reached_wrappers(_reached(self._state, call.arguments))
        # Dynamo's graphs store nothing: it replays side effects itself.
        watch = watch_of(self._fn, call.arguments) if self._read_environment else None
        traceable = signature_stage(
            *(self._fn, self._target, call.args, call.kwargs, self._state, call.lifted),
            dims=dims,
            names=self._input_names,
            effects=watch,
            arguments=call.arguments,
        )
        return traceable, watch


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One call of an ``AOTFunction`` that missed: what tracing it needs."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # The leaves of ``(args, kwargs)`` (``flatten_call``).
    leaves: Sequence[Any]
    # The state the function reads, and the modules among the arguments (Note [Module arguments]).
    lifted: Lifted
    arguments: Arguments


def _reached(state: State, arguments: Arguments) -> list[tuple[str, Any]]:
    """The values a function reads besides its own module: closures, globals, module arguments."""
    roots = [(f"{root.kind.__name__.lower()} {root.name}", root.get()) for root in state.roots]
    return [*roots, *arguments]


class AOTModule(_Reports, torch.nn.Module):
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
        if not any(getattr(self, name) for name in MODULE_HOOKS):
            return self.compiled(*args, **kwargs)
        if any(global_module_hooks(name) for name in MODULE_HOOKS):
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

    @property
    def partitioned(self) -> Partitioned | None:
        """The last specialization's graphs and what aotgrad decided (``AOTFunction.partitioned``);
        None before the first call.

        >>> import torch, aotgrad
        >>> model = aotgrad.aot_module(torch.nn.Linear(3, 2))
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> [(s.name, s.producer) for s in model.partitioned.saved]
        [('input_1', 'input')]
        """
        return self.compiled.partitioned

    def _reported(self) -> Partitioned:
        return self.compiled._reported()

    def _lifted_for_export(self, partitioned: Partitioned) -> tuple[torch.Tensor, ...]:
        return self.compiled._lifted_for_export(partitioned)


def _rebuild_aot_module(module: torch.nn.Module, options: Options) -> AOTModule:
    return AOTModule(module, AOTFunction(module, options))


def aot_module(
    module: torch.nn.Module,
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    *,
    partition_fn: PartitionFn | None = None,
    **options: Any,
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
    if partition_fn is not None:
        options["partition"] = partition_fn
    given = dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler, **options)
    return AOTModule(module, AOTFunction(module, options_of(given, "aot_module")))


with_option_keywords(aot_function)
with_option_keywords(aot_module)
