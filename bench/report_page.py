"""Time-to-interactive of the HTML report (issue 15) in headless Debian chromium.

The page's script, once its tables and drawings are built and its handlers attached, writes
``performance.now()`` to ``body[data-ready]``: the time since navigation start on the browser's
own clock (file read, parse, the data's JSON.parse, layout). The median of a few opens, each in
a fresh browser context.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_models import make

import aotgrad
from browser import CHROMIUM, CHROMIUM_FLAGS

# The page's script sets body[data-ready] to performance.now() (ms since navigation start) last.
READY = "() => document.body.dataset.ready ? Number(document.body.dataset.ready) : null"


def measure(names: tuple[str, ...] = ("conv", "gpt12"), opens: int = 3) -> dict[str, float]:
    """Seconds to interactive per benchmark model's report (``make`` names), with node counts."""
    from playwright.sync_api import sync_playwright

    found: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        for name in names:
            model, args = make(name)
            traced = aotgrad.trace(model, *args)
            path = Path(tmp) / f"{name}.html"
            traced.to_html(path)
            times = [_open(browser, path) for _ in range(opens)]
            found[name] = statistics.median(times)
            found[f"{name} nodes"] = float(_nodes(traced))
        browser.close()
    return found


def _open(browser, path: Path) -> float:
    context = browser.new_context()
    page = context.new_page()
    page.goto(path.resolve().as_uri(), wait_until="load")
    page.wait_for_function(READY)
    ms = page.evaluate(READY)
    context.close()
    return ms / 1000.0


def _nodes(traced: aotgrad.Traced) -> int:
    backward = traced.partitioned.backward
    count = len(traced.partitioned.forward.graph.nodes)
    return count + (len(backward.graph.nodes) if backward is not None else 0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for key, value in measure().items():
        print(f"{key}: {value:.3f}")
