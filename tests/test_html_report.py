"""``render_html`` / ``to_html`` / ``aotgrad show --html``: one self-contained page, strings as data.

No browser here: these read the page as text (its links, its escaping, its embedded JSON).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import shutil
import subprocess

import pytest
import torch
import torch.utils.checkpoint

import aotgrad
from aotgrad.cli import main
from aotgrad.report import show_document
from aotgrad.report.html import embedded_document, inline_script, render_html
from aotgrad.report.peak_report import peak_document

XSS = "<img src=x onerror=alert(1)>"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(XSS, torch.nn.Conv2d(1, 2, 3))

    def forward(self, x):
        return getattr(self, XSS)(x).relu()  # </script><script>alert(2)</script>


def _page() -> tuple[aotgrad.Traced, str]:
    traced = aotgrad.trace(Block(), torch.randn(1, 1, 5, 5))
    return traced, render_html(traced.partitioned)


def test_page_links_to_nothing():
    _, page = _page()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "@import" not in page


VENDOR = pathlib.Path(aotgrad.__file__).parent / "report" / "vendor"


def test_vendored_dagre_is_the_pinned_file():
    readme = (VENDOR / "README.md").read_text()
    pinned = re.search(r"\| dagre\.min\.js \|.*\| ([0-9a-f]{64}) \|", readme)
    assert pinned is not None
    assert hashlib.sha256((VENDOR / "dagre.min.js").read_bytes()).hexdigest() == pinned.group(1)


def test_page_inlines_dagre_then_the_report_script():
    _, page = _page()
    dagre = inline_script((VENDOR / "dagre.min.js").read_text())
    assert "://" in (VENDOR / "dagre.min.js").read_text() and "://" not in dagre
    assert dagre in page
    assert page.index(dagre) < page.rindex("<script>")  # the report's script comes last
    for hook in ('id="forward-graph"', 'id="backward-graph"', 'id="search"', 'id="modules"'):
        assert hook in page


def test_user_strings_appear_only_escaped():
    traced, page = _page()
    modules = {n.get("module") for n in show_document(traced.partitioned)["graphs"]["forward"]}
    assert XSS in modules  # the page really carries the hostile name...
    assert XSS not in page  # ...but never as markup
    assert "alert(2)" in page and "</script><script>alert(2)" not in page
    assert page.count("</script>") == 3  # the data tag, dagre and the report script, nothing else
    peak = embedded_document(page)["peak"]  # the peak panel's strings: data too
    assert XSS in {v["module"] for v in peak["live"]}
    assert any("</script><script>alert(2)" in (v["source"] or "") for v in peak["live"])


def test_embedded_json_round_trips():
    traced, page = _page()
    document = embedded_document(page)
    expected = show_document(traced.partitioned)
    assert document["signature"] == expected["signature"]
    assert document["saved"] == expected["saved"]
    for phase in ("forward", "backward"):
        without_meta = [_drop(n, "shape", "dtype", "inputs") for n in document["graphs"][phase]]
        assert without_meta == expected["graphs"][phase]
    conv = next(n for n in document["graphs"]["forward"] if "convolution" in n["target"])
    assert conv["shape"] == [1, 2, 3, 3] and conv["dtype"] == "float32"


def _drop(entry: dict, *keys: str) -> dict:
    return {k: v for k, v in entry.items() if k not in keys}


def test_backward_nodes_share_seq_nr_with_their_forward_op():
    _, page = _page()
    graphs = embedded_document(page)["graphs"]
    backward = next(n for n in graphs["backward"] if "convolution_backward" in n["target"])
    forward = [
        n["target"]
        for n in graphs["forward"]
        if n["op"] == "call_function" and n.get("seq_nr") == backward["seq_nr"]
    ]
    assert forward == ["aten.convolution.default"]


def test_to_html_on_aot_module_after_first_call(tmp_path):
    model = aotgrad.aot_module(Block())
    model(torch.randn(1, 1, 5, 5))
    model.to_html(tmp_path / "report.html")
    assert embedded_document((tmp_path / "report.html").read_text())["saved"]


def test_cli_writes_html(tmp_path, capsys):
    example = tmp_path / "example.py"
    example.write_text(
        "import torch\n\n"
        "def fn(x):\n    return x.sin()\n\n"
        "def example_inputs():\n    return (torch.ones(2, requires_grad=True),), {}\n"
    )
    out = tmp_path / "out.html"
    assert main(["show", f"{example}:fn", "--html", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = out.read_text()
    assert embedded_document(page)["graphs"]["forward"][1]["source"]["code"] == "return x.sin()"


def _run_smoke(page: str, click: str, query: str) -> dict:
    smoke = pathlib.Path(__file__).with_name("html_smoke.js")
    result = subprocess.run(
        ["node", str(smoke), click, query], input=page, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_page_script_links_backward_to_forward_and_saved_in_a_fake_dom():
    """Not a browser: tests/html_smoke.js runs the inline script on a stub DOM that fails on
    any innerHTML, clicks ``convolution_backward`` and searches for ``relu``."""
    _, page = _page()
    seen = _run_smoke(page, "convolution_backward", "relu")
    assert [row[2] for row in seen["forward"]] == ["aten.convolution.default"]
    assert seen["forward"][0][4] == XSS  # the module name, as text
    assert {row[0] for row in seen["saved"]} == {"x", "img_src_x_onerror_alert_1_weight"}
    assert seen["summary"].endswith("rows match") and seen["hidden"] > 0
    assert (
        seen["clicked"]
        == "convolution_backward: 1 forward op(s) with seq_nr 0, reads 2 saved value(s)"
    )
    # the drawings: small, so every node but the output is drawn; a click there marks the same
    assert seen["clickedInDrawing"] == seen["clicked"]
    assert seen["drawn"] == [len(embedded_document(page)["graphs"][p]) - 1 for p in PHASES]
    assert seen["graphMarks"]["backward"][0] == ["convolution_backward"]
    assert "convolution" in seen["graphMarks"]["forward"][1]
    assert set(seen["graphMarks"]["forward"][1]) - {"convolution"} == {
        row[0] for row in seen["saved"]
    }
    assert seen["graphMatches"] == ["relu"] or "relu" in seen["graphMatches"]
    assert seen["groups"] == []


PHASES = ("forward", "backward")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_big_drawings_are_collapsed_by_module():
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(60)]
    )
    traced = aotgrad.trace(model, torch.randn(2, 4))
    page = render_html(traced.partitioned)
    assert len(embedded_document(page)["graphs"]["forward"]) > 150
    seen = _run_smoke(page, "threshold_backward", "relu")
    assert all(0 < count <= 150 for count in seen["drawn"])
    assert "0.0" in seen["groups"]  # Linear 0.0 collapsed (its Sequential 0 is open)
    # the clicked node sits in a collapsed group, which is marked in its stead
    assert seen["clickedInDrawing"] is None
    assert seen["graphMarks"]["backward"][0] == ["module 59.1"]


def test_recomputed_backward_nodes_carry_reason_and_flops():
    def fn(x, w):
        return torch.utils.checkpoint.checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=False)

    traced = aotgrad.trace(fn, torch.randn(4, 4, requires_grad=True), torch.randn(4, 4))
    backward = embedded_document(render_html(traced.partitioned))["graphs"]["backward"]
    recomputed = {n["target"]: n["recomputed"] for n in backward if "recomputed" in n}
    assert "checkpoint" in recomputed["aten.mm.default"]["reason"]
    assert recomputed["aten.mm.default"]["flops"] == 2 * 4 * 4 * 4


def test_profile_times_reach_the_module_panel(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.ReLU()))
    x = torch.randn(2, 3)
    profile = aotgrad.profile(model, x, repeats=1)
    aotgrad.trace(model, x).to_html(tmp_path / "report.html", profile)
    page = (tmp_path / "report.html").read_text()
    document = embedded_document(page)
    assert {m["module"] for m in document["profile"]["modules"]} == {"0", "1.0"}
    if shutil.which("node") is None:
        return
    seen = _run_smoke(page, "threshold_backward", "relu")
    modules = {row[0].strip(): row[1:] for row in seen["modules"]}
    assert set(modules) == {"0", "1", "1.0"} and modules["1"][:2] == ["1", "1"]
    assert seen["forward"][0][-1] != ""  # relu's forward time


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_a_value_read_by_many_ops_is_drawn_without_edges():
    def fn(x, w):
        for _ in range(12):
            x = (x @ w).sin()
        return x.sum()

    traced = aotgrad.trace(fn, torch.randn(2, 2, requires_grad=True), torch.randn(2, 2))
    seen = _run_smoke(render_html(traced.partitioned), "cos", "")
    assert seen["fanout"] == ["w"]


def test_page_carries_the_predicted_peak():
    traced, page = _page()
    assert 'id="peak"' in page
    document = embedded_document(page)
    assert document["peak"] == peak_document(traced.partitioned)
    assert document["peak"]["nbytes"] == traced.partitioned.peak.nbytes
    dynamic = aotgrad.trace(Block(), torch.randn(1, 1, 5, 5), dynamic=True)
    sizes = embedded_document(render_html(dynamic.partitioned))["peak"]["sizes"]
    assert [(s["source"], s["value"]) for s in sizes] == [("x.size()[2]", 5), ("x.size()[3]", 5)]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_peak_panel_names_the_op_as_text_and_links_it_to_its_row():
    traced, page = _page()
    peak = traced.partitioned.peak
    seen = _run_smoke(page, "convolution_backward", "relu")
    assert seen["peak"][0].startswith(
        f"peak of a step (forward, then .backward(), every .grad None): {peak.nbytes} B"
    )
    assert seen["peak"][2] == peak.node and XSS in seen["peak"][3]  # the module, as text
    assert any("</script><script>alert(2)" in text for text in seen["peak"])
    live = [text for text in seen["peak"] if text in {v.name for v in peak.live}]
    assert live[1:] == [v.name for v in peak.live]  # the op's link, then the rows largest first
    assert seen["peakLink"] == [peak.graph, peak.node]
    assert [row[1] for row in seen["peakSelected"]] == [peak.node]
    dynamic = aotgrad.trace(Block(), torch.randn(1, 1, 5, 5), dynamic=True)
    seen = _run_smoke(render_html(dynamic.partitioned), "convolution_backward", "")
    sizes = r"at the example sizes s\d+ = 5 \(x.size\(\)\[2\]\), s\d+ = 5 \(x.size\(\)\[3\]\); "
    assert re.fullmatch(sizes + "other sizes hold more or less", seen["peak"][1])
