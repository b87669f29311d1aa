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


def forward_ops_with_seq_nr(traced: aotgrad.Traced, seq_nr: int) -> set[str]:
    return {
        n.name
        for n in traced.partitioned.forward.graph.nodes
        if n.op == "call_function" and n.meta.get("seq_nr") == seq_nr
    }


def backward_node(traced: aotgrad.Traced, target: str):
    assert traced.partitioned.backward is not None
    return next(
        n for n in traced.partitioned.backward.graph.nodes if str(n.target).startswith(target)
    )


def names(page, selector: str) -> set[str]:
    return set(page.eval_on_selector_all(selector, "els => els.map(e => e.dataset.name)"))


def test_clicking_convolution_backward_highlights_its_convolution(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    node = backward_node(traced, "aten.convolution_backward")
    page.click(f'#backward tr[data-name="{node.name}"]')
    linked = names(page, "#forward tr.linked")
    assert linked == forward_ops_with_seq_nr(traced, node.meta["seq_nr"])
    targets = {str(n.target) for n in traced.partitioned.forward.graph.nodes if n.name in linked}
    assert targets == {"aten.convolution.default"}
    saved = {s["name"] for s in show_document(traced.partitioned)["saved"]}
    reads = {a.name for a in node.all_input_nodes} & saved
    assert reads and names(page, "#saved tr.linked") == reads
    assert page.text_content("#summary").startswith(node.name + ": 1 forward op(s)")
    opened.check_clean()


def test_clicking_a_forward_op_lists_its_backward_ops(browser, conv):
    traced, path = conv
    opened = open_report(browser, path)
    page = opened.page
    forward = next(
        n for n in traced.partitioned.forward.graph.nodes if "convolution" in str(n.target)
    )
    page.click(f'#forward tr[data-name="{forward.name}"]')
    assert traced.partitioned.backward is not None
    expected = {
        n.name
        for n in traced.partitioned.backward.graph.nodes
        if n.op == "call_function" and n.meta.get("seq_nr") == forward.meta["seq_nr"]
    }
    assert names(page, "#backward tr.linked") == expected
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
    node = backward_node(traced, "aten.mm")
    page.click(f'#backward tr[data-name="{node.name}"]')
    assert names(page, "#forward tr.linked") == forward_ops_with_seq_nr(traced, node.meta["seq_nr"])
    page.fill("#search", "blocks.11.mlp")
    hits = visible_rows(page, "forward")
    assert hits and all("blocks.11.mlp" in h for h in hits)
    opened.check_clean()
