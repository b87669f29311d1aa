"""The peak of a step, as a report: how high, where in the step, and what is live then.

``memory_report()`` ends with :func:`peak_report`; ``aotgrad show`` prints it, and the
``show --json`` document and the HTML page carry :func:`peak_document`. The numbers are
``Partitioned.peak`` (Note [What a step holds] in ``partition/memory.py``); this module
only words them, and names the sizes they were counted at where sizes are symbolic (Note [A
peak of symbolic sizes]).
"""

from __future__ import annotations

import os
from typing import Any

from aotgrad.errors import UserFrame
from aotgrad.partition import LiveValue, Partitioned, PeakEstimate
from aotgrad.partition.sizes import sizes_text
from aotgrad.report.saved_report import format_bytes

__all__ = ["by_kind", "peak_document", "peak_report", "predicted_peak", "sizes_line"]

# The live values' kinds, in the order the report totals them ("live then: ...").
KIND_TITLES = {
    "input": "inputs",
    "output": "outputs",
    "saved": "saved",
    "cotangent": "cotangents",
    "gradient": "gradients",
    "temporary": "temporaries",
    "workspace": "workspace",
}

# Note [A peak of symbolic sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under dynamic shapes the graphs' storage sizes are SymInts. The peak is
# predicted at the example inputs' sizes (the call that traced: Note [Weights
# at the example sizes]), and every report of it says so, right under the
# total, never a number without its sizes::
#
#     aotgrad.trace(f, torch.randn(8, 16), dynamic=True).memory_report()
#     peak of a step (forward, then .backward(), every .grad None): 10.2 KiB (10432 B)
#       at the example sizes s0 = 8 (x.size()[0]); other sizes hold more or less
#
# The document (``show --json``, the HTML page) carries the same sizes
# (``peak.sizes``). Reading a size's example value adds no guard, so a report
# never narrows the sizes the capture serves.


def predicted_peak(partitioned: Partitioned) -> PeakEstimate:
    """``partitioned.peak``: under dynamic shapes, at the example sizes it names (Note [A peak
    of symbolic sizes]).

    >>> import torch, aotgrad
    >>> d = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(10, requires_grad=True), dynamic=True)
    >>> [(s.source, s.value) for s in predicted_peak(d.partitioned).sizes]
    [('x.size()[0]', 10)]
    """
    return partitioned.peak


def sizes_line(peak: PeakEstimate) -> str | None:
    """The sizes the peak's bytes were counted at, in words; None for static shapes."""
    if not peak.sizes:
        return None
    return f"at the example sizes {sizes_text(peak.sizes)}; other sizes hold more or less"


def peak_document(partitioned: Partitioned) -> dict[str, Any]:
    """``PeakEstimate.to_dict()`` of the predicted peak with ``by_kind`` (the bytes live per
    kind, as ``memory_report`` totals them); ``sizes`` names the example sizes under dynamic
    shapes.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(1000, requires_grad=True))
    >>> document = peak_document(t.partitioned)
    >>> document["nbytes"], [(k["title"], k["nbytes"]) for k in document["by_kind"]][-2:]
    (12008, [('gradients', 4000), ('temporaries', 4000)])
    """
    peak = predicted_peak(partitioned)
    kinds = [
        {"kind": k, "title": KIND_TITLES.get(k, k), "nbytes": n} for k, n in by_kind(peak.live)
    ]
    return {**peak.to_dict(), "by_kind": kinds}


def peak_report(partitioned: Partitioned, top: int = 10) -> str:
    """The predicted peak of a step ``f(*inputs).backward()``: its bytes (inputs, and what the
    step allocated: what ``aotgrad.testing.measure_peak`` measures), where it occurs (graph,
    op, module, source line), what is live then by kind, and the ``top`` largest live storages.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(1000, requires_grad=True))
    >>> print(peak_report(t.partitioned).splitlines()[0])
    peak of a step (forward, then .backward(), every .grad None): 11.7 KiB (12008 B)
    """
    peak = predicted_peak(partitioned)
    step = (
        "a step (forward, then .backward(), every .grad None)"
        if partitioned.backward is not None
        else "a call (forward only: nothing needs a gradient)"
    )
    sizes = sizes_line(peak)  # Note [A peak of symbolic sizes]
    lines = [
        f"peak of {step}: {_bytes(peak.nbytes)}",
        *([f"  {sizes}"] if sizes else []),
        f"  = {format_bytes(peak.inputs)} inputs (held by the caller)"
        f" + {_bytes(peak.allocated)} allocated by the step"
        " (what aotgrad.testing.measure_peak measures)",
        f"at: {where(peak)}",
        f"live then: {kind_totals(peak.live)}",
    ]
    plan = [f"plan: {partitioned.note}"] if partitioned.note else []  # what the strategy says
    return "\n".join([*lines, *_live_rows(peak.live, top), *plan])


def where(peak: PeakEstimate) -> str:
    """Where in the step the peak occurs, in words.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin().sum(), torch.ones(1000, requires_grad=True))
    >>> where(t.partitioned.peak)
    'backward graph, node mul (aten.mul.Tensor), module <lambda>'
    """
    if not peak.node:
        return "as the step starts: only its inputs are live"
    if peak.graph == "gradients":
        text = (
            f"as the gradients become .grad: autograd copies {peak.node} ({peak.op})"
            " to its input's layout"
        )
    else:
        text = f"{peak.graph} graph, node {peak.node} ({peak.op})"
    if peak.module:
        text += f", module {peak.module}"
    if peak.source is not None:
        text += f", {_line(peak.source)}  {peak.source.line.strip()}"
    return text


def by_kind(live: tuple[LiveValue, ...]) -> list[tuple[str, int]]:
    """Bytes live per kind, in ``KIND_TITLES`` order (a kind it does not name: after them).

    >>> from aotgrad.partition import LiveValue
    >>> by_kind((LiveValue("mm", "backward", "temporary", 512, "fc", None),
    ...          LiveValue("w", "forward", "input", 4096, "fc", None)))
    [('input', 4096), ('temporary', 512)]
    """
    totals: dict[str, int] = {}
    for value in live:
        totals[value.kind] = totals.get(value.kind, 0) + value.nbytes
    order = [*KIND_TITLES, *sorted(set(totals) - set(KIND_TITLES))]
    return [(kind, totals[kind]) for kind in order if kind in totals]


def kind_totals(live: tuple[LiveValue, ...]) -> str:
    """``by_kind`` in words: ``'4.0 KiB inputs, 512 B temporaries'``."""
    return ", ".join(f"{format_bytes(n)} {KIND_TITLES.get(k, k)}" for k, n in by_kind(live))


def _live_rows(live: tuple[LiveValue, ...], top: int) -> list[str]:
    shown, rest = live[:top], live[top:]
    cells = [["name", "graph", "kind", "bytes", "module", "source"]]
    for v in shown:
        source = "" if v.source is None else f"{_line(v.source)}  {v.source.line.strip()}"
        cells.append([v.name, v.graph, v.kind, format_bytes(v.nbytes), v.module, source])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    rows = []
    for row in cells:
        padded = [
            c.rjust(w) if i == 3 else c.ljust(w)
            for i, (c, w) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        rows.append("  " + "  ".join([*padded, row[-1]]).rstrip())
    rows.insert(1, "  " + "-" * (len(rows[0]) - 2))
    if rest:
        rest_bytes = sum(v.nbytes for v in rest)
        rows.append(f"  ... and {len(rest)} more ({format_bytes(rest_bytes)})")
    return rows


def _bytes(n: int) -> str:
    """``format_bytes`` with the exact count where it rounds: ``'1.5 KiB (1536 B)'``."""
    text = format_bytes(n)
    return text if text == f"{n} B" else f"{text} ({n} B)"


def _line(source: UserFrame) -> str:
    return f"{os.path.basename(source.filename)}:{source.lineno}"
