"""Profiler attribution: forward and backward time per forward op and per module.

:func:`profile` traces the function, runs its forward and backward graphs
under ``torch.profiler`` with one ``record_function`` range per group of
consecutive nodes sharing a sequence number, and adds the ranges' times up
per forward op (Note [Sequence numbers]) and per module.

>>> import torch, aotgrad
>>> report = aotgrad.profile(torch.nn.Linear(4, 2), torch.randn(3, 4))
>>> sorted(report.modules)
['Linear']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.profiler import ProfilerActivity, record_function

from aotgrad.api import AOTFunction, AOTModule, Traced, trace
from aotgrad.capture import Kind, node_info
from aotgrad.capture.analyses.input_aliases import graph_inputs

_PREFIX = "aotgrad"


@dataclass
class OpTimes:
    """Time attributed to one forward op (or, for ``module`` rows, one module)."""

    seq_nr: int | None
    op: str
    module: str
    forward_us: float = 0.0
    backward_us: float = 0.0
    backward_ops: int = 0


@dataclass
class ProfileReport:
    """Per forward op (by sequence number) and per module: forward and backward time."""

    ops: dict[int | None, OpTimes] = field(default_factory=dict)
    modules: dict[str, OpTimes] = field(default_factory=dict)
    repeats: int = 1

    def __str__(self) -> str:
        lines = [f"per module (µs per call, mean of {self.repeats}):"]
        lines.append(f"  {'module':<24} {'forward':>10} {'backward':>10} {'bw ops':>7}")
        for name, t in sorted(self.modules.items(), key=lambda kv: -kv[1].backward_us):
            lines.append(
                f"  {name:<24} {t.forward_us:>10.1f} {t.backward_us:>10.1f} {t.backward_ops:>7}"
            )
        lines.append("per forward op:")
        lines.append(
            f"  {'seq':>4} {'op':<50} {'module':<20} {'forward':>10} {'backward':>10} {'bw ops':>7}"
        )
        for seq, t in sorted(self.ops.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            label = "-" if seq is None else str(seq)
            lines.append(
                f"  {label:>4} {t.op:<50} {t.module:<20} {t.forward_us:>10.1f}"
                f" {t.backward_us:>10.1f} {t.backward_ops:>7}"
            )
        return "\n".join(lines)


def profile(fn: Callable[..., Any], *args: Any, repeats: int = 3, **kwargs: Any) -> ProfileReport:
    """Run ``fn``'s graphs forward and backward under the profiler; attribute every range.

    ``fn`` may be a function, a module, or what ``aot_function`` / ``aot_module`` returned.
    Cotangents are ones. Times are CPU times of the ranges, averaged over ``repeats``.
    """
    traced = trace(_underlying(fn), *args, **kwargs)
    report = _empty_report(traced, repeats)
    primals = _primals(traced, args, kwargs)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            _run_once(traced, primals)
    for event in prof.events():
        if event.name.startswith(_PREFIX + ":"):
            _attribute(report, event.name, event.cpu_time_total / repeats)
    return report


def _underlying(fn: Any) -> Any:
    if isinstance(fn, AOTModule):
        return fn.orig_module
    if isinstance(fn, AOTFunction):
        return fn.__wrapped__  # type: ignore[attr-defined]
    return fn


def _primals(traced: Traced, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The forward graph's inputs: the lifted state (a module's parameters and buffers, the
    tensors a function reaches through globals, closures and module arguments), then the
    call's tensors, as ``Traced`` passes them."""
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [leaves[i] for i in traced.partitioned.joint.inputs.tensor_positions]
    primals = [t.detach() for t in (*traced._lifted, *tensors)]
    return graph_inputs(primals, traced.partitioned.joint.input_bases)


def _run_once(traced: Traced, primals: list[torch.Tensor]) -> None:
    with torch.no_grad():
        results = _RangeInterpreter(traced.forward).run(*primals)
        if traced.backward is None:
            return
        signature = traced.signature
        placeholders = [n for n in traced.backward.graph.nodes if n.op == "placeholder"]
        cotangents = [
            torch.ones(n.meta["val"].shape, dtype=n.meta["val"].dtype)
            for n in placeholders[signature.cotangents_in_backward]
        ]
        saved = results[signature.saved_in_forward]
        _RangeInterpreter(traced.backward).run(*saved, *cotangents)


class _RangeInterpreter(fx.Interpreter):
    """Runs a graph with one ``record_function`` range per run of nodes sharing a seq_nr."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._key: tuple[Any, ...] | None = None
        with contextlib.ExitStack() as self._range:  # the open range, closed at the end
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function":
            info = node_info(n)
            key = (info.phase.value, info.seq_nr, info.kind.value, info.module)
            if key != self._key:
                self._range.close()
                self._key = key
                self._range.enter_context(record_function(":".join([_PREFIX, *map(str, key)])))
        return super().run_node(n)


def _empty_report(traced: Traced, repeats: int) -> ProfileReport:
    report = ProfileReport(repeats=repeats)
    for node in (n for n in traced.joint.graph.nodes if n.op == "call_function"):
        info = node_info(node)
        if info.kind is Kind.ACCUMULATE:
            seq, op = None, "(gradient accumulation)"
        else:
            seq, op = info.seq_nr, str(node.target)
        times = report.ops.setdefault(seq, OpTimes(seq_nr=seq, op=op, module=info.module))
        module = report.modules.setdefault(
            info.module, OpTimes(seq_nr=None, op="", module=info.module)
        )
        if info.phase.value != "forward":
            times.backward_ops += 1
            module.backward_ops += 1
    return report


def _attribute(report: ProfileReport, name: str, micros: float) -> None:
    _, phase, seq_text, kind, module = name.split(":", 4)
    seq = None if kind == Kind.ACCUMULATE.value or seq_text == "None" else int(seq_text)
    for times in (report.ops.get(seq), report.modules.get(module)):
        if times is None:
            continue
        if phase == "forward":
            times.forward_us += micros
        else:
            times.backward_us += micros
