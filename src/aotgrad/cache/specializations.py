"""Specializations of a compiled function: one cache of compiled entries, and why each call missed.

An ``AOTFunction`` keeps one compiled entry per :class:`CacheKey`: the call's
structure, every tensor's metadata (type, shape, stride, storage offset,
dtype, device, requires_grad, layout), every non-tensor value, the dynamic
dimensions, the module state's and closed-over tensors' metadata, the values
of the globals, closure variables and module attributes the function reads
(train/eval flags included), which inputs alias, and the ambient torch state a
trace bakes in (grad mode, autocast, the default dtype: Note [Ambient state]).
An entry whose trace read environment variables also guards on their values
(Note [Environment read at capture]).
A call whose key matches an entry is a hit; otherwise aotgrad traces again
and records, for the miss, the first field that differs from the latest
entry's key, as ``what: that entry's != this call's``::

    >>> import torch, aotgrad
    >>> f = aotgrad.aot_function(lambda x: x.sin())
    >>> _ = f(torch.ones(4, 8)); _ = f(torch.ones(4, 8)); _ = f(torch.ones(4, 16))
    >>> info = aotgrad.cache_info(f)
    >>> info.hits, info.misses, info.reasons[-1]
    (1, 2, 'input x: shape (4, 8) != (4, 16)')
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch

from aotgrad import _torch_compat as compat
from aotgrad.capture.analyses.autocast import AutocastState, any_autocast, autocast_state
from aotgrad.capture.analyses.dynamic import DynamicDims, static_where_shared
from aotgrad.capture.tracing.session import SESSIONS, capturing
from aotgrad.capture.user_state.environ import EnvironReads
from aotgrad.capture.user_state.side_effects import Replay
from aotgrad.runtime import CompiledGraphs
from aotgrad.runtime.transforms import transform_active
from aotgrad.signature import FlatInputs, PlainTensorsGuard, alias_key, call_key, dynamic_call_key
from aotgrad.signature.flatten import (
    DYNAMIC_TENSOR_FIELDS,
    TENSOR_FIELDS,
    flatten_call,
    is_tensor_key,
)
from aotgrad.signature.lifting import Arguments, Lifted, State, StateKey, module_arguments


@dataclass
class CacheInfo:
    """What a compiled function's cache did so far."""

    hits: int = 0
    misses: int = 0
    # One reason per miss, in order: "first call", "input x: shape (4, 8) != (4, 16)", ...
    reasons: list[str] = field(default_factory=list)
    # Calls that ran eagerly because the cache was full.
    fallbacks: int = 0
    # Calls that ran the function itself under a torch.func transform or forward-mode AD
    # (Note [Transforms run the function]).
    transform_runs: int = 0
    # Calls with dual arguments, run through a compiled JVP body (Note [Forward mode captures
    # a JVP graph]).
    jvp_runs: int = 0
    # Why the latest dual call's JVP body could not be captured (it ran the function); None
    # when it could.
    jvp_skipped: str | None = None
    entries: int = 0
    # Misses the disk cache served (no trace), and misses it did not (traced, then written:
    # Note [The disk cache]).
    disk_hits: int = 0
    disk_misses: int = 0
    # Why the latest miss was not looked up or written on disk ("AOTGRAD_CACHE=0", "a
    # partial has no stable key ...": Note [Disk cache keys]); None when it was.
    disk_skipped: str | None = None
    # Differentiable backwards captured for create_graph=True, every order counted, and
    # backwards that ran another way (none do: Note [Differentiable backward]).
    create_graph_captures: int = 0
    create_graph_fallbacks: int = 0
    # How many compiled functions this counts: one, but for a torch.compile'd model, which
    # has one per graph Dynamo compiled (a graph break or a Dynamo recompile adds one).
    graphs: int = 1

    @classmethod
    def combined(cls, infos: Sequence[CacheInfo]) -> CacheInfo:
        """Several compiled functions' counts summed; each miss reason says its graph."""
        total = cls(graphs=len(infos))
        counts = [f.name for f in fields(cls) if f.type == "int" and f.name != "graphs"]
        for i, info in enumerate(infos):
            for name in counts:
                setattr(total, name, getattr(total, name) + getattr(info, name))
            total.reasons += [f"graph {i}: {reason}" for reason in info.reasons]
            total.jvp_skipped = info.jvp_skipped or total.jvp_skipped
            total.disk_skipped = info.disk_skipped or total.disk_skipped
        return total

    def __str__(self) -> str:
        lines = [] if self.graphs == 1 else [f"{self.graphs} graphs compiled by Dynamo"]
        lines += [
            f"{self.hits} hits, {self.misses} misses, {self.entries} entries, {self.fallbacks} eager fallbacks",
            f"{self.transform_runs} calls under torch.func transforms or forward-mode AD,"
            f" {self.jvp_runs} through a JVP graph",
            f"disk: {self.disk_hits} hits, {self.disk_misses} misses"
            + (f" (not cached: {self.disk_skipped})" if self.disk_skipped else ""),
        ]
        if self.create_graph_captures or self.create_graph_fallbacks:
            lines.append(
                f"create_graph: {self.create_graph_captures} backward captures,"
                f" {self.create_graph_fallbacks} fallbacks"
            )
        if self.jvp_skipped:
            lines.append(f"last JVP graph not captured: {self.jvp_skipped.splitlines()[0]}")
        lines += [f"  miss {i}: {reason}" for i, reason in enumerate(self.reasons)]
        return "\n".join(lines)


def cache_info(fn: Any) -> CacheInfo:
    """The :class:`CacheInfo` of what any aotgrad frontend returned: ``aot_function``,
    ``aot_module``, ``trace`` (one specialization, no cache), ``scan_function`` /
    ``scan_layers_function`` (the body's captures), and a model or
    function compiled by ``torch.compile`` with aotgrad as its backend (every graph Dynamo
    compiled from its code, summed: Note [The graphs Dynamo holds] in ``_torch_compat.py``).

    >>> import torch, aotgrad
    >>> model = torch.compile(torch.nn.Linear(3, 2), backend=aotgrad.backend())
    >>> _ = model(torch.ones(4, 3)); _ = model(torch.ones(4, 3))
    >>> info = aotgrad.cache_info(model)
    >>> info.graphs, info.hits, info.misses, info.reasons
    (1, 1, 1, ['graph 0: first call'])
    """
    info = _info_of(fn)
    if info is not None:
        return info
    compiled = compat.dynamo_compiled_functions(fn)
    if compiled is None:
        raise TypeError(
            "aotgrad.cache_info takes what an aotgrad frontend returned (aot_function,"
            " aot_module, trace, scan_function, or torch.compile with an aotgrad"
            f" backend), got {type(fn).__name__}; for aotgrad.scan(fn, ...), pass"
            " aotgrad.scan_function(fn) with the same options"
        )
    infos = [_info_of(f) for f in compiled]
    mine = [i for i in infos if i is not None]
    if infos and not mine:
        raise TypeError(
            f"the {len(infos)} graph(s) torch.compile compiled for this {type(fn).__name__}"
            " were compiled by another backend, not aotgrad's"
        )
    return CacheInfo.combined(mine)


def _info_of(fn: Any) -> CacheInfo | None:
    """``fn.info`` (an AOTModule's: its AOTFunction's), if it is a :class:`CacheInfo`."""
    info = getattr(getattr(fn, "compiled", fn), "info", None)
    return info if isinstance(info, CacheInfo) else None


# Note [Ambient state]
# ~~~~~~~~~~~~~~~~~~~~
# Some global torch state changes what the same call computes, and a trace bakes
# it in: grad mode (whether a backward is built), autocast (which ops run in
# lower precision), the default dtype (what ``torch.ones(2)`` makes) and the
# torch settings that choose which ops are traced (Note [Torch settings in the
# key]). It is part of every key, in memory and on disk (the disk key holds the
# ``CacheKey``). The common state is cheap to key: grad mode alone (examples:
# ``ambient_key``). So a function first called outside ``torch.autocast`` traces
# again when called inside it, instead of returning float32 results where eager
# gives bfloat16, and the miss says ``autocast off != cpu/bfloat16``.


# Note [Torch settings in the key]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some global torch settings are read while the function runs, by torch's
# Python or by composite (decomposed at trace) C++ ops, and choose which aten
# ops the trace records: the graph then holds that choice for every later call.
# Those are part of the key; ``SETTINGS`` is the one list the in-memory key and
# the disk key both read (``ambient_key``). Under ``sdpa_kernel(SDPBackend.MATH)``
# a function first traced with the defaults traces again, and its graph holds
# the math decomposition (``bmm``, ``_safe_softmax``) instead of
# ``_scaled_dot_product_flash_attention_for_cpu``, as eager runs::
#
#     name               set by                                   what it chooses at trace
#     flash_sdp          enable_flash_sdp, sdpa_kernel            scaled_dot_product_attention's
#     mem_efficient_sdp  enable_mem_efficient_sdp, sdpa_kernel      fused kernel, or its math
#     math_sdp           enable_math_sdp, sdpa_kernel               decomposition
#     cudnn_sdp          enable_cudnn_sdp, sdpa_kernel              (aten::_fused_sdp_choice,
#     overrideable_sdp   sdpa_kernel(SDPBackend.OVERRIDEABLE)        CPU and CUDA)
#     sdp_priority       sdpa_kernel(..., set_priority=True)      the order the above are tried
#     math_sdp_reduction allow_fp16_bf16_reduction_math_sdp       the math decomposition's upcast
#     deterministic      torch.use_deterministic_algorithms       decompositions (max-pool backward)
#                                                                 and F.* paths (CUDA pooling,
#                                                                 interpolate) taken at trace
#     cudnn              torch.backends.cudnn.enabled             F.batch_norm / layer_norm /
#                                                                 group_norm's cudnn ops, RNNs (CUDA)
#     mkldnn             torch.backends.mkldnn.enabled            the LSTM decomposition's
#                                                                 mkldnn_rnn_layer (CPU)
#     mha_fastpath       torch.backends.mha.set_fastpath_enabled  nn.MultiheadAttention and
#                                                                 TransformerEncoderLayer's fused op
#     opt_einsum         torch.backends.opt_einsum.enabled        einsum's contraction order
#     opt_einsum_strategy torch.backends.opt_einsum.strategy        (which bmm s, in what order)
#     default_device     with torch.device(d), set_default_device   the device of factory ops'
#                                                                 results (torch.arange(3))
#
# On CUDA (seen on an H200, torch 2.11, float16 attention): the defaults traced
# ``_scaled_dot_product_cudnn_attention``; FLASH_ATTENTION, EFFICIENT_ATTENTION and
# MATH each traced their own op, MATH with an upcast that ``math_sdp_reduction``
# drops; a priority of EFFICIENT before FLASH traced the efficient op;
# ``cudnn.enabled = False`` traced ``native_batch_norm`` for ``cudnn_batch_norm``;
# deterministic mode traced bilinear ``interpolate`` as its decomposition. On CPU
# the defaults trace ``_scaled_dot_product_flash_attention_for_cpu`` and MATH the
# decomposition. Where ``opt_einsum`` is installed its default is ``(True, "auto")``,
# not ``DEFAULT_SETTINGS``'s: such a process keys every call with the full tuple.
#
# Not in the key, because the traced op is the same and torch picks the kernel
# when the graph runs, reading the setting then, as eager does: TF32
# (``backends.cuda.matmul.allow_tf32``, ``backends.cudnn.allow_tf32``),
# ``set_float32_matmul_precision``, reduced-precision reductions,
# ``cudnn.benchmark`` and ``cudnn.deterministic``, nnpack, the preferred BLAS
# and linalg libraries, ``fill_uninitialized_memory``; and anomaly mode, which
# checks values when the backward runs and records no op.
#
# Environment variables the user's code reads at capture are not settings of
# this list (no key made before the trace can name them): each entry guards on
# the ones its trace read (Note [Environment read at capture]).


def _default_device() -> torch.device | None:
    """The device ``with torch.device(d)`` or ``torch.set_default_device(d)`` set; None when
    neither did. Both push a ``DeviceContext`` mode (only the second sets
    ``torch.utils._device.CURRENT_DEVICE``); ``torch.get_default_device()`` finds it too,
    more slowly (bench/findings.md)."""
    for i in range(compat.function_mode_count()):
        mode = compat.function_mode_at(i)
        if isinstance(mode, compat.DeviceContext):
            return mode.device
    return None


SETTINGS: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("flash_sdp", compat.flash_sdp_enabled),
    ("mem_efficient_sdp", compat.mem_efficient_sdp_enabled),
    ("math_sdp", compat.math_sdp_enabled),
    ("cudnn_sdp", compat.cudnn_sdp_enabled),
    ("overrideable_sdp", compat.overrideable_sdp_enabled),
    ("sdp_priority", lambda: tuple(compat.sdp_priority_order())),
    ("math_sdp_reduction", compat.math_sdp_allows_reduction),
    ("deterministic", compat.deterministic_algorithms),
    ("cudnn", compat.cudnn_enabled),
    ("mkldnn", compat.mkldnn_enabled),
    ("mha_fastpath", torch.backends.mha.get_fastpath_enabled),
    ("opt_einsum", compat.opt_einsum_enabled),
    ("opt_einsum_strategy", compat.opt_einsum_strategy),
    ("default_device", _default_device),
)
_READ_SETTINGS = tuple(read for _, read in SETTINGS)
# torch's defaults: a constant, not what this process saw at import, so one state has
# one key in every process (the disk key).
DEFAULT_SETTINGS: tuple[Any, ...] = (
    *(True, True, True, True, True),
    (1, 2, 0, 3, 4),
    *(False, False, True, True, True, False, None),
    None,
)


def torch_settings() -> tuple[Any, ...]:
    """The values of ``SETTINGS`` (Note [Torch settings in the key])."""
    return tuple(map(operator.call, _READ_SETTINGS))  # no Python loop: on every call's key


def ambient_key() -> Any:
    """The ambient torch state a trace depends on (Note [Ambient state]).

    >>> ambient_key()
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     ambient_key()[:3]
    (True, torch.float32, (('cpu', torch.bfloat16),))
    >>> _ambient_change(True, (True, torch.float32, (("cpu", torch.bfloat16),), DEFAULT_SETTINGS))
    'autocast off != cpu/bfloat16'
    >>> from torch.nn.attention import sdpa_kernel, SDPBackend
    >>> with sdpa_kernel(SDPBackend.MATH):
    ...     _ambient_change(True, ambient_key())
    'torch setting flash_sdp True != False'
    """
    grad = torch.is_grad_enabled()
    settings = torch_settings()
    dtype = torch.get_default_dtype()
    if dtype is torch.float32 and not any_autocast() and settings == DEFAULT_SETTINGS:
        return grad
    return (grad, dtype, autocast_state(), settings)


# Note [The common state, checked fast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Nearly every call runs in torch's default state: no capture in this thread
# (no session open, no function mode: Note [Captures and other threads]; so no
# default device either), no torch.func transform or forward-AD level, float32
# as the default dtype, no autocast, every setting of ``SETTINGS`` at its
# default. There ``ambient_key()`` is the grad mode alone, and
# ``common_state()`` says so in one frame: a chain of comparisons written out
# from ``SETTINGS`` and ``DEFAULT_SETTINGS`` when this module loads (a loop, or
# the tuple ``torch_settings`` builds, costs more on every call: ``python
# bench/overhead.py steps``; bench/findings.md). Generated from the one list, it
# cannot miss a setting added to it::
#
#     def common_state():
#         return (
#             sessions.depth == 0 and function_mode_count() == 0
#             and not functorch_or_forward_ad_active()
#             and get_default_dtype() is float32 and not any_autocast()
#             and read_0() is True   # flash_sdp
#             ...
#             and read_5() == default_5   # sdp_priority
#             ...
#         )
#
# ``default_device`` needs no term: with no function mode there is none. The
# check is sufficient, not necessary: False sends the call to the full key. A
# last entry keyed under another state (``no_grad``, autocast, a process where
# opt_einsum is installed: Note [Torch settings in the key]) compares the whole
# ``ambient_key()`` instead, after ``capturing()`` and ``transform_active()``.
def _common_state_check() -> Callable[[], bool]:
    names: dict[str, Any] = {
        "sessions": SESSIONS,
        "function_mode_count": compat.function_mode_count,
        "functorch_or_forward_ad_active": compat.functorch_or_forward_ad_active,
        "get_default_dtype": torch.get_default_dtype,
        "float32": torch.float32,
        "any_autocast": any_autocast,
    }
    terms = [
        "sessions.depth == 0",
        "function_mode_count() == 0",
        "not functorch_or_forward_ad_active()",
        "get_default_dtype() is float32",
        "not any_autocast()",
    ]
    for k, ((name, read), default) in enumerate(zip(SETTINGS, DEFAULT_SETTINGS, strict=True)):
        if read is _default_device:  # None whenever no function mode is active
            assert default is None, f"expected no default device by default, got {default}"
            continue
        names[f"read_{k}"], names[f"default_{k}"] = read, default
        same = "is" if default is None or type(default) is bool else "=="
        terms.append(f"read_{k}() {same} default_{k}  # {name}")
    source = (
        "def common_state():\n    return (\n        " + "\n        and ".join(terms) + "\n    )\n"
    )
    exec(compile(source, "<aotgrad common_state>", "exec"), names)
    return names["common_state"]


common_state = _common_state_check()


class CacheKey(NamedTuple):
    """What one call's trace is specialized on: equal keys share one compiled entry.

    A ``NamedTuple`` rather than a frozen dataclass: every call that the last
    entry does not serve (Note [The last entry]) builds one and hashes it. As
    frozen dataclasses (``__init__`` through ``object.__setattr__``, hashing and
    comparing in Python) this key and ``StateKey`` made such a call of a small
    module measurably slower (bench/findings.md). Fields are read by name only; build it with
    :meth:`of_call`, or by keyword.

    >>> import torch
    >>> from aotgrad.signature.lifting import NOTHING
    >>> x = torch.ones(4, 8)
    >>> key = CacheKey.of_call(structure=1, leaves=[x], dims=None, lifted=NOTHING)
    >>> key.leaves[0][1], key.dynamic_dims, key.aliases, key.ambient
    (torch.Size([4, 8]), None, None, True)
    >>> wider = CacheKey.of_call(structure=1, leaves=[torch.ones(4, 9)], dims=None, lifted=NOTHING)
    >>> wider.explain(key, names=["x"])
    'input x: shape (4, 8) != (4, 9)'
    >>> batch = CacheKey.of_call(structure=1, leaves=[x], dims=((0,),), lifted=NOTHING)
    >>> batch.explain(key, names=["x"])
    'input x: dynamic dimensions none != (0,)'
    """

    # The tree structure of ``(args, kwargs)``: a ``TreeSpec``, or the argument count
    # of a call of positional tensors and scalars (``flatten_call``).
    structure: Any
    # Per leaf: its tensor metadata (``call_key``, ``dynamic_call_key``) or value key
    # (Note [Keys of Python values]).
    leaves: tuple[Any, ...]
    # Per leaf, its dynamic dimensions, left out of ``leaves`` and checked by the
    # trace's shape guards; None when every size is static (Note [Dynamic shapes]).
    dynamic_dims: DynamicDims | None
    # The lifted module state, closed-over tensors and the Python values the function reads.
    state: StateKey
    # Which tensors (lifted, then leaves) are the same or share memory; None when none do.
    aliases: tuple[int, ...] | None
    # Grad mode, default dtype, autocast and torch settings (Note [Ambient state]).
    ambient: Any
    # The n-th trace under an otherwise equal key (Note [Entries with shape guards]).
    retrace: int = 0

    @staticmethod
    def of_call(
        *, structure: Any, leaves: Sequence[Any], dims: DynamicDims | None, lifted: Lifted
    ) -> CacheKey:
        """The key of a call: its leaves (``flatten_call``), dynamic dimensions and lifted state."""
        state = lifted.tensors
        aliases = alias_key([*state, *leaves] if state else leaves)
        if dims is not None and aliases is not None:
            dims = static_where_shared(leaves, dims, state)  # Note [Inputs that share memory]
        return CacheKey(
            structure=structure,
            leaves=call_key(leaves) if dims is None else dynamic_call_key(leaves, dims),
            dynamic_dims=dims,
            state=lifted.key,
            aliases=aliases,
            ambient=ambient_key(),
        )

    def explain(self, cached: CacheKey | None, names: Sequence[str] = ()) -> str:
        """Why this key is not ``cached``: the first field that differs, in the user's terms.

        Reads ``what: cached's != this key's``; ``names`` names the call's leaves
        (``leaf_names``; ``leaf i`` without). ``retrace`` is not compared: a
        trace under the same key is explained by the shape guard it failed.
        """
        if cached is None:
            return "first call"
        for name, explain in _FIELD_EXPLANATIONS.items():
            if getattr(cached, name) != getattr(self, name):
                reason = explain(cached, self, names)
                if reason is not None:
                    return reason
        return "no field of the key differs"


class KeyedCall(NamedTuple):
    """One call, read and keyed as every specialization is (:func:`keyed_call`)."""

    leaves: Sequence[Any]
    structure: Any
    # The modules among the arguments (Note [Module arguments]).
    arguments: Arguments
    # The module state, closed-over tensors and values the function reads.
    lifted: Lifted
    # The dimensions asked to be dynamic (``key.dynamic_dims`` leaves out those of inputs
    # that share memory: Note [Inputs that share memory]).
    dims: DynamicDims | None
    key: CacheKey


def keyed_call(
    target: Callable[..., Any],
    state: State,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: dict[Any, list[str]],
    dims: Callable[[Sequence[Any]], DynamicDims | None],
    flat: tuple[Sequence[Any], Any] | None = None,
) -> KeyedCall:
    """Read ``target(*args, **kwargs)`` and key it: its leaves and structure, the modules among
    them, the state it reads (``state``) and the :class:`CacheKey` of all of it, with the
    dimensions ``dims(leaves)`` dynamic; ``flat``: the call's ``flatten_call``, when the
    caller has it. ``aot_function`` keys each call here, and a ``Traced`` its capture and
    every call of it (Note [A Traced keeps to its capture]).

    >>> import torch
    >>> fn = lambda x: x.sin()
    >>> call = keyed_call(fn, State(fn), (torch.ones(2, 3),), {}, {}, lambda leaves: None)
    >>> call.key.leaves[0][1], call.lifted.tensors
    (torch.Size([2, 3]), ())
    """
    leaves, structure = flatten_call(args, kwargs) if flat is None else flat
    arguments = module_arguments(target, args, kwargs, leaves, structure, names)
    lifted = state.read(arguments)
    dynamic = dims(leaves)
    key = CacheKey.of_call(structure=structure, leaves=leaves, dims=dynamic, lifted=lifted)
    return KeyedCall(leaves, structure, arguments, lifted, dynamic, key)


def _show_structure(structure: Any) -> str:
    if isinstance(structure, int):  # a flat positional call (``flatten_call``)
        return f"{structure} positional argument{'s' * (structure != 1)}"
    return str(structure)


def _dims_change(old: CacheKey, new: CacheKey, names: Sequence[str]) -> str | None:
    count = len(new.leaves)
    before, after = old.dynamic_dims or ((),) * count, new.dynamic_dims or ((),) * count
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if a != b:
            return f"{_leaf_label(i, names)}: dynamic dimensions {_show_dims(a)} != {_show_dims(b)}"
    return None


def _show_dims(dims: tuple[int, ...]) -> str:
    return str(dims) if dims else "none"


def _leaves_change(old: CacheKey, new: CacheKey, names: Sequence[str]) -> str | None:
    dims = new.dynamic_dims or ()
    for i, (a, b) in enumerate(zip(old.leaves, new.leaves, strict=True)):
        if a != b:
            fields = DYNAMIC_TENSOR_FIELDS if i < len(dims) and dims[i] else TENSOR_FIELDS
            return f"{_leaf_label(i, names)}: {_leaf_change(a, b, fields)}"
    return None


def _leaf_label(i: int, names: Sequence[str]) -> str:
    return f"input {names[i]}" if i < len(names) else f"leaf {i}"


# The order a tensor's changed fields are told in: the one the user most likely changed
# first (a sparse tensor has no strides either; a transposed one has other strides too).
_FIELD_ORDER = (
    "type",
    "layout",
    "device",
    "dtype",
    "shape",
    "stride",
    "contiguous",
    "storage offset",
    "requires_grad",
)


def _leaf_change(old: Any, new: Any, fields: Sequence[str]) -> str:
    """A tensor's changed field (``shape (4, 8) != (4, 16)``), or the values."""
    if is_tensor_key(old) and is_tensor_key(new):
        changed = {f: (a, b) for f, a, b in zip(fields, old, new, strict=True) if a != b}
        if changed:
            label = min(changed, key=_FIELD_ORDER.index)
            a, b = changed[label]
            return f"{label} {_show(a)} != {_show(b)}"
    if is_tensor_key(old) or is_tensor_key(new):
        return f"{_show_leaf(old)} != {_show_leaf(new)}"
    return f"value {show_value(old)} != {show_value(new)}"


def _show_leaf(key: Any) -> str:
    if is_tensor_key(key):
        return f"a tensor of shape {_show(key[1])}"
    return f"value {show_value(key)}"


def _state_change(old: CacheKey, new: CacheKey, names: Sequence[str]) -> str | None:
    a, b = old.state, new.state
    if a.names != b.names:
        return f"lifted tensors changed: {_added_removed(a.names, b.names)}"
    for name, x, y in zip(b.names, a.tensors, b.tensors, strict=True):
        if x != y:
            return f"{name}: {_leaf_change(x, y, TENSOR_FIELDS)}"
    if a.labels != b.labels:
        return f"the values the function reads changed: {_added_removed(a.labels, b.labels)}"
    for label, x, y in zip(b.labels, a.values, b.values, strict=True):
        if x != y:
            change = f"{label}: value {show_value(x)} != {show_value(y)}"
            if label.endswith(".training"):
                return f"a module switched between train() and eval() ({change})"
            return change
    return None


def _added_removed(old: Sequence[str], new: Sequence[str]) -> str:
    added = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    return f"added {added or 'none'}, removed {removed or 'none'}"


def _sharing(key: CacheKey, names: Sequence[str]) -> str:
    """The inputs that share memory (``x and y``), from ``alias_key``'s storage groups."""
    if key.aliases is None:
        return "none (no views)"
    tensor_leaves = [i for i, leaf in enumerate(key.leaves) if is_tensor_key(leaf)]
    labels = [*key.state.names, *(_leaf_label(i, names) for i in tensor_leaves)]
    groups: dict[int, list[str]] = {}
    for label, group in zip(labels, key.aliases, strict=False):  # the storage half
        groups.setdefault(group, []).append(label.removeprefix("input "))
    shared = "; ".join(" and ".join(group) for group in groups.values() if len(group) > 1)
    return shared or "none (some views)"


def _ambient_change(old: Any, new: Any) -> str:
    """Which part of the ambient state differs, in the user's terms."""
    old_grad, old_dtype, old_autocast, old_settings = _ambient_parts(old)
    grad, dtype, autocast, settings = _ambient_parts(new)
    if grad != old_grad:
        return f"grad mode {old_grad} != {grad}"
    if dtype != old_dtype:
        return f"default dtype {old_dtype} != {dtype}"
    if autocast != old_autocast:
        return f"autocast {autocast_text(old_autocast)} != {autocast_text(autocast)}"
    for (name, _), a, b in zip(SETTINGS, old_settings, settings, strict=True):
        if a != b:  # Note [Torch settings in the key]
            return f"torch setting {name} {a} != {b}"
    return "no part of the ambient state differs"


def _ambient_parts(key: Any) -> tuple[bool, torch.dtype, AutocastState, tuple[Any, ...]]:
    return key if isinstance(key, tuple) else (key, torch.float32, (), DEFAULT_SETTINGS)


def autocast_text(state: AutocastState) -> str:
    """An autocast state as ``cpu/bfloat16``, or ``off``."""
    if not state:
        return "off"
    return ", ".join(f"{device}/{str(dtype).removeprefix('torch.')}" for device, dtype in state)


# By field, in the order ``CacheKey.explain`` tries them: each, called when its field
# differs, gives the reason (or None, and the next field is tried).
_FIELD_EXPLANATIONS: dict[str, Callable[[CacheKey, CacheKey, Sequence[str]], str | None]] = {
    "structure": lambda old, new, names: (
        f"argument structure changed: {_show_structure(old.structure)}"
        f" != {_show_structure(new.structure)}"
    ),
    "dynamic_dims": _dims_change,
    "leaves": _leaves_change,
    "state": _state_change,
    "aliases": lambda old, new, names: (
        f"inputs sharing memory: {_sharing(old, names)} != {_sharing(new, names)}"
    ),
    "ambient": lambda old, new, names: _ambient_change(old.ambient, new.ambient),
}


def show_value(key: Any) -> str:
    """A value key (Note [Keys of Python values]) as the value it stands for: ``-0.0``, ``True``."""
    if isinstance(key, tuple) and len(key) == 3 and key[0] == "module":  # ``module_key``
        return f"<{key[1].__module__}.{key[1].__qualname__} object at {key[2]:#x}>"
    if isinstance(key, tuple) and len(key) == 2:
        cls, value = key
        if cls is float and isinstance(value, str):
            return repr(float.fromhex(value))
        if cls in (int, bool, str, type(None)):
            return repr(value)
    text = str(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _show(value: Any) -> str:
    """A tensor field: sizes as a tuple, ``*`` for a dynamic size."""
    if isinstance(value, tuple) and all(isinstance(v, int) or v is None for v in value):
        sizes = ["*" if v is None else str(v) for v in value]
        return f"({sizes[0]},)" if len(sizes) == 1 else f"({', '.join(sizes)})"
    if isinstance(value, torch.Size):
        return str(tuple(value))
    if isinstance(value, type):
        return value.__qualname__
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One specialization's compiled graphs, and where their inputs come from in a call."""

    compiled: CompiledGraphs
    # Leaf position of each of the graphs' user inputs, after the lifted state; None when
    # the graphs' inputs are exactly the call's leaves (nothing lifted, every leaf a tensor).
    positions: tuple[int, ...] | None
    # The stores in the user's objects done after every call; the graphs return
    # ``(result, stored tensors)`` (Note [Side effects replayed]). None: none.
    replay: Replay | None = None
    # The environment variables the capture read: a call where one differs is a miss
    # (Note [Environment read at capture]). None: it read none.
    environ: EnvironReads | None = None

    @staticmethod
    def of(
        compiled: CompiledGraphs,
        flat: FlatInputs,
        *,
        lifted: bool,
        replay: Replay | None,
        environ: EnvironReads | None,
    ) -> Entry:
        """The entry of graphs traced for ``flat`` (``lifted``: module state or closed-over
        tensors come before the call's), for ``aot_function`` and ``Traced`` alike."""
        positions = flat.tensor_positions
        exact = not lifted and positions == tuple(range(len(flat.constants)))
        return Entry(
            compiled=compiled,
            positions=None if exact else positions,
            replay=replay,
            environ=environ,
        )

    def inputs(self, state: tuple[torch.Tensor, ...], leaves: Sequence[Any]) -> Sequence[Any]:
        """The graphs' inputs for a call: the lifted state, then the tensor leaves."""
        positions = self.positions
        return leaves if positions is None else [*state, *map(leaves.__getitem__, positions)]

    def __call__(self, state: tuple[torch.Tensor, ...], leaves: Sequence[Any]) -> Any:
        positions = self.positions  # ``inputs``, inlined: this runs on every call
        out = self.compiled(
            leaves if positions is None else [*state, *map(leaves.__getitem__, positions)]
        )
        return out if self.replay is None else self.replay(out)


@dataclass(frozen=True, kw_only=True)
class Miss:
    """A call no entry serves: the key to store its trace under, and the guard that failed."""

    key: CacheKey
    # Why the entries under an equal key did not serve the call: the first shape guard
    # or environment variable that failed (Note [Entries with shape guards]); None when
    # no entry has an equal key.
    failed: str | None = None


# Note [The last entry]
# ~~~~~~~~~~~~~~~~~~~~~
# Most callers call with the same kinds of tensors every time. After a cache
# hit on a plain call -- positional tensors only, none a view or repeated,
# a function that reads nothing else, static shapes -- the entry is
# remembered with a guard on its tensors' fields (``PlainTensorsGuard``:
# Dynamo's C++ tensor check plus offsets and aliasing) and on the ambient state
# (Note [The common state, checked fast]), tried before building any key:
#
#     f(x, w)   miss: trace, compile, entries[key] = entry
#     f(x, w)   hit through the dict; entry remembered as the last one
#     f(x2, w)  same fields as the last entry's keys: run it (no key, no hash)
#     f(x3, w)  x3 is float64: the full key, the dict, maybe a miss
#
# It answers exactly when the full key would find that entry; it only skips
# the work of building and hashing the key (a visible share of a small call:
# bench/findings.md).
@dataclass(frozen=True, kw_only=True)
class _LastEntry:
    guard: PlainTensorsGuard
    ambient: Any  # Note [Ambient state]
    call: Callable[[Sequence[torch.Tensor]], Any]


# Note [Entries with shape guards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dynamic trace serves the sizes its shape guards allow (Note [Dynamic
# shapes]); calls outside them have the same key but need another trace.
# Those traces sit under the key with ``retrace`` counting up, tried in order:
#
#     f(ones(2, 4))   key K: traced, guards y.size()[1] == 4  -> entries[K]
#     f(ones(2, 6))   entries[K] fails y.size()[1] == 4; traced -> entries[K, retrace=1]
#     f(ones(2, 4))   entries[K] passes: a hit
#
# An entry whose capture read environment variables is guarded the same way
# on their values (Note [Environment read at capture]): ``ACT=gelu`` after a
# trace under ``ACT=relu`` fails ``environment variable ACT: 'relu' != 'gelu'``
# and traces into the next slot.


def _failed(entry: Entry, state: tuple[torch.Tensor, ...], leaves: Sequence[Any]) -> str | None:
    """Why ``entry`` does not serve this call: an environment variable or a shape guard."""
    if entry.environ is not None:
        changed = entry.environ.changed()
        if changed is not None:
            return changed
    failed = entry.compiled.failed_guard(entry.inputs(state, leaves))
    return None if failed is None else f"shape guard {failed} failed"


# Note [Concurrent calls]
# ~~~~~~~~~~~~~~~~~~~~~~~
# One compiled function may be called from several threads at once. Hits take
# no lock: they read the entries dict, the last entry and the lifted state's
# caches, each of which is one value written whole (a dict item, an
# attribute), so a reader sees an old value or the new one, never half of
# one. A miss holds the function's own lock until its entry is stored, and
# looks the key up again first: threads that missed on the same key together
# get the entry the first one traced, instead of each tracing it again::
#
#     thread 1: f(ones(2))  miss  -> lock, find: none; trace K, store K, unlock, run
#     thread 2: f(ones(2))  miss  -> waits for the lock; find: K (a hit), unlock, run
#     thread 3: f(ones(3))  miss  -> waits; find: none; trace K', store K', unlock, run
#
# Captures in different functions take turns too (Note [Capture sessions]), and
# so do the builds of a specialization's graphs for a first ``create_graph``
# backward (``runtime/higher_order.py``); running the entries, the graphs, takes
# no lock. The hit and miss counts of
# ``cache_info`` are counters bumped without a lock: under threads they may
# count a few calls short.


class SpecializationCache:
    """A compiled function's entries by :class:`CacheKey`, its :class:`CacheInfo`, its last entry.

    >>> import torch, aotgrad
    >>> f = aotgrad.aot_function(lambda x: x * 2)
    >>> _ = f(torch.ones(2)); _ = f(torch.ones(3))
    >>> cache = f.cache
    >>> len(cache), cache.info.misses, cache.info.reasons[-1]
    (2, 2, 'input x: shape (2,) != (3,)')
    """

    def __init__(self, limit: int, owner: str) -> None:
        self.entries: dict[CacheKey, Entry] = {}
        self.info = CacheInfo()
        # Past this many entries, new specializations run eagerly.
        self.limit = limit
        # The compiled function's name, for the warning when the cache is full.
        self._owner = owner
        # The key of the latest miss: the next miss is explained against it.
        self._latest: CacheKey | None = None
        self._last: _LastEntry | None = None  # Note [The last entry]
        self._warned_full = False

    def __len__(self) -> int:
        return len(self.entries)

    def last_entry(self, args: tuple[Any, ...]) -> Callable[[Sequence[Any]], Any] | None:
        """The last entry, as a hit, if it serves these positional ``args`` (Note [The last entry]).

        None in a capture and under a torch.func transform or forward-AD level: those calls
        take the full path.
        """
        last = self._last
        if last is None:
            return None
        if last.ambient is True:  # Note [The common state, checked fast]
            if not (torch.is_grad_enabled() and common_state()):
                return None
        elif capturing() or transform_active() or ambient_key() != last.ambient:
            return None
        if not last.guard.passes(args):
            return None
        self.info.hits += 1
        return last.call

    def find(
        self, key: CacheKey, state: tuple[torch.Tensor, ...], leaves: Sequence[Any]
    ) -> Entry | Miss:
        """The entry serving this call, counted as a hit; else the :class:`Miss` to trace.

        A dynamic entry serves only the sizes its shape guards allow (Note
        [Entries with shape guards]).
        """
        entry = self.entries.get(key)
        if entry is None:
            return Miss(key=key)
        if key.dynamic_dims is None and entry.environ is None:
            self.info.hits += 1
            return entry
        return self._guarded(key, entry, state, leaves)

    def _guarded(
        self, key: CacheKey, entry: Entry, state: tuple[torch.Tensor, ...], leaves: Sequence[Any]
    ) -> Entry | Miss:
        """The first entry under ``key`` whose shape guards and environment (Note [Environment
        read at capture]) pass, else a miss at the next slot."""
        first_failed = None
        found: Entry | None = entry
        while found is not None:
            failed = _failed(found, state, leaves)
            if failed is None:
                self.info.hits += 1
                return found
            first_failed = first_failed or failed
            key = key._replace(retrace=key.retrace + 1)
            found = self.entries.get(key)
        return Miss(key=key, failed=first_failed)

    def remember(self, key: CacheKey, entry: Entry, leaves: Sequence[Any]) -> None:
        """Make ``entry`` the last entry when a guard on ``leaves`` can stand for ``key``.

        The caller vouches that the function reads nothing but its positional
        arguments (Note [The last entry]).
        """
        # Not when its guard sees no placement (Note [Tensor subclasses]) or environment,
        # or the entry replays stores (the last entry calls the graphs only).
        if entry.compiled.takes_subclasses or entry.replay is not None or entry.environ is not None:
            return
        if entry.positions is None and key.aliases is None and key.dynamic_dims is None:
            # Called only where ``common_state()`` holds when the key is the grad mode on.
            requires_grad = [t.requires_grad for t in leaves]  # in the guard
            call = entry.compiled.direct_call(requires_grad, common=key.ambient is True)
            call = call or entry.compiled
            self._last = _LastEntry(guard=PlainTensorsGuard(leaves), ambient=key.ambient, call=call)

    def admit(self, miss: Miss, names: Callable[[], Sequence[str]]) -> bool:
        """Record the miss and why; False when the cache is full (the call runs eagerly).

        ``names`` gives the call's leaf names, for the reason (found only on a miss).
        """
        reason = self._reason(miss, names)
        self.info.misses += 1
        self.info.reasons.append(reason)
        self._latest = miss.key
        if len(self.entries) < self.limit:
            return True
        self.info.fallbacks += 1
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(
                f"aotgrad: {self._owner} has {self.limit} compiled specializations (cache_limit);"
                f" running this call eagerly. Last miss: {reason}. Pass values that change between"
                " calls as tensors (a Python number is baked into the graph), or raise"
                " cache_limit. (Warned once; aotgrad.cache_info counts the eager calls.)",
                stacklevel=5,
            )
        return False

    def _reason(self, miss: Miss, names: Callable[[], Sequence[str]]) -> str:
        if miss.failed is not None:
            return miss.failed
        if miss.key == self._latest:  # the latest miss stored no entry
            full = len(self.entries) >= self.limit
            why = "ran eagerly (cache_limit)" if full else "raised before its entry was stored"
            return f"the same key as the previous miss, which {why}"
        if self._latest is None:
            return "first call"  # no names needed (finding them is slow on big graphs)
        return miss.key.explain(self._latest, names())

    def add(self, key: CacheKey, entry: Entry) -> None:
        """Store a new trace's entry; later misses are explained against ``key``."""
        self.entries[key] = entry
        self._latest = key
        self.info.entries = len(self.entries)
        if entry.compiled.higher_order is not None:  # its create_graph captures count here
            entry.compiled.higher_order.orders = self.info
