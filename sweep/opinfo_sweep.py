"""Sweep PyTorch's OpInfo database through aotgrad (and PyTorch's aot_function) against eager.

For every op that supports autograd in float32 on CPU, the first samples of
``op.sample_inputs`` run three ways — eagerly, through ``aotgrad.aot_function``
and through PyTorch's ``aot_function``, both with nop compilers — and the
outputs and input gradients (for seeded random cotangents) are compared
with eager's. Each sample ends as one of:

- ``pass``: values and gradients match;
- ``error``: the compiled function raised (a loud failure, never a wrong result);
- ``mismatch``: it returned something different from eager (a silent failure);
- ``skip``: eager itself rejects the sample.

An op passes when all of its samples pass.

    make sweep                          # everything: JSON report + summary
    python sweep/opinfo_sweep.py --every 9 --samples 2   # the CI subset
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from functorch.compile import aot_function as torch_aot_function

import aotgrad

Runner = Callable[[Callable[..., Any]], Callable[..., Any]]

RUNNERS: dict[str, Runner] = {
    "aotgrad": lambda fn: aotgrad.aot_function(fn, aotgrad.nop, aotgrad.nop),
    "pytorch": lambda fn: torch_aot_function(fn, aotgrad.nop, aotgrad.nop),
}

# Ops whose outputs are uninitialized memory: only shapes and dtypes are comparable.
UNINITIALIZED = {
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_strided",
    "empty_permuted",
}


@dataclass(frozen=True)
class Outcome:
    op: str
    sample: int
    runner: str
    status: str  # pass | error | mismatch | skip
    detail: str = ""


def ops_to_sweep(every: int = 1) -> list[Any]:
    from torch.testing._internal import common_methods_invocations
    from torch.testing._internal.common_methods_invocations import op_db

    common_methods_invocations.wrapper_set_seed = _unseeded

    ops = [
        op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")
    ]
    ops.sort(key=lambda op: op.full_name)
    return ops[::every]


def samples_of(op: Any, limit: int) -> list[Any]:
    torch.manual_seed(0)
    samples = []
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        samples.append(sample)
        if len(samples) == limit:
            break
    return samples


# OpInfo's random ops seed inside the op (``torch.testing._utils.wrapper_set_seed``), under
# ``freeze_rng_state``, which restores the caller's stream at its exit: a captured function may
# reseed before its random ops, not restore the stream afterwards (Note [Reseeding inside the
# function] in aotgrad/capture/analyses/random.py). ``run`` seeds before every call instead, which is
# the same for one call of eager.
def _unseeded(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def call_of(op: Any, sample: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn(args, kwargs)``: tensors in keyword arguments are inputs too, not constants."""

    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return op(*args, **kwargs)

    return fn, ((sample.input, *sample.args), dict(sample.kwargs))


def fresh_copy(args: Any) -> Any:
    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(copy, args)


def run(fn: Callable[..., Any], args: Any) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Call ``fn`` on a copy of ``args``; outputs and grads of inputs for seeded cotangents."""
    args = fresh_copy(args)
    torch.manual_seed(42)  # what OpInfo's wrapper_set_seed gives random ops in eager
    outputs = pytree.tree_leaves(fn(*args))
    inputs = [
        t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    targets = [
        o
        for o in outputs
        if isinstance(o, torch.Tensor)
        and o.requires_grad
        and (o.is_floating_point() or o.is_complex())
    ]
    if not inputs or not targets:
        return outputs, []
    generator = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in targets]
    grads = torch.autograd.grad(targets, inputs, cotangents, allow_unused=True)
    return outputs, list(grads)


def compare(name: str, eager: Any, got: Any, values: bool) -> str | None:
    if isinstance(eager, torch.Tensor) != isinstance(got, torch.Tensor):
        return f"{name}: {type(got).__name__} != eager {type(eager).__name__}"
    if not isinstance(eager, torch.Tensor):
        return None if eager == got else f"{name}: {got!r} != eager {eager!r}"
    if eager.shape != got.shape or eager.dtype != got.dtype:
        return f"{name}: {got.dtype}{list(got.shape)} != eager {eager.dtype}{list(eager.shape)}"
    if not values:
        return None
    try:
        torch.testing.assert_close(
            got.detach(), eager.detach(), rtol=1e-5, atol=1e-5, equal_nan=True
        )
    except AssertionError as e:
        return f"{name}: " + " ".join(str(e).split())[:200]
    return None


def check_sample(op: Any, index: int, sample: Any, runners: list[str]) -> list[Outcome]:
    fn, args = call_of(op, sample)
    try:
        eager_out, eager_grads = run(fn, args)
    except Exception as e:  # eager rejects the sample: nothing to compare
        return [
            Outcome(op.full_name, index, r, "skip", f"eager: {type(e).__name__}") for r in runners
        ]
    values = op.name not in UNINITIALIZED
    outcomes = []
    for runner in runners:
        try:
            out, grads = run(RUNNERS[runner](fn), args)
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            outcomes.append(
                Outcome(op.full_name, index, runner, "error", f"{type(e).__name__}: {first}")
            )
            continue
        problems = [
            compare(f"output {i}", e, g, values)
            for i, (e, g) in enumerate(zip(eager_out, out, strict=False))
        ]
        if len(out) != len(eager_out):
            problems.append(f"{len(out)} outputs != eager {len(eager_out)}")
        problems += [
            compare(f"grad {i}", e, g, values)
            for i, (e, g) in enumerate(zip(eager_grads, grads, strict=False))
        ]
        if len(grads) != len(eager_grads):
            problems.append(f"{len(grads)} grads != eager {len(eager_grads)}")
        found = [p for p in problems if p]
        status = "mismatch" if found else "pass"
        outcomes.append(Outcome(op.full_name, index, runner, status, "; ".join(found)))
    return outcomes


def sweep(every: int, samples: int, runners: list[str]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for op in ops_to_sweep(every):
        try:
            op_samples = samples_of(op, samples)
        except Exception as e:
            outcomes += [
                Outcome(op.full_name, 0, r, "skip", f"samples: {type(e).__name__}") for r in runners
            ]
            continue
        for index, sample in enumerate(op_samples):
            outcomes += check_sample(op, index, sample, runners)
    return outcomes


def summarize(outcomes: list[Outcome], runners: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for runner in runners:
        per_op: dict[str, set[str]] = {}
        for o in outcomes:
            if o.runner == runner:
                per_op.setdefault(o.op, set()).add(o.status)
        compared = {op: s - {"skip"} for op, s in per_op.items() if s - {"skip"}}
        summary[runner] = {
            "ops": len(compared),
            "passing_ops": sum(1 for s in compared.values() if s == {"pass"}),
            "ops_with_errors": sorted(op for op, s in compared.items() if "error" in s),
            "ops_with_mismatches": sorted(op for op, s in compared.items() if "mismatch" in s),
            "samples": {
                st: sum(1 for o in outcomes if o.runner == runner and o.status == st)
                for st in ("pass", "error", "mismatch", "skip")
            },
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="sweep every k-th op (sorted by name)")
    parser.add_argument("--samples", type=int, default=3, help="samples per op")
    parser.add_argument("--runners", default="aotgrad,pytorch")
    parser.add_argument("--out", default="sweep/report.json")
    options = parser.parse_args(argv)
    runners = options.runners.split(",")
    start = time.perf_counter()
    outcomes = sweep(options.every, options.samples, runners)
    summary = summarize(outcomes, runners)
    report = {
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary,
        "outcomes": [asdict(o) for o in outcomes],
    }
    Path(options.out).write_text(json.dumps(report, indent=1))
    for runner, s in summary.items():
        print(
            f"{runner:8} {s['passing_ops']:4} / {s['ops']} ops pass;"
            f" {len(s['ops_with_errors'])} with loud errors, {len(s['ops_with_mismatches'])} with"
            f" silent mismatches; samples {s['samples']}"
        )
    for runner, s in summary.items():
        if s["ops_with_mismatches"]:
            print(f"{runner} silent mismatches: {', '.join(s['ops_with_mismatches'])}")
    print(f"report: {options.out} ({report['seconds']} s)")
    ours = summary.get("aotgrad")
    if ours is None:
        return 0
    theirs = summary.get("pytorch", {"passing_ops": 0})
    ok = not ours["ops_with_mismatches"] and ours["passing_ops"] >= theirs["passing_ops"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
