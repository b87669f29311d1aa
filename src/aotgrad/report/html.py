"""``aotgrad show --html``: one self-contained HTML page over the ``show --json`` document.

The page holds no markup built from user strings: the document (plus each node's shape,
dtype and input names) is embedded as JSON in a ``<script type="application/json">`` tag,
with ``<``, ``>`` and ``&`` escaped so no string can close the tag, and the script renders
every string with ``textContent``. Module names, source lines and op names are data, never HTML.

Nothing is fetched: ``static/report.css``, the vendored ``vendor/dagre.min.js`` (graph layout,
pinned by hash in ``vendor/README.md``) and ``static/report.js`` are read with
``importlib.resources`` and inlined, the report's script last (``tests/html_smoke.js`` runs
it); a Content-Security-Policy forbids any fetch, and the page names no URL.

``report.js`` draws the forward and backward graphs as SVG laid out by ``dagre.layout``. A
graph of more than 150 nodes is drawn collapsed by module (the deepest module level that
keeps it under 150 boxes); a group expands on click and collapses from the bar above the
drawing. Groups are module paths as the signature names them (``gpt.blocks.3.attn`` for a
model reached through a global ``gpt``: Note [Module paths as the signature names them]). Each
drawing opens fitted on its content (whole, or at the smallest readable zoom scrolled to its
top band's boxes) and zooms from its bar (``button.gzoom``). Test hooks: rows and drawn boxes carry ``data-phase`` and ``data-name`` (groups
``data-module``), drawn boxes are ``g.gnode`` / ``g.ggroup`` in ``svg#forward-graph`` /
``svg#backward-graph``, and a selection marks items ``selected`` and ``linked``. The peak panel
(``div#peak``: ``report/peak_report.py``'s numbers) names the peak's op and each live value
with a ``button.nodelink`` (``data-phase``, ``data-name``) that selects that node, as a click
on its row does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
from typing import Any

import torch
import torch.fx as fx

from aotgrad.partition import Partitioned
from aotgrad.report.document import show_document

DATA_ID = "aotgrad-data"


def render_html(partitioned: Partitioned, profile: Any = None) -> str:
    """The report page for ``partitioned``; ``profile`` is an ``aotgrad.profile`` result or None.

    >>> import torch, aotgrad
    >>> from aotgrad.report.html import render_html, embedded_document
    >>> t = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
    >>> page = render_html(t.partitioned)
    >>> page.startswith("<!DOCTYPE html>"), "http://" in page, "https://" in page
    (True, False, False)
    >>> [n["target"] for n in embedded_document(page)["graphs"]["forward"]]
    ['x', 'aten.sin.default', 'output']
    """
    document = report_document(partitioned, profile)
    return _PAGE.format(
        data_id=DATA_ID,
        data=embed_json(document),
        style=_asset("static/report.css"),
        library=inline_script(_asset("vendor/dagre.min.js")),
        script=inline_script(_asset("static/report.js")),
    )


def report_document(partitioned: Partitioned, profile: Any = None) -> dict[str, Any]:
    """``show_document`` without the joint graph (the page shows forward and backward), each
    node with its ``shape``, ``dtype`` and ``inputs``, recomputed backward ops with ``recomputed`` (reason
    and FLOPs), and the profile's times.

    >>> import torch, aotgrad
    >>> t = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
    >>> document = report_document(t.partitioned)
    >>> [(n["shape"], n["dtype"]) for n in document["graphs"]["forward"]]
    [([2], 'float32'), ([2], 'float32'), (None, None)]
    >>> sorted(document["graphs"])
    ['backward', 'forward']
    """
    document = show_document(partitioned)
    del document["graphs"]["joint"]
    _add_tensor_meta(document["graphs"]["forward"], partitioned.forward)
    if partitioned.backward is not None:
        _add_tensor_meta(document["graphs"]["backward"], partitioned.backward)
        recomputed = {r.name: r for r in partitioned.recomputed}
        for entry in document["graphs"]["backward"]:
            if (op := recomputed.get(entry["name"])) is not None:
                entry["recomputed"] = {"reason": op.reason, "flops": op.flops}
    document["profile"] = _profile_dict(profile)
    return document


def _add_tensor_meta(entries: list[dict[str, Any]], gm: fx.GraphModule) -> None:
    """Each entry's ``shape``, ``dtype`` and ``inputs`` (the names of the nodes its args read:
    the drawings' edges)."""
    for entry, node in zip(entries, gm.graph.nodes, strict=True):
        entry.update(_tensor_meta(node))
        entry["inputs"] = [i.name for i in node.all_input_nodes]


def embed_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` is left in it, so no
    string can close the tag (``</script>``) or open a comment; ``JSON.parse`` reads the
    ``\\u`` escapes back as the same characters.

    >>> embed_json({"module": "</script><b>&"})
    '{"module": "\\\\u003c/script\\\\u003e\\\\u003cb\\\\u003e\\\\u0026"}'
    >>> json.loads(embed_json({"module": "</script>"}))
    {'module': '</script>'}
    """
    text = json.dumps(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def embedded_document(page: str) -> Any:
    """The JSON document a page made by ``render_html`` carries (for tests and tools).

    >>> embedded_document(_PAGE.format(data_id=DATA_ID, data="[1]", style="", library="", script=""))
    [1]
    """
    opening = f'<script type="application/json" id="{DATA_ID}">'
    start = page.index(opening) + len(opening)
    return json.loads(page[start : page.index("</script>", start)])


def inline_script(code: str) -> str:
    """``code`` as the text of an inline ``<script>``: a ``</`` could end the element, and the
    page names no URL, so ``://`` becomes ``:\\/\\/`` (the same characters in a JS string,
    regex or comment; dagre.min.js has one URL, in a comment).

    >>> inline_script('// see http://example.org')
    '// see http:\\\\/\\\\/example.org'
    """
    if "</" in code or "<!--" in code:
        raise ValueError("an inline script must not contain '</' or '<!--'")
    return code.replace("://", ":\\/\\/")


@functools.cache
def _asset(name: str) -> str:
    """A file shipped in ``aotgrad/report`` (``static/`` or ``vendor/``), as text."""
    return importlib.resources.files("aotgrad.report").joinpath(name).read_text(encoding="utf-8")


def _tensor_meta(node: fx.Node) -> dict[str, Any]:
    """``shape`` and ``dtype`` of the node's value; a multi-output op gets a list of shapes."""
    val = node.meta.get("val")
    tensors = [
        v for v in (val if isinstance(val, list | tuple) else [val]) if isinstance(v, torch.Tensor)
    ]
    if not tensors:
        return {"shape": None, "dtype": None}
    shapes = [
        [d if isinstance(d, int) else str(d) for d in t.shape] for t in tensors
    ]  # SymInt: text
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    return {"shape": shapes[0] if isinstance(val, torch.Tensor) else shapes, "dtype": dtype}


def _profile_dict(profile: Any) -> dict[str, Any] | None:
    """A ``ProfileReport``'s per-op and per-module times as plain data (duck-typed: the
    profiler sits above the reports, Note in tests/test_layering.py)."""
    if profile is None:
        return None
    return {
        "repeats": profile.repeats,
        "ops": [dataclasses.asdict(t) for t in profile.ops.values()],
        "modules": [dataclasses.asdict(t) for t in profile.modules.values()],
    }


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>aotgrad report</title>
<style>{style}</style>
</head>
<body>
<header><h1>aotgrad report</h1>
<input id="search" type="search" placeholder="search op, module, source">
<span id="summary"></span></header>
<main>
<section><h2>forward graph</h2><div class="graphbar" id="forward-graph-bar"></div>
<div class="graphbox"><svg id="forward-graph"></svg></div></section>
<section><h2>backward graph</h2><div class="graphbar" id="backward-graph-bar"></div>
<div class="graphbox"><svg id="backward-graph"></svg></div></section>
<section><h2>forward</h2><table id="forward"></table></section>
<section><h2>backward</h2><table id="backward"></table></section>
<section><h2>peak memory</h2><div id="peak"></div></section>
<section><h2>saved for backward</h2><table id="saved"></table></section>
<section><h2>calling convention</h2><div id="signature"></div></section>
<section><h2>modules</h2><table id="modules"></table></section>
</main>
<script type="application/json" id="{data_id}">{data}</script>
<script>{library}</script>
<script>{script}</script>
</body>
</html>
"""
