"""The predicted peak in ``memory_report()``, ``aotgrad show`` and ``show --json``: how high,
where in the step, and what is live then (``report/peak_report.py``)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import torch
import torch.nn.functional as F
from torch import nn

import aotgrad
from aotgrad.cli import _load, main
from aotgrad.report import format_bytes, show_document
from aotgrad.report.peak_report import by_kind, peak_report
from aotgrad.testing import measure_peak


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x, y):
        h = self.fc1(x).relu()
        return F.cross_entropy(self.fc2(h), y)  # the loss inside the function


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(32, 16), torch.randint(0, 4, (32,))


def _peak_section(report: str) -> list[str]:
    saved, peak = report.split("\n\n")
    assert saved.splitlines()[-1].startswith("total:")  # the saved values come first, as before
    return peak.splitlines()


def _live_rows(lines: list[str]) -> list[list[str]]:
    """The table under the peak: its rows split on runs of two or more spaces."""
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "graph"])
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start + 2 :] if "..." not in line]


def test_memory_report_shows_the_measured_step_peak_where_and_what():
    model = MLP()
    x, y = _inputs()
    compiled = aotgrad.aot_module(model)
    compiled(x, y).backward()  # the first call traces and compiles
    for p in model.parameters():
        p.grad = None
    peak = compiled.compiled.partitioned.peak
    measured = measure_peak(lambda: compiled(x, y).backward())
    assert peak.allocated == measured  # the report's numbers are what the allocator sees

    lines = _peak_section(compiled.memory_report())
    assert lines[0] == (
        "peak of a step (forward, then .backward(), every .grad None):"
        f" {format_bytes(peak.nbytes)} ({peak.nbytes} B)"
    )
    assert f"+ {format_bytes(measured)} ({measured} B) allocated by the step" in lines[1]
    assert f"{format_bytes(peak.inputs)} inputs" in lines[1]
    at = lines[2]
    assert at.startswith(f"at: {peak.graph} graph, node {peak.node} ({peak.op})")
    assert peak.source is not None and peak.module in ("fc1", "fc2", "MLP")
    assert f"module {peak.module}" in at
    assert f"test_peak_report.py:{peak.source.lineno}  {peak.source.line.strip()}" in at
    # what is live then: by kind, then largest first, each with its kind, module and source
    kinds = dict(by_kind(peak.live))
    assert sum(kinds.values()) == peak.nbytes and kinds["input"] == peak.inputs
    assert lines[3].startswith(f"live then: {format_bytes(peak.inputs)} inputs, ")
    rows = _live_rows(lines)
    assert [r[0] for r in rows] == [v.name for v in peak.live[:10]]
    assert [r[3] for r in rows] == [format_bytes(v.nbytes) for v in peak.live[:10]]
    assert [v.nbytes for v in peak.live] == sorted((v.nbytes for v in peak.live), reverse=True)
    weight = next(r for r in rows if r[0] == "fc1_weight")
    assert weight[1:3] + weight[4:] == ["forward", "input", "fc1"]
    made = next(v for v in peak.live[:10] if v.source is not None)
    row = next(r for r in rows if r[0] == made.name)
    assert made.source is not None
    assert row[-2:] == [f"test_peak_report.py:{made.source.lineno}", made.source.line.strip()]


def test_more_than_ten_live_values_end_with_how_many_more_and_their_bytes():
    def fn(*ws):
        return sum((w * (i + 1)).sin().sum() for i, w in enumerate(ws))

    ws = [torch.randn(8 * (i + 1), requires_grad=True) for i in range(14)]
    traced = aotgrad.trace(fn, *ws)
    live = traced.partitioned.peak.live
    assert len(live) > 12
    report = peak_report(traced.partitioned, top=12)
    rest = live[12:]
    assert report.splitlines()[-1] == (
        f"  ... and {len(rest)} more ({format_bytes(sum(v.nbytes for v in rest))})"
    )
    assert len(_live_rows(report.splitlines())) == 12


def test_symbolic_sizes_are_reported_at_the_example_sizes_it_names():
    """Note [A peak of symbolic sizes]: the static trace's numbers, and the sizes they are at."""
    static = aotgrad.trace(MLP(), *_inputs())
    traced = aotgrad.trace(MLP(), *_inputs(), dynamic=True)
    guards = traced.partitioned.joint.guards
    before = guards.shape_env.guards[:]
    lines = _peak_section(traced.memory_report())
    rows = _peak_section(static.memory_report())
    batch = _inputs()[0].shape[0]
    assert lines[0] == rows[0]
    sizes = (
        rf"  at the example sizes s\d+ = {batch} \(x.size\(\)\[0\]\); other sizes hold more or less"
    )
    assert re.fullmatch(sizes, lines[1])
    assert lines[2:] == rows[1:]
    document = show_document(traced.partitioned)["peak"]
    assert document["allocated"] == static.partitioned.peak.allocated
    assert [(s["source"], s["value"]) for s in document["sizes"]] == [("x.size()[0]", batch)]
    assert guards.shape_env.guards == before  # reading the sizes added no guard


def test_a_forward_only_call_has_a_peak_too():
    traced = aotgrad.trace(lambda x: x.sin().cos(), torch.ones(100))
    assert traced.backward is None
    lines = _peak_section(traced.memory_report())
    assert lines[0].startswith("peak of a call (forward only: nothing needs a gradient): 1.2 KiB")
    assert lines[2].startswith("at: forward graph, node cos (aten.cos.default)")


EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "carry.py"


def test_show_prints_the_peak_and_json_carries_it(capsys):
    _, fn, args, kwargs = _load(f"{EXAMPLE}:fn", "example_inputs")
    peak = aotgrad.trace(fn, *args, **kwargs).partitioned.peak
    assert main(["show", f"{EXAMPLE}:fn", "--no-check"]) == 0
    out = capsys.readouterr().out
    section = out.split("=== peak memory ===\n")[1].split("\n\n")[0].splitlines()
    assert section[0].endswith(f": {format_bytes(peak.nbytes)}")
    assert section[2].startswith(f"at: {peak.graph} graph, node {peak.node} ({peak.op})")
    assert "carry.py:" in section[2]
    assert main(["show", f"{EXAMPLE}:fn", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    expected = {**peak.to_dict(), "by_kind": document["peak"]["by_kind"]}
    assert document["peak"] == json.loads(json.dumps(expected))
    assert sum(k["nbytes"] for k in document["peak"]["by_kind"]) == peak.nbytes


DOCS_MLP = """import torch
import torch.nn.functional as F


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.fc1(x).relu()
        return F.cross_entropy(self.fc2(h), y)
"""


def test_the_docs_report_is_what_the_report_prints(tmp_path):
    """docs/memory.md ("In the reports"): its sample, rows elided with '...', is this model's."""
    (tmp_path / "mlp.py").write_text(DOCS_MLP)
    spec = importlib.util.spec_from_file_location("docs_mlp", tmp_path / "mlp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    traced = aotgrad.trace(module.MLP(), torch.randn(8, 16), torch.randint(0, 4, (8,)))
    printed = _peak_section(traced.memory_report())
    text = (pathlib.Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    section = text.split("## In the reports", 1)[1]
    sample = section.split("```\n", 2)[1].splitlines()
    assert sample[0] == printed[0] and sample[-1] == printed[-1]
    lines = iter(printed)
    assert all(line in lines for line in sample if line != "  ...")  # in order
