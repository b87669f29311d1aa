"""Named decomposition sets (``decompositions="core_aten"``) and the check that a joint graph
holds only the ops of the set it was captured for (Note [Core ATen graphs]).

>>> import torch
>>> torch.ops.aten.silu.default in decomposition_set("core_aten")
True
>>> decomposition_set("core")
Traceback (most recent call last):
...
aotgrad.errors.ConfigError: decompositions='core' is not a decomposition set aotgrad knows: pass 'core_aten' (PyTorch's Core ATen opset) or a dict from OpOverload to function
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.fx as fx

from aotgrad._torch_compat import OpOverload, all_decompositions
from aotgrad.errors import ConfigError, UnsupportedOpError
from aotgrad.ops.rules import OpRules
from aotgrad.ops.table import is_random
from aotgrad.ops.upsample import UPSAMPLE_BACKWARD_DECOMPOSITIONS

# Note [Core ATen graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``decompositions="core_aten"`` captures with PyTorch's Core ATen decomposition table
# (``torch.export.default_decompositions()``, the one ``ExportedProgram.run_decompositions()``
# uses), composed with aotgrad's own handling of random ops (``capture/analyses/random.py``, applied to
# every table: a random op's decomposition is used only for calls that draw nothing). The
# table applies below autograd, to the forward ops and to the ops the derivative formulas
# issue, so the forward and the backward graph both come out decomposed::
#
#     F.silu(x)
#       default:    silu              backward:  silu_backward
#       core_aten:  sigmoid, mul      backward:  sigmoid, mul, sub, mul, add, mul
#
# The export table expects some ops gone before it runs, and PyTorch decomposes others only
# into prims (``torch._refs``) or not at all; ``FROM_TORCH_DECOMP`` (BatchNorm, training and
# eval; ``new_empty_strided``; the bilinear, trilinear and bicubic ``F.interpolate``) and
# ``EXTRA_DECOMPOSITIONS`` (aotgrad's: every ``F.interpolate`` backward but antialiasing's,
# Note [Upsampling backward in Core ATen] in ``ops/upsample.py``; CPU flash attention's
# ``logsumexp`` and backward, ``as_strided_scatter`` into a contiguous tensor, ``var_mean``,
# ``lift_fresh``/``lift_fresh_copy`` as ``clone``: bart's and whisper's ``torch.tensor``
# written into; ``empty_permuted`` as ``empty_strided``) fill those in. Left refused, with
# the reason in ``NO_EXACT_DECOMPOSITION``: ``histc`` (mixtral's expert counts; its bins are
# its kernel's float arithmetic, and with ``min == max`` they depend on the data); and, as
# any op no table reaches, other libraries' custom ops (``transformers::grouped_mm_*``).
#
# After capture every ``call_function`` node of the joint graph is checked: its target is
# an ``OpOverload`` tagged ``torch.Tag.core``, or one the graphs legitimately need beyond
# the opset (``ALSO_ALLOWED``: ``operator.getitem`` of a multi-output op, and aotgrad's own
# ops in the ``aotgrad`` namespace, which mark cotangents, fill random values and reseed;
# a backend meets them as custom ops, named in the export's docs). An op still outside the
# set (one PyTorch has no decomposition for, an op the table leaves alone on purpose, or a
# random op such as dropout's ``bernoulli.p`` on CPU, whose decomposition would draw other
# numbers than eager: ``rand_like(x) < p`` for Bernoulli draws) is a loud UnsupportedOpError naming each such op and the user source line of its first
# node: a graph promised in Core ATen and holding something else is never returned.
#
# The set's name is part of the disk-cache key (``store.persist.options_text``): a graph
# captured without it is never served for a call that asked for it, nor the reverse.

CORE_ATEN = "core_aten"
# The decomposition sets a string ``decompositions=`` may name.
DECOMPOSITION_SETS = (CORE_ATEN,)

# Targets outside Core ATen the graphs of a ``core_aten`` capture may still hold.
ALSO_ALLOWED: frozenset[Any] = frozenset({operator.getitem})
# Op namespaces whose ops are aotgrad's own (torch.library ops it defines).
OWN_NAMESPACES = frozenset({"aotgrad"})


def decomposition_set(name: str) -> Mapping[Any, Callable[..., Any]]:
    """The decomposition table a ``decompositions=`` string names; a ConfigError otherwise."""
    check_decomposition_set(name)
    return _core_aten_table()


def check_decomposition_set(name: str) -> str:
    """``name`` if it names a decomposition set, else a ConfigError (a ValueError) listing them."""
    if name not in DECOMPOSITION_SETS:
        raise ConfigError(
            f"decompositions={name!r} is not a decomposition set aotgrad knows: pass"
            f" {CORE_ATEN!r} (PyTorch's Core ATen opset) or a dict from OpOverload to function"
        )
    return name


@functools.cache
def _core_aten_table() -> Mapping[Any, Callable[..., Any]]:
    # torch.export is public, and loads with the feature that needs it (import aotgrad stays fast).
    import torch.export

    table = dict(torch.export.default_decompositions().items())
    # Ops outside Core ATen that the export table leaves alone (export removes them before
    # it runs the table) take PyTorch's own decomposition where it is in aten ops ...
    everything = all_decompositions()
    table.update({op: everything[op] for op in FROM_TORCH_DECOMP})
    # ... or aotgrad's, where PyTorch's is in prims or missing.
    table.update(EXTRA_DECOMPOSITIONS)
    return table


# Ops outside Core ATen whose ``torch._decomp`` decomposition issues aten ops the table reaches
# (those of ``torch._refs`` issue prims, which are not Core ATen either).
FROM_TORCH_DECOMP = (
    torch.ops.aten._native_batch_norm_legit_functional.default,  # BatchNorm in training
    torch.ops.aten.native_batch_norm.default,  # BatchNorm in eval mode
    # ``x.new_empty_strided(size, stride)`` (a backward's buffer in bart and whisper): the
    # core ``empty_strided`` with ``x``'s dtype, layout and device unless given.
    torch.ops.aten.new_empty_strided.default,
    # ``F.interpolate``'s bilinear, trilinear and bicubic forwards (their backwards are
    # aotgrad's: Note [Upsampling backward in Core ATen]).
    torch.ops.aten.upsample_bilinear2d.default,
    torch.ops.aten.upsample_trilinear3d.default,
    torch.ops.aten.upsample_bicubic2d.default,
)

# Decompositions aotgrad adds for ops outside Core ATen that PyTorch has none for (or only
# in prims): each registered beside its rule below, and the upsampling backwards of
# ``upsample.py`` (Note [Upsampling backward in Core ATen]).
EXTRA_DECOMPOSITIONS: OpRules[Callable[..., Any]] = OpRules("Core ATen decomposition")


@EXTRA_DECOMPOSITIONS.register(torch.ops.aten.as_strided_scatter.default)
def _as_strided_scatter(
    base: torch.Tensor,
    src: torch.Tensor,
    size: list[int],
    stride: list[int],
    storage_offset: int | None = None,
) -> torch.Tensor:
    """``base`` with ``src`` written over ``base.as_strided(size, stride, offset)``, in core ops.

    Functionalization writes a mutation through an ``as_strided`` view this way; torch's own
    decomposition issues ``prims.as_strided_scatter``. The positions the view covers are an
    ``arange`` over ``base``'s elements, viewed the same way; ``index_put`` writes there. The
    view's strides count elements of ``base``'s memory, which is its ``arange`` order only when
    ``base`` is contiguous, so anything else is refused."""
    if not base.is_contiguous():
        raise UnsupportedOpError(
            "decompositions='core_aten': as_strided_scatter into a non-contiguous tensor"
            " has no Core ATen decomposition in aotgrad (Note [Core ATen graphs])"
        )
    positions = torch.arange(base.numel(), device=base.device)
    positions = positions.as_strided(size, stride, storage_offset or 0)
    flat = base.reshape(-1).index_put((positions.reshape(-1),), src.reshape(-1).to(base.dtype))
    return flat.view(base.shape)


def _attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``q k^T * scale`` with the causal mask and ``attn_mask`` applied (``key`` with as many
    heads as ``query``)."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    length, source = query.size(-2), key.size(-2)
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    return scores


@EXTRA_DECOMPOSITIONS.register(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention's output by PyTorch's decomposition, and its ``logsumexp`` (which
    that decomposition replaces by the probabilities, another shape) in core ops: a graph
    decomposed after capture hands the backward a value of the shape it was captured with
    (Note [Decomposing a captured graph]). The kernel's ``logsumexp`` is in float32 for
    half-precision inputs."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    output, _ = all_decompositions()[op](
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    low = (torch.float16, torch.bfloat16)
    q, k = (query.float(), key.float()) if query.dtype in low else (query, key)
    group = query.size(1) // key.size(1)
    k = k.repeat_interleave(group, dim=1) if group != 1 else k
    scale = scale if scale is not None else query.size(-1) ** -0.5
    logsumexp = torch.logsumexp(_attention_scores(q, k, is_causal, attn_mask, scale), dim=-1)
    return output, logsumexp


@EXTRA_DECOMPOSITIONS.register(
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
)
def _flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of CPU flash attention from its probabilities, recomputed in core ops.

    Core ATen decomposes the forward into ``_scaled_dot_product_attention_math`` (which
    refuses dropout), but the backward autograd records for it has no decomposition in
    PyTorch. With ``P = softmax(q k^T * scale + mask)``, ``o = P v``:
    ``dv = P^T do``, ``dS = P * (do v^T - rowsum(do * o))``, ``dq = dS k * scale``,
    ``dk = dS^T q * scale``; grouped-query heads (``key`` with fewer heads) sum their
    group's gradients."""
    if dropout_p != 0.0:  # the forward's decomposition refuses it too
        raise UnsupportedOpError(
            f"decompositions='core_aten': attention with dropout_p={dropout_p} has no Core ATen"
            " decomposition whose mask is eager's; capture without decompositions='core_aten'"
        )
    heads, kv_heads = query.size(1), key.size(1)
    group = heads // kv_heads
    k = key.repeat_interleave(group, dim=1) if group != 1 else key
    v = value.repeat_interleave(group, dim=1) if group != 1 else value
    scale = scale if scale is not None else query.size(-1) ** -0.5
    scores = _attention_scores(query, k, is_causal, attn_mask, scale)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(torch.isnan(probs), torch.zeros_like(probs), probs)  # rows fully masked
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
    row = (grad_probs * probs).sum(dim=-1, keepdim=True)
    grad_scores = probs * (grad_probs - row) * scale
    grad_q = torch.matmul(grad_scores, k)
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), query)
    if group != 1:
        b, _, s, e = grad_k.shape
        grad_k = grad_k.view(b, kv_heads, group, s, e).sum(dim=2)
        grad_v = grad_v.view(b, kv_heads, group, s, value.size(-1)).sum(dim=2)
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)


@EXTRA_DECOMPOSITIONS.register(torch.ops.aten.var_mean.correction)
def _var_mean(
    x: torch.Tensor,
    dim: list[int] | None = None,
    *,
    correction: float | None = None,
    keepdim: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``var_mean`` as the core ``var.correction`` and ``mean.dim`` (torch's is in prims)."""
    var = torch.ops.aten.var.correction(x, dim, correction=correction, keepdim=keepdim)
    return var, torch.ops.aten.mean.dim(x, dim, keepdim=keepdim)


@EXTRA_DECOMPOSITIONS.register(
    torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default
)
def _lift_fresh_copy(x: torch.Tensor) -> torch.Tensor:
    """``torch.tensor(...)`` in the function lifts its constant with ``lift_fresh``, which
    ``make_fx`` records as ``lift_fresh_copy`` (a copy, so that a write into the tensor,
    as bart's and whisper's ``shifted[:, 0] = start``, leaves the constant alone): both are
    ATen's ``clone``, which is core."""
    return torch.ops.aten.clone.default(x)


@EXTRA_DECOMPOSITIONS.register(torch.ops.aten.empty_permuted.default)
def _empty_permuted(
    size: list[int],
    physical_layout: list[int],
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    """``empty_permuted`` (``torch.empty_like`` records it) as the core ``empty_strided``: a
    contiguous tensor of the sizes in ``physical_layout`` order, permuted back, as ATen
    allocates it (a size-1 or size-0 dimension strided as a size-1 one)."""
    strides = [0] * len(size)
    step = 1
    for dim in reversed(physical_layout):
        strides[dim] = step
        step *= max(size[dim], 1)
    return torch.ops.aten.empty_strided.default(
        size, strides, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory
    )


for _op, _rule in UPSAMPLE_BACKWARD_DECOMPOSITIONS.items():
    EXTRA_DECOMPOSITIONS.add(_op, _rule)


# Ops outside Core ATen aotgrad leaves refused on purpose, and why (Note [Core ATen graphs]).
NO_EXACT_DECOMPOSITION: dict[Any, str] = {
    torch.ops.aten.histc.default: (
        "no exact decomposition: which bin a value falls in is the kernel's own float"
        " arithmetic, and with min == max the range comes from the data"
    ),
}


def is_core(target: Any) -> bool:
    """Whether a graph node's target is in Core ATen or among what the graphs also need."""
    if target in ALSO_ALLOWED:
        return True
    if not isinstance(target, OpOverload):
        return False
    if target.namespace in OWN_NAMESPACES:
        return True
    return torch.Tag.core in target.tags


def non_core_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The ``call_function`` nodes of ``graph`` whose target is outside Core ATen."""
    return [n for n in graph.nodes if n.op == "call_function" and not is_core(n.target)]


def refuse_non_core(
    graph: fx.Graph, name: str, exporting: bool = False, ignore: Collection[fx.Node] = ()
) -> None:
    """An UnsupportedOpError naming every op of ``graph`` outside the set ``name`` promised,
    but those of ``ignore`` (random draws the compiled graph takes as inputs); ``exporting``:
    the graph is a program ``export(decompositions=name)`` decomposed."""
    offenders = [n for n in non_core_nodes(graph) if n not in ignore]
    if not offenders:
        return
    first: dict[str, fx.Node] = {}
    for node in offenders:
        first.setdefault(str(node.target), node)
    lines = []
    for op, node in first.items():
        info = node.meta.get("aotgrad")
        source = getattr(info, "source", None)
        phase = getattr(getattr(info, "phase", None), "value", "")
        where = f", first at {source}" if source is not None else ""
        why = (
            ": a random op, kept so that the graph draws what eager draws (its decompositions"
            " draw other numbers); random='inputs' takes its draws out of the graph (Note"
            " [Random draws as inputs])"
            if is_random(node.target)
            else ""
        )
        if node.target in NO_EXACT_DECOMPOSITION:
            why = f": {NO_EXACT_DECOMPOSITION[node.target]}"
        lines.append(f"  {op} ({phase}{where}){why}")
    what, step = ("exported", "export") if exporting else ("captured", "capture")
    raise UnsupportedOpError(
        f"decompositions={name!r}: the {what} graph still holds {len(first)} op(s) outside"
        f" PyTorch's Core ATen opset, which no decomposition in the table reaches:\n"
        + "\n".join(lines)
        + f"\nRewrite that code with ops the table decomposes, or {step} without"
        " decompositions='core_aten' (Note [Core ATen graphs])"
    )
