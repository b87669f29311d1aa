"""Export and independent backends on library models (issue 31).

Per model, in a fresh process (what a user waits for, imports in): the capture
(``aotgrad.trace`` of ``loss(model(*args))``) against the export of its graphs
(``traced.export()``, the first in the process: ``torch.export``'s import included). Then, per
backend (ONNX Runtime, IREE), the flat programs (``export(flat=True)``) compiled by
``aotgrad.backends.step`` and one step run: its compile time, its run time against eager's step
(forward and backward, best of ``ROUNDS``), and its largest error against eager over the loss,
the buffers after the step and every gradient, as a fraction of the tolerance the backend tests
state (tests/test_backend_*.py): ``max |backend - eager| / (atol + rtol |eager|)``, at most 1
where their ``assert_close`` passes. As a script it
measures one model in this process: ``python bench/export_backends.py gpt2``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODELS = ("gpt2", "llama", "bert", "resnet18", "efficientnet")
BACKENDS: tuple[str, ...] = ("onnxruntime", "iree")
ROUNDS = 5
# BatchNorm over a batch of 2 at 1x1 is ill-conditioned (tests/test_core_aten.py): the vision
# models (convnets) run at batch 8, and at 64x64, where IREE 3.13 compiles every strided
# convolution (docs/backends.md; tests/test_real_models.py runs them alike).
VISION_BATCH, VISION_IMAGE = 8, 64


def _case(name: str) -> Any:
    import library_models

    case = library_models.build(name)
    if case.family != "transformers":
        generator = torch.Generator().manual_seed(0)
        size = (VISION_BATCH, 3, VISION_IMAGE, VISION_IMAGE)
        case = dataclasses.replace(case, args=(torch.randn(size, generator=generator),), kwargs={})
    return case


def _eager_step(model: torch.nn.Module, case: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = case.loss(model(*case.args, **case.kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tolerance(family: str) -> tuple[float, float]:
    """(rtol, atol) of the backend tests: convnets with BatchNorm at batch 8 get atol 1e-4
    (docs/backends.md: eager's own float32 gradients are that far from float64's)."""
    return (1e-4, 1e-5) if family == "transformers" else (1e-4, 1e-4)


def _error(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest ``|got - expected| / (atol + rtol * |expected|)``: at most 1 where
    ``torch.testing.assert_close`` with these tolerances passes."""
    if not expected.numel():
        return 0.0
    diff = (got.to(expected.dtype) - expected).abs()
    return (diff / (atol + rtol * expected.abs())).max().item()


def measure_one(name: str) -> dict[str, Any]:
    import torch.utils._pytree as pytree

    import aotgrad
    from aotgrad.backends import step
    from aotgrad.signature.descriptors import Buffer, Param
    from backend_check import WithLoss

    case = _case(name)
    model = WithLoss(case.model, case.loss)
    eager = copy.deepcopy(model)
    start = time.perf_counter()
    traced = aotgrad.trace(copy.deepcopy(model), *case.args, **case.kwargs)
    capture = time.perf_counter() - start
    start = time.perf_counter()
    traced.export()
    export = time.perf_counter() - start

    expected = eager(*case.args, **case.kwargs)
    expected.backward()
    expected_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    buffers = dict(eager.named_buffers())
    eager_s = _best(lambda: _eager_once(copy.deepcopy(model), case))

    core = aotgrad.trace(
        copy.deepcopy(model), *case.args, decompositions="core_aten", **case.kwargs
    )
    programs = core.export(flat=True)
    leaves = pytree.tree_leaves((case.args, case.kwargs))
    tensors = [leaves[i] for i in core.partitioned.joint.inputs.tensor_positions]
    found: dict[str, Any] = {"capture": capture, "export": export, "eager step": eager_s}
    for backend in BACKENDS:
        start = time.perf_counter()
        try:
            run = step(programs, backend)
        except aotgrad.BackendError as error:
            found[backend] = {"refused": str(error).splitlines()[0]}
            continue
        compile_s = time.perf_counter() - start
        result = run(*tensors)
        tol = _tolerance(case.family)
        errors = [_error(result.outputs[0], expected.detach(), *tol)]
        errors += [
            _error(v, buffers[d.name], *tol)
            for d, v in result.mutations.items()
            if isinstance(d, Buffer) and v.is_floating_point()
        ]
        grads = {d.name: g for d, g in result.grads.items() if isinstance(d, Param)}
        errors += [_error(grads[n], g, *tol) for n, g in expected_grads.items()]
        found[backend] = {
            "compile": compile_s,
            "step": _best(lambda run=run: run(*tensors)),
            "error": max(errors),
        }
    return found


def _eager_once(model: torch.nn.Module, case: Any) -> None:
    model(*case.args, **case.kwargs).backward()


def _best(fn: Any) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure() -> dict[str, dict[str, Any]]:
    """Every model, each in a fresh process."""
    found = {}
    for name in MODELS:
        out = subprocess.run(
            [sys.executable, __file__, name], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"bench/export_backends.py {name} failed:\n{out.stderr[-3000:]}")
        found[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"export/backends {name}: {found[name]}", flush=True)
    return found


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(measure_one(sys.argv[1])))
