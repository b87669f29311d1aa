"""The HTML report in a real browser: Playwright driving Debian's chromium (``make install``).

Every page is opened from a ``file://`` URL, as a user opens a report; each test fails on a
console error, an uncaught exception, a dialog (the hostile module name's ``alert``) or any
request other than the page itself.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

import aotgrad
from aotgrad.report import show_document
from browser import CHROMIUM, CHROMIUM_FLAGS
from models import GPT, ConvBN

playwright_api = pytest.importorskip("playwright.sync_api")

XSS = "<img src=x onerror=alert(1)>"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not pathlib.Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: run `make install` (or `make chromium`)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@dataclass
class Opened:
    """A report open in a tab, with everything the page did that a test must not allow."""

    page: object
    url: str
    seconds: float
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def check_clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.dialogs == [], self.dialogs
        assert [r for r in self.requests if r != self.url] == []


def open_report(browser, path: pathlib.Path) -> Opened:
    context = browser.new_context()
    page = context.new_page()
    url = path.resolve().as_uri()
    opened = Opened(page=page, url=url, seconds=0.0)
    page.on("console", lambda m: m.type == "error" and opened.errors.append(m.text))
    page.on("pageerror", lambda e: opened.errors.append(str(e)))
    page.on("request", lambda r: opened.requests.append(r.url))
    page.on("dialog", lambda d: (opened.dialogs.append(d.message), d.dismiss()))
    start = time.perf_counter()
    page.goto(url, wait_until="load")
    page.wait_for_selector("#forward tr[data-name]")
    opened.seconds = time.perf_counter() - start
    return opened


def report_of(traced: aotgrad.Traced, tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    path = tmp_path / f"{name}.html"
    traced.to_html(path)
    return path


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> tuple[aotgrad.Traced, pathlib.Path]:
    torch.manual_seed(0)
    traced = aotgrad.trace(ConvBN(), torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    return traced, report_of(traced, tmp_path_factory.mktemp("conv"), "conv")


@pytest.fixture(scope="module")
def gpt12(tmp_path_factory) -> tuple[aotgrad.Traced, pathlib.Path]:
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 16))
    traced = aotgrad.trace(GPT(blocks=12), idx, torch.randint(0, 64, (2, 16)))
    return traced, report_of(traced, tmp_path_factory.mktemp("gpt12"), "gpt12")


def entries(traced: aotgrad.Traced, phase: str) -> list[dict]:
    """The graph's nodes as the page has them (``show --json`` entries: seq_nr, module, ...)."""
    return show_document(traced.partitioned)["graphs"][phase]


def ops_with_seq_nr(traced: aotgrad.Traced, phase: str, seq_nr: int) -> set[str]:
    return {
        n["name"]
        for n in entries(traced, phase)
        if n["op"] == "call_function" and n["seq_nr"] == seq_nr
    }


def first(traced: aotgrad.Traced, phase: str, target: str, module: str = "") -> dict:
    return next(
        n
        for n in entries(traced, phase)
        if n["target"].startswith(target) and (n.get("module") or "").startswith(module)
    )


def names(page, selector: str) -> set[str]:
    return set(page.eval_on_selector_all(selector, "els => els.map(e => e.dataset.name)"))


def test_clicking_convolution_backward_highlights_its_convolution(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    node = first(traced, "backward", "aten.convolution_backward")
    page.click(f'#backward tr[data-name="{node["name"]}"]')
    linked = names(page, "#forward tr.linked")
    assert linked == ops_with_seq_nr(traced, "forward", node["seq_nr"])
    targets = {n["target"] for n in entries(traced, "forward") if n["name"] in linked}
    # As in the seed's table: BatchNorm's num_batches_tracked += 1 (no autograd node) shares
    # seq_nr 0 with the convolution.
    assert targets == {"aten.convolution.default", "aten.add.Tensor"}
    saved = {s["name"] for s in show_document(traced.partitioned)["saved"]}
    reads = set(node["args"]) & saved
    assert reads and names(page, "#saved tr.linked") == reads
    assert page.text_content("#summary") == (
        f"{node['name']}: {len(linked)} forward op(s) with seq_nr {node['seq_nr']}, "
        f"reads {len(reads)} saved value(s)"
    )
    opened.check_clean()


def test_clicking_in_the_drawing_marks_the_forward_drawing(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    assert page.locator("#forward-graph g.ggroup").count() == 0  # small: drawn whole
    node = first(traced, "backward", "aten.convolution_backward")
    page.click(f'#backward-graph g.gnode[data-name="{node["name"]}"]')
    expected = ops_with_seq_nr(traced, "forward", node["seq_nr"])
    assert names(page, "#forward tr.linked") == expected
    # The drawing marks the saved values it reads too (forward placeholders / ops).
    assert names(page, "#forward-graph g.gnode.linked") == expected | names(
        page, "#saved tr.linked"
    )
    assert names(page, "#backward-graph g.gnode.selected") == {node["name"]}
    opened.check_clean()


def test_clicking_a_forward_op_lists_its_backward_ops(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    forward = first(traced, "forward", "aten.convolution")
    page.click(f'#forward tr[data-name="{forward["name"]}"]')
    expected = ops_with_seq_nr(traced, "backward", forward["seq_nr"])
    assert "convolution_backward" in expected
    assert names(page, "#backward tr.linked") == expected
    assert names(page, "#backward-graph g.gnode.linked") == expected
    opened.check_clean()


def saved_bytes_column(page) -> list[int]:
    cells = page.eval_on_selector_all(
        "#saved tr[data-name]", "rows => rows.map(r => r.children[1].textContent)"
    )
    return [int(c) for c in cells]


def test_saved_table_sorts_and_shows_the_total(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    header = page.locator("#saved th", has_text="bytes")
    initial = saved_bytes_column(page)
    assert initial == sorted(initial, reverse=True)
    header.click()
    assert saved_bytes_column(page) == sorted(initial)
    header.click()
    assert saved_bytes_column(page) == sorted(initial, reverse=True)
    page.locator("#saved th", has_text="name").click()
    shown = page.eval_on_selector_all(
        "#saved tr[data-name]", "rows => rows.map(r => r.dataset.name)"
    )
    assert shown == sorted(shown, reverse=True) and len(shown) == len(initial)
    total = page.text_content("#saved tr.total")
    assert str(show_document(traced.partitioned)["saved_bytes"]) in total
    opened.check_clean()


def visible_rows(page, table: str) -> list[str]:
    return page.eval_on_selector_all(
        f"#{table} tr[data-name]",
        "rows => rows.filter(r => r.offsetParent !== null).map(r => r.dataset.search)",
    )


def test_search_finds_nodes_by_module_and_op(browser, conv):
    _, path = conv
    opened = open_report(browser, path)
    page = opened.page
    everything = visible_rows(page, "forward")
    page.fill("#search", "fc1")
    hits = visible_rows(page, "forward")
    assert hits and len(hits) < len(everything)
    assert all("fc1" in h for h in hits)
    page.fill("#search", "threshold_backward")
    assert len(visible_rows(page, "backward")) == 1 and visible_rows(page, "forward") == []
    page.fill("#search", "")
    assert len(visible_rows(page, "forward")) == len(everything)
    opened.check_clean()


class Hostile(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(XSS, torch.nn.Conv2d(1, 2, 3))

    def forward(self, x):
        return getattr(self, XSS)(x).relu()  # </script><script>alert(2)</script>


def test_hostile_module_name_is_text_and_runs_nothing(browser, tmp_path):
    traced = aotgrad.trace(Hostile(), torch.randn(1, 1, 5, 5))
    opened = open_report(browser, report_of(traced, tmp_path, "hostile"))
    page = opened.page
    page.wait_for_timeout(200)  # an injected onerror would have fired by now
    assert page.eval_on_selector_all("img, script[src], iframe", "els => els.length") == 0
    cells = page.eval_on_selector_all("#forward td", "tds => tds.map(t => t.textContent)")
    assert XSS in cells
    page.fill("#search", "onerror")
    assert visible_rows(page, "forward")
    assert "alert(2)" in page.text_content("#forward")
    opened.check_clean()


def test_gpt12_opens_and_links_in_the_browser(browser, gpt12):
    traced, path = gpt12
    opened = open_report(browser, path)
    page = opened.page
    print(f"gpt12 report: {path.stat().st_size} bytes, interactive in {opened.seconds:.2f} s")
    forward_rows = page.eval_on_selector_all("#forward tr[data-name]", "r => r.length")
    assert forward_rows == len(traced.partitioned.forward.graph.nodes)
    # A backward op of an op inside blocks.5's MLP: the drawing starts collapsed by module
    # (1,600+ forward nodes), so the forward op is inside a group, and the group is marked.
    forward = first(traced, "forward", "aten.addmm", module="blocks.5.mlp")
    node = next(
        n
        for n in entries(traced, "backward")
        if n["op"] == "call_function" and n["seq_nr"] == forward["seq_nr"]
    )
    page.click(f'#backward tr[data-name="{node["name"]}"]')
    assert forward["name"] in names(page, "#forward tr.linked")
    assert names(page, "#forward tr.linked") == ops_with_seq_nr(traced, "forward", node["seq_nr"])
    groups = page.locator("#forward-graph g.ggroup.linked")
    assert groups.count() == 1
    module = groups.first.get_attribute("data-module")
    assert module is not None and "blocks.5.mlp".startswith(module)
    count = "document.querySelectorAll('#forward-graph g.gnode, #forward-graph g.ggroup').length"
    collapsed = page.evaluate(f"() => {count}")
    groups.first.click()  # expands one level
    page.wait_for_function(f"() => {count} > {collapsed}")
    page.click(f'button.gcollapse[data-phase="forward"][data-module="{module}"]')
    page.wait_for_function(f"() => {count} === {collapsed}")
    page.fill("#search", "blocks.11.mlp")
    hits = visible_rows(page, "forward")
    assert hits and all("blocks.11.mlp" in h for h in hits)
    opened.check_clean()


def test_peak_panel_is_text_and_its_op_link_selects_the_row(browser, tmp_path):
    traced = aotgrad.trace(Hostile(), torch.randn(1, 1, 5, 5))
    peak = traced.partitioned.peak
    opened = open_report(browser, report_of(traced, tmp_path, "peak"))
    page = opened.page
    page.wait_for_timeout(200)  # an injected onerror would have fired by now
    assert page.eval_on_selector_all("img, script[src], iframe", "els => els.length") == 0
    panel = page.text_content("#peak")
    assert f"{peak.nbytes} B" in panel and XSS in panel and "alert(2)" in panel
    live = page.eval_on_selector_all(
        "#peak-live tr[data-name]", "rows => rows.map(r => Number(r.dataset.nbytes))"
    )
    assert live == [v.nbytes for v in peak.live]  # every live storage, largest first
    page.click(f'#peak p button.nodelink[data-name="{peak.node}"]')
    assert names(page, f"#{peak.graph} tr.selected") == {peak.node}
    assert names(page, f"#{peak.graph}-graph g.gnode.selected") == {peak.node}
    opened.check_clean()


# ---- The opening view (Note in report.js: Zoom and the opening view) ----

# A loss function over a global model, as users write it: the report groups by the paths the
# signature gives (gpt4.blocks.3.qkv), not by class names.
gpt4 = GPT(blocks=4)
small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def gpt4_loss(idx, targets):
    return gpt4(idx, targets)


def small_loss(x):
    return small(x).square().mean()


BOXES_IN_VIEW = """phase => {
  const view = document.getElementById(phase + "-graph").parentNode.getBoundingClientRect();
  const top = Math.max(view.top, 0), bottom = Math.min(view.bottom, window.innerHeight);
  const drawn = document.querySelectorAll(`#${phase}-graph g.gnode, #${phase}-graph g.ggroup`);
  const inside = [...drawn].filter(g => {
    const r = g.getBoundingClientRect();
    return r.right > view.left && r.left < view.right && r.bottom > top && r.top < bottom;
  });
  return [inside.length, drawn.length];
}"""


def boxes_in_view(page, phase: str) -> tuple[int, int]:
    """How many drawn boxes of ``phase`` the window shows now, of how many drawn."""
    inside, drawn = page.evaluate(BOXES_IN_VIEW, phase)
    return inside, drawn


def open_sized(browser, path: pathlib.Path, width: int, height: int) -> Opened:
    opened = open_report(browser, path)
    opened.page.set_viewport_size({"width": width, "height": height})
    opened.page.reload(wait_until="load")
    opened.page.wait_for_selector("#forward tr[data-name]")
    return opened


@pytest.fixture(scope="module")
def opening_reports(tmp_path_factory) -> dict[str, pathlib.Path]:
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    folder = tmp_path_factory.mktemp("opening")
    traced = {
        "small": aotgrad.trace(small_loss, torch.randn(3, 4)),
        "gpt4-global": aotgrad.trace(gpt4_loss, idx, targets),
        "gpt4-module": aotgrad.trace(gpt4, idx, targets),
    }
    return {name: report_of(t, folder, name) for name, t in traced.items()}


@pytest.mark.parametrize("size", [(1280, 720), (900, 700)])
@pytest.mark.parametrize("model", ["small", "gpt4-global", "gpt4-module"])
def test_both_drawings_open_on_their_content(browser, opening_reports, model, size):
    opened = open_sized(browser, opening_reports[model], *size)
    for phase in ("forward", "backward"):
        inside, drawn = boxes_in_view(opened.page, phase)
        if model == "small":  # fitted whole
            assert inside == drawn > 0, (phase, inside, drawn)
        else:  # at least a few boxes, never an empty stretch of the layout
            assert inside >= 3, (phase, inside, drawn)
    opened.check_clean()


def test_gpt4_through_a_global_is_grouped_by_module_path(browser, opening_reports):
    opened = open_report(browser, opening_reports["gpt4-global"])
    page = opened.page
    modules = page.eval_on_selector_all(
        "#forward-graph g.ggroup", "groups => groups.map(g => g.dataset.module)"
    )
    blocks = {m.split(".")[2] for m in modules if m.startswith("gpt4.blocks.")}
    assert blocks == {"0", "1", "2", "3"}, modules
    assert not {"Linear", "LayerNorm", "Block", "GELU"} & set(modules)
    opened.check_clean()


def test_zoom_buttons_scale_the_drawing_and_fit_restores_it(browser, opening_reports):
    opened = open_report(browser, opening_reports["gpt4-module"])
    page = opened.page
    width = "() => Number(document.getElementById('backward-graph').getAttribute('width'))"
    fitted = page.evaluate(width)
    page.click('#backward-graph-bar button.gzoom[title="zoom in"]')
    assert page.evaluate(width) == pytest.approx(fitted * 1.25, abs=2)
    page.click('#backward-graph-bar button.gzoom[title="fit the drawing"]')
    assert page.evaluate(width) == fitted
    assert boxes_in_view(page, "backward")[0] >= 3
    opened.check_clean()
