"""Library models (transformers, timm, torchvision) through every aotgrad entry point, against eager.

Each cell is one model (``tests/library_models.py``: small random configs, nothing downloaded)
and one check. A check runs a copy of the model eagerly and another copy through aotgrad, on the
same inputs and the same random seed, takes ``loss(output).backward()`` on both, and compares:

- every tensor of the output (``ModelOutput`` fields included, through pytree);
- every parameter's gradient, which must also be a plain ``torch.Tensor`` (not a functional
  wrapper leaked from the capture) and ``None`` exactly where eager's is;
- every buffer after the call (BatchNorm running stats, ``num_batches_tracked``);
- tied parameters (GPT-2's ``lm_head`` and ``wte``) are still one tensor;
- for ``sgd``: the parameters after each of three SGD-with-momentum steps.

Tolerances: float32 with ``rtol=1e-4, atol=1e-5``. The compiled graphs run the same math
through decomposed aten ops (layer norm, softmax, GELU, attention) in another order, which
rounds differently: about 1e-6 relative per op, compounding over tens of ops and through the
backward. 1e-4 leaves margin for that while a wrong dropout mask, a missing term or a stale
graph shows as an O(1) difference. Integer buffers compare exactly.

Cells known to fail are listed once, in ``KNOWN_FAILURES`` (issue 12 item numbers), and run
as strict xfails: a fix makes its cell pass, the xfail turns into a failure, and the entry is
deleted. ``FAST`` is the subset ``make test`` runs; ``make models`` runs every cell and writes
the README table (``tests/models_table.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import aotgrad
import aotgrad.testing
from library_models import BATCH2, BUILDERS, SEQ2, Case, Inputs, build

RTOL, ATOL = 1e-4, 1e-5
SEED = 1234
DROPOUT = 0.1
SGD_STEPS = 3

MODELS = tuple(BUILDERS)
# The suite's first models, each through aot_module in the fast subset.
FIRST_MODELS = (
    "gpt2",
    "bert",
    "t5",
    "llama",
    "vit",
    "convnext",
    "efficientnet",
    "resnet18",
    "mobilenet_v3",
    "tv_vit",
)

Compile = Callable[[torch.nn.Module, Inputs], Callable[..., Any]]


def _aot_module(**options: Any) -> Compile:
    return lambda module, inputs: aotgrad.aot_module(module, **options)


def _trace(module: torch.nn.Module, inputs: Inputs) -> Callable[..., Any]:
    """Traced on inputs laid out as ``_step`` passes them (its clones: an expanded buffer such as
    RoBERTa's ``token_type_ids`` comes back contiguous), as a user traces on the inputs they call
    with; a Traced refuses another layout (Note [A Traced keeps to its capture])."""
    args, kwargs = _clones(inputs)
    return aotgrad.trace(module, *args, **kwargs)


def _dynamo(module: torch.nn.Module, inputs: Inputs) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(module, backend="aotgrad")


# check -> one-line description (the README table's legend)
CHECKS: dict[str, str] = {
    "aot_module": "`aotgrad.aot_module(model)`",
    "trace": "`aotgrad.trace(model, *inputs)` called on the inputs",
    "dynamo": '`torch.compile(model, backend="aotgrad")`',
    "mincut": '`aot_module(model, partition="mincut")`',
    "budget": "`aot_module(model, partition=aotgrad.budget(0.5))`",
    "ckpt_reentrant": "gradient checkpointing, `use_reentrant=True`",
    "ckpt_nonreentrant": "gradient checkpointing, `use_reentrant=False`",
    "dropout": f"dropout {DROPOUT} in train mode, same seed as eager",
    "dynamic": "`aot_module(model, dynamic=True)`, second call at another batch/sequence size",
    "sgd": f"{SGD_STEPS} steps of SGD with momentum through `aot_module`",
    "peak": "predicted peak = `measure_peak` within 2%: save_all, mincut, `budget(0.5)`",
    "export": '`trace(model, ...).export(joint=True, random="inputs")` with dropout: the'
    " programs and their draw program saved, loaded and run equal to eager",
    "core_aten": '`aot_module(model, decompositions="core_aten")` in float64 with dropout: every'
    " op Core ATen",
    "onnxruntime": "one step of the `export(flat=True)` programs in ONNX Runtime with dropout"
    " (`aotgrad.backends`; vision models at batch 8)",
    "iree": "one step of the `export(flat=True)` programs in IREE with dropout (`aotgrad.backends`;"
    " vision models at batch 8, convnets at 64x64)",
}
# The checks that run with dropout (and drop path, attention dropout) at ``DROPOUT``: a model
# without dropout runs them as it is. Eager and aotgrad draw from one seed (Note [Random draws
# as inputs]).
WITH_DROPOUT = frozenset({"dropout", "export", "core_aten", "onnxruntime", "iree"})

# (model, check) -> why it fails today. Delete an entry when its fix merges (strict xfail).
_MOE_LOOP = (
    "refused (DataDependentError): Mixtral's eager experts loop over `nonzero()` of the routing"
    " mask; the default experts kernel (`mixtral`) passes"
)
_MOE_CORE = (
    "refused (UnsupportedOpError): Core ATen capture of Mixtral meets `histc` (no exact"
    " decomposition) and transformers' own grouped-matmul custom ops; its grouped matmul has no"
    " float64 kernel either"
)
_HOOKS_AFTER_CAPTURE = (
    "refused (CallError, loud): transformers installs its output-capturing hooks on Mixtral's"
    " layers during the model's first forward, which here is the capture itself; the Traced's"
    " first call then sees hooks the capture began without and refuses. Call the model once"
    " before tracing it, or use aot_module"
)
_RELU_FLIPS = (
    "not comparable in float32 at 1e-4: mnasnet's gradients are ill-conditioned (ReLU inputs"
    " within 1e-6 of zero flip their mask, BatchNorm on small maps amplifies it); against"
    " float64, eager float32 is off by 6.7e-2 on layers.0.weight, the backend by 6.4e-2"
    " (docs/backends.md)"
)
KNOWN_FAILURES: dict[tuple[str, str], str] = {
    **{("mixtral", c): _MOE_CORE for c in ("core_aten", "onnxruntime", "iree")},
    **{("mnasnet", c): _RELU_FLIPS for c in ("onnxruntime", "iree")},
    ("mixtral", "trace"): _HOOKS_AFTER_CAPTURE,
    # (torch.compile passes: Dynamo breaks the graph at the nonzero() and runs the loop itself.)
    **{("mixtral_eager", c): _MOE_LOOP for c in CHECKS if c != "dynamo"},
}

# Cells without meaning: ResNet-18 has no dropout.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    **{(m, "dropout"): "no dropout layer" for m in ("resnet18", "shufflenet", "tv_regnet")},
    # timm's CoaT refuses set_grad_checkpointing(True).
    **{("coat", c): "no checkpointing" for c in ("ckpt_reentrant", "ckpt_nonreentrant")},
}

# The subset `make test` runs (within a few minutes on 2 cores): every model through
# aot_module, and every check on at least one model of each library.
FAST: frozenset[tuple[str, str]] = frozenset(
    [(m, "aot_module") for m in FIRST_MODELS]
    + [
        ("gpt2", c)
        for c in ("trace", "dynamo", "mincut", "budget", "sgd", "ckpt_reentrant", "dynamic")
    ]
    + [("bert", "trace"), ("bert", "dropout"), ("llama", "ckpt_nonreentrant")]
    + [("vit", "ckpt_reentrant"), ("vit", "ckpt_nonreentrant"), ("vit", "dropout")]
    + [("convnext", "mincut"), ("efficientnet", "ckpt_nonreentrant"), ("efficientnet", "dropout")]
    + [("resnet18", "sgd"), ("resnet18", "budget"), ("resnet18", "dynamo"), ("tv_vit", "dropout")]
    # The newer architectures run in `make models` only, but for these: a submodule
    # registered twice (coat), MoE routing through the default experts kernel and its
    # loud refusal of the eager loop, shifted windows, a conv frontend, the last non-pad
    # token gathered by argmax, padding masks feeding position ids, channel shuffle.
    + [(m, "aot_module") for m in ("coat", "mixtral", "mixtral_eager", "swin", "whisper")]
    + [("gpt2_cls", "aot_module"), ("roberta", "dropout"), ("shufflenet", "sgd")]
    + [("gpt2", "peak"), ("resnet18", "peak"), ("vit", "peak")]
)


def cells() -> list[Any]:
    params = []
    for model in MODELS:
        for check in CHECKS:
            if (model, check) in NOT_APPLICABLE:
                continue
            marks = [pytest.mark.models]
            if (model, check) not in FAST:
                marks.append(pytest.mark.models_slow)
            if (model, check) in KNOWN_FAILURES:
                reason = KNOWN_FAILURES[model, check]
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(model, check, marks=marks, id=f"{model}-{check}"))
    return params


@pytest.mark.parametrize(("model", "check"), cells())
def test_model(model: str, check: str) -> None:
    run_check(model, check)


def run_check(model: str, check: str, make: Callable[[str, float], Case] = build) -> None:
    """Run one cell; raises AssertionError listing the mismatches. ``make(model, dropout)``
    builds the case (``tests/gpu_checks.py`` passes one that puts it on CUDA)."""
    case = make(model, DROPOUT if check in WITH_DROPOUT else 0.0)
    special = {"peak": check_peak, "export": check_export, "core_aten": check_core_aten}
    special["onnxruntime"] = functools.partial(check_backend, backend="onnxruntime")
    special["iree"] = functools.partial(check_backend, backend="iree")
    if check in special:
        special[check](case)
        return
    if check.startswith("ckpt_"):
        with case.checkpointing(case.model, check == "ckpt_reentrant"):
            compare(case, _aot_module(), [case.inputs])
        return
    compile_fn: Compile = {
        "trace": _trace,
        "dynamo": _dynamo,
        "mincut": _aot_module(partition="mincut"),
        "budget": _aot_module(partition=aotgrad.budget(0.5)),
        "dynamic": _aot_module(dynamic=True),
    }.get(check, _aot_module())
    calls = [case.inputs]
    if check == "dynamic":
        calls.append(case.resized(BATCH2, SEQ2))
    if check == "sgd":
        calls = [case.inputs] * SGD_STEPS
    compare(case, compile_fn, calls, sgd=check == "sgd")


PEAK_TOLERANCE = 0.02  # of the measured peak (tests/test_peak_memory.py)


def check_peak(case: Case) -> None:
    """The predicted peak of ``loss(model(*inputs)).backward()`` against ``measure_peak``, for
    each partition: within ``PEAK_TOLERANCE`` (issue 30)."""
    model, (args, kwargs) = case.model, case.inputs
    device = next(model.parameters()).device
    problems = []
    for partition in ("save_all", "mincut", aotgrad.budget(0.5)):
        compiled = aotgrad.aot_function(
            lambda *a, **k: case.loss(model(*a, **k)), partition=partition
        )
        compiled(*args, **kwargs).backward()
        model.zero_grad(set_to_none=True)
        step = functools.partial(_backward_of, compiled, args, kwargs)
        measured = aotgrad.testing.measure_peak(step, device)
        model.zero_grad(set_to_none=True)
        peak = compiled.partitioned.peak  # type: ignore[union-attr]
        if abs(peak.allocated - measured) > PEAK_TOLERANCE * measured:
            problems.append(
                f"{partition}: predicted {peak.allocated} bytes, measured {measured}"
                f" (peak at {peak.graph} {peak.node})"
            )
    assert not problems, "\n".join(problems)


def check_export(case: Case) -> None:
    """The forward, backward and joint programs of ``loss(model(*inputs))``, saved, loaded and
    run, against eager: loss, buffers, every gradient, provenance (issue 31)."""
    from test_export import WithLoss
    from test_export import check_export as check

    args, kwargs = case.inputs
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(SEED)
        model = WithLoss(case.model, case.loss)
        check(model, args, kwargs, pathlib.Path(tmp), RTOL, ATOL, random="inputs")


def check_core_aten(case: Case) -> None:
    """``aot_module(decompositions="core_aten")`` against eager, in float64: decomposed ops
    round differently from eager's kernels, and ill-conditioned cells (BatchNorm over two
    values at 1x1) amplify that; float64 keeps it below 1e-9. Then every op of the forward and
    backward graphs is Core ATen."""
    from aotgrad.ops.core_aten import non_core_nodes
    from aotgrad.runtime.boxing import nop

    double = functools.partial(pytree.tree_map_only, torch.Tensor, _double)
    args, kwargs = double(case.inputs)
    case = dataclasses.replace(case, model=case.model.double(), args=args, kwargs=kwargs)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return nop(gm, example_inputs)

    compare(
        case,
        _aot_module(decompositions="core_aten", fw_compiler=record, bw_compiler=record),
        [case.inputs],
    )
    assert len(graphs) == 2, "expected a forward and a backward graph"
    offenders = sorted({str(n.target) for gm in graphs for n in non_core_nodes(gm.graph)})
    assert not offenders, f"ops outside Core ATen in the graphs: {offenders}"


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


# Vision models run a backend at this batch: BatchNorm over a batch of 2 at 1x1 is
# ill-conditioned (check_core_aten), and a backend's float32 has no float64 to fall back to.
BACKEND_BATCH = 8
# Convnets run IREE at 64x64: at 32x32 some strided convolutions map 2x2 to 1x1, which IREE
# 3.13 cannot compile (docs/backends.md). The transformers-style vision models keep their size.
IREE_IMAGE = 64
CONVNETS = frozenset(
    {"resnet18", "efficientnet", "mobilenet_v3", "convnext", "regnet", "densenet", "squeezenet"}
    | {"shufflenet", "tv_regnet", "tv_efficientnet", "mnasnet", "mobilevit"}
)


def check_backend(case: Case, backend: str) -> None:
    """One step of the flat programs (Core ATen) in ``backend`` against eager: loss, buffers
    and every gradient, at the tolerances of docs/backends.md (issue 31)."""
    from backend_check import check_backend as check

    args, kwargs = case.inputs
    atol = ATOL
    if case.family != "transformers":
        args, kwargs = case.resized(BACKEND_BATCH, 0)
        atol = 1e-4  # eager's own float32 gradients are that far from float64's (docs/backends.md)
    if backend == "iree" and case.name in CONVNETS:
        generator = torch.Generator().manual_seed(SEED)
        images = torch.randn(BACKEND_BATCH, 3, IREE_IMAGE, IREE_IMAGE, generator=generator)
        args, kwargs = (images,), {}
    torch.manual_seed(SEED)
    check(case.model, case.loss, args, kwargs, backend, rtol=RTOL, atol=atol)


def _backward_of(compiled: Callable[..., Any], args: Any, kwargs: Any) -> None:
    compiled(*args, **kwargs).backward()


def compare(case: Case, compile_fn: Compile, calls: Sequence[Inputs], sgd: bool = False) -> None:
    """Call eager and compiled copies of ``case.model`` on each of ``calls``; compare everything."""
    eager_model, compiled_model = copy.deepcopy(case.model), copy.deepcopy(case.model)
    ties = _ties(case.model)
    compiled = compile_fn(compiled_model, calls[0])
    optimizers = [_sgd(eager_model), _sgd(compiled_model)] if sgd else []
    problems: list[str] = []
    for i, (args, kwargs) in enumerate(calls):
        where = f"call {i}" if len(calls) > 1 else ""
        eager_out = _step(case, eager_model, args, kwargs)
        compiled_out = _step(case, compiled, args, kwargs)
        problems += _compare_outputs(eager_out, compiled_out, where)
        problems += _compare_grads(eager_model, compiled_model, where)
        problems += _compare_named(
            "buffer", dict(eager_model.named_buffers()), dict(compiled_model.named_buffers()), where
        )
        if _ties(compiled_model) != ties:
            problems.append(
                f"{where} tied parameters came apart: {_ties(compiled_model)} != {ties}"
            )
        for optimizer in optimizers:
            optimizer.step()
        if optimizers:
            problems += _compare_named(
                "parameter after SGD step",
                dict(eager_model.named_parameters()),
                dict(compiled_model.named_parameters()),
                where,
            )
        for model in (eager_model, compiled_model):
            model.zero_grad(set_to_none=True)
        if problems:
            break  # later calls would only repeat the first difference
    assert not problems, "\n".join(problems[:12])


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _clones(tree: Any) -> Any:
    """``tree`` with each tensor cloned; a tensor passed twice (ids as labels) stays one."""
    clones: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        return clones.setdefault(id(t), t.clone())

    return pytree.tree_map_only(torch.Tensor, clone, tree)


def _step(case: Case, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _clones((args, kwargs))
    torch.manual_seed(SEED)  # both runs draw the same random numbers
    out = fn(*args, **kwargs)
    case.loss(out).backward()
    return out


def _ties(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that share one parameter (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


def _compare_outputs(eager: Any, compiled: Any, where: str) -> list[str]:
    e_leaves, e_spec = pytree.tree_flatten(eager)
    c_leaves, c_spec = pytree.tree_flatten(compiled)
    if len(e_leaves) != len(c_leaves):
        return [f"{where} output structure: eager {e_spec}, compiled {c_spec}"]
    problems = []
    for i, (e, c) in enumerate(zip(e_leaves, c_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            problems += _compare_tensor(f"{where} output leaf {i}", e, c)
    return problems


def _compare_grads(eager: torch.nn.Module, compiled: torch.nn.Module, where: str) -> list[str]:
    compiled_params = dict(compiled.named_parameters())
    problems = []
    for name, p in eager.named_parameters():
        c = compiled_params[name].grad
        what = f"{where} grad of {name}"
        if p.grad is None or c is None:
            if (p.grad is None) != (c is None):
                problems.append(f"{what}: eager {_desc(p.grad)}, compiled {_desc(c)}")
            continue
        problems += _compare_tensor(what, p.grad, c)
    return problems


def _compare_named(
    kind: str, eager: dict[str, torch.Tensor], compiled: dict[str, torch.Tensor], where: str
) -> list[str]:
    if eager.keys() != compiled.keys():
        return [f"{where} {kind} names differ: {sorted(eager.keys() ^ compiled.keys())}"]
    problems = []
    for name, e in eager.items():
        problems += _compare_tensor(f"{where} {kind} {name}", e, compiled[name])
    return problems


def _desc(t: Any) -> str:
    return "None" if t is None else f"{type(t).__name__}{tuple(t.shape)}"


def _compare_tensor(what: str, eager: Any, compiled: Any) -> list[str]:
    what = what.strip()
    if not isinstance(compiled, torch.Tensor) or type(compiled) not in (
        torch.Tensor,
        torch.nn.Parameter,
    ):
        return [f"{what}: compiled is {type(compiled).__name__}, not a plain tensor"]
    if eager.shape != compiled.shape or eager.dtype != compiled.dtype:
        return [
            f"{what}: eager {eager.dtype}{tuple(eager.shape)}, compiled {compiled.dtype}{tuple(compiled.shape)}"
        ]
    e, c = eager.detach(), compiled.detach()
    if not e.is_floating_point():
        if torch.equal(e, c):
            return []
        return [
            f"{what}: integer values differ (eager {e.flatten()[:4].tolist()}, compiled {c.flatten()[:4].tolist()})"
        ]
    close = torch.isclose(e, c, rtol=RTOL, atol=ATOL, equal_nan=True)
    if bool(close.all()):
        return []
    diff = (e - c).abs().nan_to_num(float("inf"))
    idx = int(diff.flatten().argmax())
    return [
        f"{what}: {int((~close).sum())}/{e.numel()} differ, max |diff| {float(diff.max()):.3g}"
        f" (eager {float(e.flatten()[idx]):.6g}, compiled {float(c.flatten()[idx]):.6g})"
    ]
