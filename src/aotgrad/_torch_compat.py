"""Every private torch name aotgrad relies on, in one place, grouped by what aotgrad uses it for.

A torch upgrade starts here: read this file, run ``tests/test_torch_compat.py``
(one smoke test per name: it exists and still behaves as aotgrad assumes),
and the rest of the package needs no reading. Modules elsewhere import these
names from here and never reach into torch's private parts themselves.

What counts as private, and goes through this module:

- anything reached through a ``_``-prefixed module: ``torch._C``,
  ``torch._subclasses``, ``torch._ops``, ``torch._dispatch``, ``torch._dynamo``,
  ``torch._guards``, ``torch._inductor``, ``torch.fx._lazy_graph_module``,
  ``torch.utils._python_dispatch``, ``torch.utils._mode_utils``;
- ``_``-prefixed names of public modules and classes: ``torch._sync``,
  ``torch._functionalize_*``, ``torch.fx.proxy._COPY_META_FIELDS``,
  ``fx.Node._rename``, ``fx.Graph._target_to_str``, ``OpOverload._op``,
  ``torch.compiler._is_compiling_flag``, ``torch.nn.modules.module._global_*``;
- torch's error messages that aotgrad recognises by a piece of their text,
  the names of torch functions and loggers it compares strings with, and the
  node metadata keys only Dynamo writes.

What aotgrad uses directly, as public:

- ``torch.utils._pytree``: in all but name the public pytree API. Its
  functions (``tree_flatten_with_path``, ``keystr``, ``register_pytree_node``,
  ``register_dataclass``, ``SUPPORTED_NODES``) are what ``torch.export`` and
  Dynamo tell users to register containers with, and torch 2.13 has no public
  module in its place. Its own ``_``-prefixed helpers still come from here.
- attributes that torch's public ``Tensor``, ``nn.Module`` and operator types
  declare and that every library of the field reads: ``Tensor._base``,
  ``Tensor._version``, ``Tensor._is_view()``, a sparse tensor's
  ``_indices()``/``_values()``, ``Module._parameters``/``_buffers``, and an
  operator's ``_schema`` (there is no other way to read an op's signature).
  Wrapping each of these would hide what the code does and protect nothing.
- ``torch.fx``, ``torch.fx.traceback``, ``torch.fx.experimental``,
  ``make_fx``, ``torch.utils.checkpoint``: public modules.
- ``torch.export`` (``ExportedProgram``, ``ModuleCallEntry``) and
  ``torch.export.graph_signature`` (its ``__all__``): public; ``aotgrad/export.py``
  builds programs from them; ``node.meta["custom"]`` is the key
  ``torch.fx.traceback.annotate`` fills and ``torch.export.save`` keeps.
- aten operators whose names start with ``_`` (``aten._unsafe_view``,
  ``aten._linalg_check_errors``): the dispatcher's op names, which graphs and
  op tables hold as data, not Python internals.

Inductor and Dynamo take seconds to import: their names are imported on first
use, inside the functions below, never when aotgrad is imported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch._C._dynamo.guards as _guards
import torch._dispatch.python as _python_dispatcher
import torch._ops as _ops
import torch._prims_common as _prims_common
import torch._subclasses.fake_impls as _fake_impls
import torch._subclasses.fake_tensor as _fake_tensor
import torch._subclasses.functional_tensor as _functional_tensor
import torch.fx as fx
import torch.fx._lazy_graph_module as _lazy_graph_module
import torch.fx.passes.shape_prop as _shape_prop
import torch.fx.proxy as _fx_proxy
import torch.nn.modules.module as _nn_module
import torch.utils._device as _device
import torch.utils._mode_utils as _mode_utils
import torch.utils._python_dispatch as _python_dispatch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as _checkpoint
from torch._C import _functionalization

# Note [Behaviour by torch release]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# aotgrad supports torch 2.11 through 2.15. Where a release behaves differently, the
# difference is keyed here on the running release, never guessed from a ``try/except``
# around a private call (which could hide a wrong result):
#
#     is_opaque_reference(mesh)   2.11-2.13: is_opaque_reference_type(type(v))
#                                 2.14-2.15: is_opaque_symbolic_type(type(v)) (the old name
#                                            warns twice a call)
#     _cpp_meta_takes_symint(op)  2.11-2.14: FakeTensorMode._cpp_meta_supports_symint
#                                 2.15: torch._meta_registrations.cpp_meta_supports_symint_ops
#
# Behaviours that drifted outside these names are fixed where they live and named by the
# release in their Note: ``_linalg_check_errors`` not effectful before 2.13
# (``ops.table.remove_dead_code``), ``detach`` traced as ``alias`` from 2.14
# (``capture.tracing.assemble._remove_detaches``), a checkpoint's hooks kept by a live frame on 2.11/2.12
# (Note [The direct trace's frames are let go]).
TORCH_RELEASE: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]
SUPPORTED_RELEASES = ((2, 11), (2, 15))
# The releases whose suite passed with the fast path's rules (its direct-vs-full tests
# included: README, Supported versions). On any other the fast path declines: capture runs
# in PyTorch's stock fake mode with the full trace, and ``fallback_reason`` says so.
FAST_PATH_VERIFIED = frozenset({(2, 11), (2, 12), (2, 13), (2, 14), (2, 15)})

# --- Operators -----------------------------------------------------------------------------------

# The type of ``torch.ops.aten.mm.default``: op tables and tracers tell ops from Python callables.
OpOverload = _ops.OpOverload


def op_kernel(op: OpOverload) -> Callable[..., Any]:
    """The C++ entry point ``op(...)`` forwards to: straight-line code calls it directly."""
    return op._op


# --- Fake tensors (capture runs on them, never on data) ------------------------------------------

# The fake mode capture runs under, and its tensors.
FakeTensorMode = _fake_tensor.FakeTensorMode
FakeTensor = _fake_tensor.FakeTensor
# What the fake mode raises when Python code or an op reads tensor values: a DataDependentError.
DataDependentOutputException = _fake_tensor.DataDependentOutputException
DynamicOutputShapeException = _fake_tensor.DynamicOutputShapeException
UnsupportedOperatorException = _fake_tensor.UnsupportedOperatorException
# ``view``'s output strides from symbolic sizes (Note [Eager strides for views]).
view_stride = _fake_impls._compute_stride
# Run a kernel on real (meta) tensors inside a trace, below every mode.
no_dispatch = _mode_utils.no_dispatch
# The Python dispatcher, which lets symbolic sizes through decompositions during the full trace.
enable_python_dispatcher = _python_dispatcher.enable_python_dispatcher
# The logger of the fake mode, which prints a traceback for every failed meta kernel: silenced
# during capture (Note [Capture sessions]).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# --- The fast path only (capture/tracing/fast/, Note [The fast path as a layer]) -----------------------
# ``fast=False`` uses none of these: a torch release that breaks one breaks the fast path only.

# Run an op's meta kernel on fake tensors seen as meta tensors, as the fake mode's last step
# does (Note [Straight to the meta kernel]).
in_kernel_invocation = _fake_tensor.in_kernel_invocation_manager


def has_meta_kernel(op: OpOverload) -> bool:
    """Does ``op`` have a kernel for the meta device (C++ or registered from Python)?"""
    return bool(_fake_impls.has_meta(op))


def fake_mode_decomposes(op: OpOverload) -> bool:
    """Does the fake mode run ``op`` as Python code (a decomposition or a CompositeImplicit
    kernel) rather than its meta kernel, for static sizes? Such code may read the device,
    which a meta kernel sees as ``meta`` (batch norm's saved statistics are empty on CPU)."""
    from torch._decomp import decomposition_table, meta_table

    if op in meta_table or _cpp_meta_takes_symint(op):
        return False
    if op in decomposition_table and _fake_tensor.torch_decomp_decompositions(op):
        return True  # the fake mode runs the decompositions of torch._decomp, not torch._refs
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _cpp_meta_takes_symint(op: OpOverload) -> bool:
    """Does the fake mode run ``op``'s C++ meta kernel even for symbolic sizes? (The list moved
    to ``torch._meta_registrations`` in 2.15: Note [Behaviour by torch release].)"""
    if TORCH_RELEASE >= (2, 15):
        import torch._meta_registrations as registrations

        ops = vars(registrations)["cpp_meta_supports_symint_ops"]
    else:
        ops = _fake_tensor.FakeTensorMode._cpp_meta_supports_symint
    return op in ops or torch.Tag.view_copy in op.tags


def fake_mode_has_own_rule(op: OpOverload) -> bool:
    """Does the fake mode treat ``op`` otherwise than by running its meta kernel: a metadata
    query, a rule of its own (views, constructors, convolution ...), a registered fake kernel?"""
    if op in _fake_tensor._DISPATCH_META_HANDLERS or op in _fake_tensor._DISPATCH_HANDLE_DIRECTLY:
        return True
    if any(check(op) for check, _ in _fake_impls.op_implementations_checks):
        return True
    return torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None


# ``t.device`` of a fake tensor as the fake mode answers the query (``meta`` inside a kernel).
def fake_device(t: FakeTensor) -> torch.device:
    return _fake_tensor._device_handler((t,))


# The base class of the direct tracer (Note [Direct tracing]).
TorchDispatchMode = _python_dispatch.TorchDispatchMode
# Would autograd decompose this op (a CompositeImplicit kernel) before the tracer sees it?
autograd_would_have_decomposed = _python_dispatch.autograd_would_have_decomposed
# Run ops below autograd (no grad_fn, no sequence number taken), as a dispatch mode's
# handler does: the direct trace's replays of views outside an op (Note [Writes through
# views, directly]).
below_autograd = torch._C._AutoDispatchBelowADInplaceOrView

# The two modes ``create_selective_checkpoint_contexts`` makes: the forward's, which asks the
# policy about each op and caches what it saves, and the recompute's, which hands the cache
# back (Note [Selective checkpoints stop the direct trace]).
SELECTIVE_CHECKPOINT_MODES: tuple[type, ...] = (
    _checkpoint._CachingTorchDispatchMode,
    _checkpoint._CachedTorchDispatchMode,
)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# How far up from a mode's handler a policy mode's frame is looked for: a few wrappers and
# torch's own layers lie between (five on 2.13); the walk ends sooner at the first frame not torch's.
_FRAMES_TO_A_POLICY_MODE = 32


def dispatched_by_selective_checkpoint(frame: types.FrameType | None) -> bool:
    """Did a selective checkpoint's mode dispatch the op? ``frame`` is the caller of the
    ``__torch_dispatch__`` handling it (Note [Selective checkpoints stop the direct trace]).

    Such a mode sits above the handler's mode and is off the mode stack while it runs (a
    handler's mode is popped while its handler runs), but its handler's frame is on the
    Python stack, behind torch's own frames: the walk goes up through those only.
    """
    for _ in range(_FRAMES_TO_A_POLICY_MODE):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "__torch_dispatch__" and isinstance(
            frame.f_locals.get("self"), SELECTIVE_CHECKPOINT_MODES
        ):
            return True
        if not code.co_filename.startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


# Node metadata ``make_fx`` copies onto each node it creates: the direct tracer copies the same.
COPY_META_FIELDS: tuple[str, ...] = tuple(_fx_proxy._COPY_META_FIELDS)
# ``make_fx``'s ``seq_nr`` for a node it creates, by the node's name.
seq_nr_of = _fx_proxy._get_seq_nr
# The ``tensor_meta`` that ``make_fx`` stores on a node, from its value.
tensor_metadata = _shape_prop._extract_tensor_metadata


def op_node_name(graph: fx.Graph, op_name: str) -> str:
    """The name ``make_fx`` gives a node calling ``op_name`` (``create_node`` makes it unique)."""
    return graph._target_to_str(op_name)


def in_autograd_engine() -> bool:
    """Is autograd's engine running a backward (the capture's, or one the function started)?"""
    return torch._C._current_graph_task_id() != -1


def engine_uses(node: Any) -> bool:
    """Will the running backward use the gradient sent along an edge to autograd node
    ``node`` (one of ``ctx.next_functions``)? False only when the engine says it will not
    execute that node (``autograd.grad(..., inputs=x)`` skips the parameters' nodes), as eager's
    ``task_should_compute_output`` does (Note [Only the gradients asked for]).

    The engine refuses to answer for a leaf that ``autograd.grad`` captures: that gradient is
    used. Any refusal answers True, which costs time and is never wrong; ``register_multi_grad_hook``
    is torch's public caller of the same function.
    """
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # "A leaf node was passed ... running autograd.grad()": captured
        return True


# --- Functionalization (the full trace) ----------------------------------------------------------

# The functional wrapper tensors of the full trace, and the mode that makes them.
FunctionalTensor = _functional_tensor.FunctionalTensor
FunctionalTensorMode = _functional_tensor.FunctionalTensorMode
# Bring a functional tensor's pending updates into its current value.
sync = torch._sync
# A functional tensor's current inner tensor.
from_functional_tensor = torch._from_functional_tensor
# Is this functionalization's own inner tensor (not a real tensor the user closed over)?
is_functional_tensor = torch._is_functional_tensor
# Mutation probes on an input's functional wrapper after the function ran (Note [Input mutation]).
was_storage_changed = torch._functionalize_was_storage_changed  # ``set_`` swapped its storage
has_data_mutation = torch._functionalize_has_data_mutation  # type: ignore[attr-defined]
has_metadata_mutation = torch._functionalize_has_metadata_mutation  # as_strided_, t_, resize_
mutation_counter = torch._functionalize_mutation_counter


# Per autograd node type: the attributes holding what its nodes saved, unpacked or not.
_RAW_SAVED: dict[type, tuple[str, ...]] = {}


def saved_data(node: Any) -> list[object]:
    """What an autograd node saved for its backward, as stored: without unpacking (a
    checkpoint's hook refuses a second unpack) or checking versions (Note [State updated by
    the backward])."""
    names = _RAW_SAVED.get(type(node))
    if names is None:
        names = tuple(a for a in dir(type(node)) if a.startswith("_raw_saved_"))
        _RAW_SAVED[type(node)] = names
    data = []
    for name in names:
        raw = getattr(node, name)
        for saved in raw if isinstance(raw, list | tuple) else (raw,):
            if isinstance(saved, torch._C._autograd.SavedTensor):
                data.append(saved.data)  # type: ignore[attr-defined]
    return data


# The view chain from a functional view's base to it, and replaying it on another base.
view_meta_sequence = _functionalization.get_view_meta_sequence
apply_view_meta_sequence = _functionalization.apply_view_meta_sequence

# --- Dispatch and torch-function modes -----------------------------------------------------------

# Step below every active dispatch mode: read the real generator, measure without tracing.
disable_current_modes = _python_dispatch._disable_current_modes


def is_opaque_reference(value: object) -> bool:
    """Is ``value`` of a registered opaque reference type (a ``DeviceMesh``, a ``ProcessGroup``):
    an object Dynamo passes to its graph as an input, compared by identity?"""
    import torch._library.opaque_object as _opaque

    opaque: Any = _opaque  # its names differ by release (Note [Behaviour by torch release])
    if TORCH_RELEASE >= (2, 14):
        return bool(opaque.is_opaque_symbolic_type(type(value)))
    return bool(opaque.is_opaque_reference_type(type(value)))


# How many torch-function modes this thread has (one C call: ``function_modes`` builds a list).
function_mode_count = torch._C._len_torch_function_stack


def function_modes() -> list[Any]:
    """This thread's torch-function modes, outermost first (autograd's workers inherit them)."""
    return torch.overrides._get_current_function_mode_stack()


# A tensor subclass with ``__tensor_flatten__``/``__tensor_unflatten__`` (Note [Tensor subclasses]).
is_traceable_wrapper_subclass = _python_dispatch.is_traceable_wrapper_subclass
# Step below torch-function modes (the closed-over swap) to read a real tensor's ``.grad``.
DisableTorchFunction = torch._C.DisableTorchFunction
# Step below a wrapper subclass's ``__torch_dispatch__``: change the wrapper's own metadata
# (Note [Subclass inputs rebased]).
DisableTorchDispatch = torch._C._DisableTorchDispatch
# ``t.data = x`` as Dynamo writes it into its graph from torch 2.14 (None before).
SHALLOW_COPY_DATA = torch.ops.aten.shallow_copy_data_.default if TORCH_RELEASE >= (2, 14) else None

# A torch-function mode of this thread, by its place in the stack (0: outermost).
function_mode_at = torch._C._get_function_stack_at
# The mode ``with torch.device(d)`` and ``torch.set_default_device(d)`` push.
DeviceContext = _device.DeviceContext

# --- Global settings that choose the traced ops (Note [Torch settings in the key]) -------------

flash_sdp_enabled = torch._C._get_flash_sdp_enabled
mem_efficient_sdp_enabled = torch._C._get_mem_efficient_sdp_enabled
math_sdp_enabled = torch._C._get_math_sdp_enabled
cudnn_sdp_enabled = torch._C._get_cudnn_sdp_enabled
overrideable_sdp_enabled = torch._C._get_overrideable_sdp_enabled
sdp_priority_order = torch._C._get_sdp_priority_order
math_sdp_allows_reduction = torch._C._get_math_sdp_allow_fp16_bf16_reduction
deterministic_algorithms = torch._C._get_deterministic_algorithms
cudnn_enabled = torch._C._get_cudnn_enabled
mkldnn_enabled = torch._C._get_mkldnn_enabled
# ``torch.backends.opt_einsum``'s own readers: its attributes go through a ``PropModule``
# (slow to read, and read on every call's key: bench/findings.md).
opt_einsum_enabled = torch.backends.opt_einsum._get_enabled
opt_einsum_strategy = torch.backends.opt_einsum._get_strategy

# --- torch.fx internals --------------------------------------------------------------------------

# Graph modules that generate their code on first use (Note [Code on demand]).
LazyGraphModule = _lazy_graph_module._LazyGraphModule
use_lazy_graph_module = _lazy_graph_module._use_lazy_graph_module


def rename_node(node: fx.Node, name: str) -> None:
    """Rename a node in place (made unique among the graph's names)."""
    node._rename(name)


class ExpandedCodeGen(fx.graph.CodeGen):
    """fx's code generator, always with one argument a line, so each carries its descriptor.

    fx prints ``node.meta["desc"]`` as a comment on expanded placeholders and outputs; only
    the private ``_gen_python_code`` takes the ``expanded_def`` switch.
    """

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> fx.graph.PythonCode:
        kwargs["expanded_def"] = True
        return super()._gen_python_code(*args, **kwargs)

    # The comments fx writes from descriptors: escaped once more, whatever the descriptor
    # (Note [User text in code] in signature/descriptors.py).
    def _format_single_arg(self, arg: str) -> str:
        name, sep, comment = arg.partition("#")
        return super()._format_single_arg(name + sep + _printable(comment))

    def _get_desc_trailers(self, items: Any, descs: Any) -> list[str]:
        if descs is None:
            return super()._get_desc_trailers(items, descs)
        return super()._get_desc_trailers(items, [_printable(str(d)) for d in descs])


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- Autograd internals --------------------------------------------------------------------------

# ``autograd.Function.apply`` without its Python layer (Note [Calling the Function directly]).
FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]
unwrap_if_dead = torch._C._functorch.unwrap_if_dead
functorch_transforms_active = torch._C._are_functorch_transforms_active
# The innermost active torch.func transform (its ``key()``: ``TransformType.Grad``, ``Vmap``,
# ``Jvp``, ``Functionalize``), named in errors (Note [Transforms run the function]).
peek_functorch_interpreter = torch._C._functorch.peek_interpreter_stack


_forward_ad = torch.autograd.forward_ad


def forward_ad_level() -> int:
    """The innermost ``torch.autograd.forward_ad.dual_level`` entered; -1 outside any."""
    return _forward_ad._current_level


def functorch_or_forward_ad_active() -> bool:
    """A torch.func transform active, or a dual level open: one frame, on every call."""
    return functorch_transforms_active() or _forward_ad._current_level >= 0


# Put a tensor's version counter back (Note [Replayed metadata keeps the version]).
set_version_counter = torch._C._autograd._unsafe_set_version_counter


def custom_function_class(node: Any) -> type | None:
    """The ``autograd.Function`` whose backward the autograd node ``node`` is; None for a
    built-in op's node."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        function: type = node._forward_cls  # type: ignore[attr-defined]
        return function
    return None


def view_creation(t: torch.Tensor) -> str:
    """How autograd made the view ``t``: its creation meta's name (``"DEFAULT"``,
    ``"MULTI_OUTPUT_NODE"``, ``"NO_GRAD_MODE"``, ...), which decides what an in-place change of
    ``t``, or of its base, may do (Note [Multi-output views] in ``capture/analyses/aliasing.py``)."""
    return str(torch._C._autograd._get_creation_meta(t).name)


def set_view_creation(t: torch.Tensor, name: str) -> None:
    """Give the view ``t`` the creation meta :func:`view_creation` named ``name``."""
    torch._C._autograd._set_creation_meta(t, getattr(torch._C._autograd.CreationMeta, name))


# What ``autograd.grad`` and ``.backward()`` run, called by capture with its modes kept active
# (Note [The swap spans the backward]).
engine_run_backward = torch.autograd.graph._engine_run_backward


# The caller's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), taken off the
# stack while a capture runs and put back after (Note [The caller's saved-tensor hooks]).
top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks


def autograd_node_number(node: Any) -> int:
    """The sequence number autograd gave a graph node (Note [Sequence numbers])."""
    return node._sequence_nr()


def compiling_flag() -> bool:
    """What ``torch.compiler.is_compiling()`` answers outside Dynamo (Note [Capture is compiling])."""
    return torch.compiler._is_compiling_flag


def set_compiling_flag(value: bool) -> None:
    """Set what :func:`compiling_flag` reads."""
    torch.compiler._is_compiling_flag = value


# --- Autocast ------------------------------------------------------------------------------------

# Is autocast on for any device? (one C call: checked on every call of a compiled function)
any_autocast_enabled = torch._C._is_any_autocast_enabled
# The devices autocast has a state for.
autocast_supported_devices = torch._C._autocast_supported_devices

# --- Guards, Dynamo and Inductor -----------------------------------------------------------------

# Dynamo's C++ tensor check: the per-call fast path of the cache (Note [The last entry]).
TensorGuards = _guards.TensorGuards
# Graph node metadata Dynamo writes on the graphs it hands a backend.
DYNAMO_EXAMPLE_VALUE = "example_value"  # the placeholder's fake value
DYNAMO_GRAPH_ARG = "grapharg"  # where the placeholder's value came from (``.source``)
# The calls Dynamo's graph makes for a ``with`` block that changes global state
# (Note [Grad-mode regions in Dynamo's graph]): grad mode set, and contexts entered
# (the call returns the context) and exited (the call takes it).
DYNAMO_SET_GRAD_ENABLED = torch._C._set_grad_enabled
DYNAMO_ENTERS = (torch.autograd.grad_mode._enter_inference_mode, torch.amp._enter_autocast)
DYNAMO_EXITS = (torch.autograd.grad_mode._exit_inference_mode, torch.amp._exit_autocast)


def dynamo_compile_lock() -> Any:
    """The lock Dynamo holds while it compiles a frame (a re-entrant lock); a null context
    when Dynamo was never imported: then nothing compiles (Note [Captures and other threads])."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is None:
        return contextlib.nullcontext()
    return convert_frame.compile_lock


# Note [The graphs Dynamo holds]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.compile(model, backend=...)`` keeps no list of the graphs its backend
# compiled: Dynamo caches them on the *code* it compiled (``type(model).forward``,
# a function's own code), one cache entry per guard set, each entry a bytecode that
# calls its graph's compiled function by a name in the frame's globals
# (``__compiled_fn_3_<uuid>``), wrapped by ``torch.compiler.disable``; a graph
# break adds a resume function (``__resume_at_30_4``) with cache entries of its
# own (for a frame with closure cells, a factory ``_make_fn`` holding its code),
# run with the frame's globals. Entries live on the code, so instances of one
# class share them (a second ``torch.compile(Model())`` reuses the first one's
# graphs when its guards pass; a torch.nn module compiled itself runs through
# Dynamo's ``wrap_inline``, whose one code all such modules share): what
# ``aotgrad.cache_info`` sums is every graph Dynamo holds for that code::
#
#     forward's code ─ entry ─ __compiled_fn_1 ─ aotgrad's AOTFunction (graph 0)
#                    └ entry ─ __compiled_fn_5 ─ AOTFunction (graph 2: a recompile)
#                              __resume_at_30_2 ─ entry ─ __compiled_fn_3 (graph 1)
#
# ``dynamo_compiled_functions`` walks that, oldest entry first.


def dynamo_compiled_functions(obj: Any) -> list[Any] | None:
    """What Dynamo's backend returned for each graph it compiled from ``obj``'s code (a
    ``torch.compile`` result, or a module after ``module.compile()``), oldest first; None
    when ``obj`` is neither (Note [The graphs Dynamo holds])."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return None
    from torch._dynamo.eval_frame import OptimizedModule, _debug_get_cache_entry_list

    if isinstance(obj, OptimizedModule):
        roots: list[Any] = [obj.forward, obj._orig_mod.forward]
    elif isinstance(obj, torch.nn.Module) and getattr(obj, "_compiled_call_impl", None):
        roots = [obj.forward]
    elif callable(obj) and hasattr(obj, "_torchdynamo_orig_callable"):
        roots = [obj, obj._torchdynamo_orig_callable]
    else:
        return None
    todo = [(f.__code__, f.__globals__) for root in roots for f in _functions_within(root, 4)]
    found: dict[int, Any] = {}
    seen: set[Any] = set()
    while todo:
        code, names = todo.pop(0)
        if code in seen:
            continue
        seen.add(code)
        for entry in reversed(_debug_get_cache_entry_list(code)):  # newest first: reversed
            for name in entry.code.co_names:
                value = names.get(name)
                if name.startswith("__compiled_fn") and value is not None:
                    found.setdefault(id(value), _unwrapped(value))
                elif name.startswith("__resume_at") and isinstance(value, types.FunctionType):
                    todo += [(c, names) for c in _resume_codes(value)]  # the frame's globals
    return list(found.values())


def _resume_codes(function: types.FunctionType) -> list[types.CodeType]:
    """The code of a resume function; one that needs closure cells is a factory making it
    (``_make_fn``), holding the code in a cell or among its constants."""
    cells = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            cells.append(cell.cell_contents)
    within = [*cells, *function.__code__.co_consts]
    return [function.__code__, *(c for c in within if isinstance(c, types.CodeType))]


def _functions_within(value: Any, depth: int) -> Iterator[types.FunctionType]:
    """``value`` and the functions it wraps (``__wrapped__``, closure cells): where Dynamo's
    own wrappers (``wrap_inline`` around a torch.nn module's forward) keep the code it
    compiled."""
    value = getattr(value, "__func__", value)  # a bound method's function
    if depth < 0 or not isinstance(value, types.FunctionType):
        return
    yield value
    inner = [getattr(value, "__wrapped__", None)]
    for cell in value.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            inner.append(cell.cell_contents)
    for each in inner:
        yield from _functions_within(each, depth - 1)


def _unwrapped(value: Any) -> Any:
    """The backend's own callable inside ``torch.compiler.disable``'s wrapper functions."""
    while isinstance(value, types.FunctionType) and hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value


# Note [What loads Dynamo]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# ``import torch._dynamo`` is slow (sympy, FSDP, DTensor and Inductor's
# utilities come with it): more than ``import aotgrad`` and a small capture
# together (bench/findings.md, 2026-12-07). ``import aotgrad`` never loads it (tests/test_import_weight.py). The
# first capture in a process does, through PyTorch itself, on every supported
# release: ``FakeTensorMode()`` reads ``torch._dynamo.config``, and each
# ``__torch_dispatch__`` of a dispatch mode, like each reference with a
# type-promotion wrapper, is ``torch._disable_dynamo``-wrapped, which imports
# Dynamo at its first call. So a process's first gradient pays for Dynamo with
# aotgrad as with PyTorch's AOTAutograd (whose import loads it); aotgrad adds no
# other load of it. ``@torch.compiler.disable`` imports Dynamo where it
# decorates: aotgrad's entry points that Dynamo must not trace into use
# ``compiler_disabled``, which marks the function as Dynamo's decorator does
# (all a Dynamo tracing a caller reads: it graph-breaks and calls the
# function) and installs the real disable, recursive into what the function
# calls, at the first call made while Dynamo is loaded::
#
#     import aotgrad                         Dynamo not loaded
#     torch.compile(model_calling_scan)(x)   Dynamo loaded by torch.compile: the trace
#                                            breaks at scan, which runs disabled
#
# A process that has not loaded Dynamo has no frame Dynamo could be tracing.


def compiler_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, without importing Dynamo before Dynamo is in use."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call


def local_source(name: str) -> Any:
    """Dynamo's source for a local variable: shape guards are rendered over ``L[name]``."""
    from torch._dynamo.source import LocalSource

    return LocalSource(name)


def decomposition(op: Any) -> Callable[..., Any] | None:
    """PyTorch's Python decomposition of ``op`` into other aten ops, if it has one."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


def all_decompositions() -> Mapping[Any, Callable[..., Any]]:
    """Every Python decomposition PyTorch registers (``torch._decomp.decomposition_table``),
    Core ATen or not: what a ``core_aten`` capture falls back to for ops the Core ATen table
    leaves out (Note [Core ATen graphs])."""
    from torch._decomp import decomposition_table

    return decomposition_table


def inductor_decompositions() -> Mapping[Any, Callable[..., Any]]:
    """Inductor's decomposition table: graphs are re-traced with it before compiling."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, example_inputs: list[Any], fake_mode: Any) -> Any:
    """Compile a decomposed graph with Inductor, inside the tracing context it expects."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    with tracing(TracingContext(fake_mode)):
        return compile_fx_inner(gm, example_inputs)


# --- Module hooks and pytree internals -----------------------------------------------------------


# The hook dicts of an ``nn.Module``, each named as a module's attribute (``vars(module)``) and,
# prefixed ``_global``, as the global one every module call runs (``global_module_hooks``).
MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def global_module_hooks(kind: str) -> dict[int, Any]:
    """The hooks every module call runs, of one kind (``"_forward_hooks"``; Note [Module hooks])."""
    return getattr(_nn_module, f"_global{kind}")


def pytree_node_type(value: Any) -> Any:
    """The type pytree flattens ``value`` as (a namedtuple's is ``namedtuple``)."""
    return pytree._get_node_type(value)


def size_hint(value: int | torch.SymInt) -> int | None:
    """The value a symbolic size had in the example inputs (an int is its own), or None."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return None if hint is None else int(hint)
    return int(value)


def symbol_hints(value: torch.SymInt) -> dict[str, int]:
    """The example values of the symbols in ``value``'s expression, by name (``{"s0": 8}``).

    ``backed_var_to_val`` is the name since torch 2.13 (``var_to_val`` before, deprecated there).
    """
    env = value.node.shape_env
    known = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    return {str(s): int(known[s]) for s in value.node.expr.free_symbols if s in known}


# --- Error messages and names aotgrad recognises by their text -----------------------------------

# Functionalization refusing to write a traced value into a real tensor: the function mutates a
# tensor it does not take as an argument.
NON_FUNCTIONAL_MUTATION = "mutating a non-functional tensor with a functional tensor"
# A C++ kernel reading the data of a fake tensor (a host read no fake kernel covers).
DATA_NOT_ALLOCATED = "data is not allocated yet"
# An op ordered by an effect token (``aten._print``); the message ends with the op's name.
EFFECT_TOKEN_MISSING = "Could not find a token for effect"
# torch's own invariant failing (``TORCH_INTERNAL_ASSERT``), not the user's error.
INTERNAL_ASSERT = "INTERNAL ASSERT FAILED"
# An op with no meta kernel or fake implementation run on fake tensors (NotImplementedError).
NO_META_KERNEL = "attempted to run this operator with Meta tensors"
# A reentrant checkpoint refusing ``autograd.grad`` (Note [Reentrant checkpoints]).
REENTRANT_CHECKPOINT_GRAD = "incompatible with .grad()"
# A ``torch.library.custom_op`` without ``register_fake`` run on fake tensors (RuntimeError).
NO_FAKE_IMPL = "no fake impl registered"
# ``.numpy()`` (also ``np.asarray(t)``, ``np.array(t)``) of a tensor of the trace.
NUMPY_OF_TRACED = ".numpy() is not supported for tensor subclasses"


def effect_token_op(message: str) -> str:
    """The op an :data:`EFFECT_TOKEN_MISSING` message names (its last word)."""
    return message.rsplit(" ", 1)[-1]


def traceback_name(function: Callable[..., Any]) -> str:
    """A Python function as a failed capture's traceback names it: ``module.function``."""
    return f"{function.__globals__['__name__']}.{function.__code__.co_name}"


# Torch functions a failed capture's traceback may end in, by that name.
TENSOR_BACKWARD = traceback_name(torch.Tensor.backward)  # "torch._tensor.backward"
ENGINE_RUN_BACKWARD = traceback_name(engine_run_backward)  # what autograd.grad runs


# --- torch.distributed ---------------------------------------------------------------------------


def resolve_process_group(group_name: str) -> Any:
    """The ``ProcessGroup`` a functional collective's ``group_name`` argument names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # type: ignore[arg-type]


def default_store() -> Any:
    """The key-value store of the default process group (``init_process_group``'s rendezvous)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# How autograd's fallback names an op with no autograd kernel that a gradient flows through
# (a warning: "may lead to silently incorrect behavior"); the op's name comes first.
NO_AUTOGRAD_KERNEL = "an autograd kernel was not registered to the Autograd key"


# --- Compiled functions --------------------------------------------------------------------------

# Marks a compiled function that takes its inputs as one list (``f(args)``, "boxed"), so it may
# free them early: Inductor's output carries it, and torch's backends and aotgrad read it.
BOXED_CALL = "_boxed_call"


def mark_boxed(f: Callable[..., Any]) -> None:
    """Mark ``f`` as taking one list argument (:data:`BOXED_CALL`)."""
    setattr(f, BOXED_CALL, True)


def is_boxed(f: object) -> bool:
    """Does ``f`` take one list argument (:data:`BOXED_CALL`)?"""
    return bool(getattr(f, BOXED_CALL, False))


# --- Distributed wrappers: DDP and FSDP2 (Note [Wrappers run around the graphs]) ----------------

# DDP's forward is ``_pre_forward`` (prepare the reducer, sync buffers, move inputs), the wrapped
# module, then ``_post_forward`` (``prepare_for_backward``): aotgrad runs both around its graphs.


def ddp_pre_forward(ddp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What DDP's forward runs before the wrapped module: ``(args, kwargs)`` for it."""
    return ddp._pre_forward(*args, **kwargs)


def ddp_post_forward(ddp: Any, output: Any) -> Any:
    """What DDP's forward runs after the wrapped module, on its output."""
    return ddp._post_forward(output)


def ddp_modes(ddp: Any) -> dict[str, bool]:
    """The DDP configurations that change what its forward does, by aotgrad's name for them."""
    return {
        "the Python reducer (compiled autograd)": bool(ddp._use_python_reducer),
        "delayed all-reduce of all parameters": bool(ddp._delay_all_reduce_all_params),
        "DDP mixed precision": ddp.mixed_precision is not None,
    }


def fsdp_state(module: Any) -> Any:
    """The ``FSDPState`` of a ``fully_shard`` module (None for other modules)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    return _get_module_fsdp_state(module)


def fsdp_state_modules(state: Any) -> tuple[Any, ...]:
    """The modules one ``fully_shard`` call made into a unit (two or more: a grouped call)."""
    return tuple(state._modules)


def fsdp_all_states(root_state: Any) -> list[Any]:
    """Every unit's state under the root, root first (filled by the root's first forward)."""
    return list(root_state._state_ctx.all_states)


def fsdp_pre_forward(state: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A unit's forward pre-hook: all-gather its parameters; the root's lazy init on first use."""
    return state._pre_forward(module, args, kwargs)


def fsdp_post_forward(state: Any, module: Any, output: Any) -> Any:
    """A unit's forward hook: reshard, and register its pre-backward hook on ``output``."""
    return state._post_forward(module, (), output)


def fsdp_mixed_precision(state: Any) -> Any:
    """The unit's ``MixedPrecisionPolicy``."""
    return state._mp_policy


def fsdp_pause_hooks(states: list[Any]) -> list[Any]:
    """Make the units' forward hooks no-ops (they see the state activation checkpointing's
    recompute sets: parameters already unsharded); returns what ``fsdp_resume_hooks`` takes."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    before = [state._training_state for state in states]
    for state in states:
        state._training_state = TrainingState.PRE_BACKWARD
    return before


def fsdp_resume_hooks(states: list[Any], before: list[Any]) -> None:
    """Undo ``fsdp_pause_hooks``."""
    for state, training_state in zip(states, before, strict=True):
        state._training_state = training_state


def fsdp_param_groups(state: Any) -> list[Any]:
    """The unit's ``FSDPParamGroup``s (torch 2.11 keeps at most one, ``_fsdp_param_group``)."""
    if TORCH_RELEASE < (2, 12):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    return list(state._fsdp_param_groups)


def fsdp_start_all_gathers(states: list[Any], backward: bool) -> None:
    """Start the all-gathers of the idle parameter groups of ``states`` without waiting, as
    ``FSDPModule.unshard(async_op=True)`` does: each unit's own pre-forward (``backward=False``)
    or pre-backward hook waits for its group and copies the parameters out (Note [All-gathers in
    flight together]). In the backward, groups FSDP does not unshard there
    (``set_unshard_in_backward(False)``) are left alone; groups already all-gathered, or in
    flight, are no-ops in FSDP's ``unshard``. Only on CPU: on a GPU, FSDP all-gathers on its
    own streams (ordered after the optimizer, ``set_post_optim_event`` included) without
    blocking the CPU, and an ``async_op`` gather would run on the current stream instead."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for state in states:
        for group in fsdp_param_groups(state):
            if group.device.type != "cpu" or group._training_state != TrainingState.IDLE:
                continue  # FSDP is using it: its own hook unshards it, or has
            if backward and not group.unshard_in_backward:
                continue
            group.unshard(async_op=True)


def fsdp_pre_backward_hooked(tensor: torch.Tensor, states: list[Any]) -> list[Any]:
    """The units among ``states`` whose pre-backward hook (``FSDPState._pre_backward``, put there
    by ``Tensor.register_hook`` in the unit's post-forward) is on ``tensor``, in the order the
    hooks run (the order they were registered)."""
    hooks = list((tensor._backward_hooks or {}).values())
    return [state for hook in hooks for state in states if hook == state._pre_backward]


def prepend_tensor_hook(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``tensor.register_hook(hook)``, run before the hooks registered on it already.

    A tensor's hooks run in the insertion order of its ``_backward_hooks`` (a dict by handle
    id that its ``grad_fn`` holds, and ``RemovableHandle.remove`` deletes from by key; the C++
    engine walks it as a plain dict, so ``OrderedDict.move_to_end`` would not reorder it): the
    same dict, refilled with the new hook first, changes the order and nothing else.
    """
    handle = tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    assert hooks is not None, "expected the hooks dict register_hook made, got None"
    before = [(key, value) for key, value in hooks.items() if key != handle.id]
    hooks.clear()
    hooks[handle.id] = hook
    hooks.update(before)


def is_fsdp_bookkeeping(value: Any) -> bool:
    """Is this module attribute FSDP2's per-module state (``{fully_shard: FSDPState}``, stored
    under a generated ``__composable_api_state_key_...`` name)? Never for a non-dict: the module
    read asks only about dicts (Note [Reading a module, fast])."""
    if not isinstance(value, dict) or not value or "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return all(isinstance(state, FSDPState) for state in value.values())


def profiler_memory_events(prof: Any) -> list[tuple[int, int, str]]:
    """``(start_ns, bytes, device type)`` of each allocation (+) and free (-) that a
    ``torch.profiler.profile(profile_memory=True)`` recorded, in the order they happened."""
    events = [
        (event.start_ns(), event.nbytes(), str(event.device_type()).rsplit(".", 1)[-1].lower())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    ]
    return sorted(events, key=lambda event: event[0])


# A layout autograd's ``AccumulateGrad`` holds a ``.grad`` to (strides or contiguity): on
# fake tensors too, where ``Tensor.is_non_overlapping_and_dense`` does not exist.
is_non_overlapping_and_dense = _prims_common.is_non_overlapping_and_dense_or_false
