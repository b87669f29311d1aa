"""``aotgrad show --html``: one self-contained HTML page over the ``show --json`` document.

The page holds no markup built from user strings: the document (plus each node's shape
and dtype) is embedded as JSON in a ``<script type="application/json">`` tag, with
``</`` escaped so no string can close the tag, and the inline script renders every
string with ``textContent``. Module names, source lines and op names are data, never HTML.
Nothing is fetched: the CSS and JS are inline and the page links to nothing.
"""

from __future__ import annotations

import dataclasses
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
    return _PAGE.format(data_id=DATA_ID, data=embed_json(document), style=_STYLE, script=_SCRIPT)


def report_document(partitioned: Partitioned, profile: Any = None) -> dict[str, Any]:
    """``show_document`` without the joint graph (the page shows forward and backward), each
    node with its ``shape`` and ``dtype``, recomputed backward ops with ``recomputed`` (reason
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
        _mark_recomputed(document["graphs"]["backward"], partitioned)
    document["profile"] = _profile_dict(profile)
    return document


def _add_tensor_meta(entries: list[dict[str, Any]], gm: fx.GraphModule) -> None:
    for entry, node in zip(entries, gm.graph.nodes, strict=True):
        entry.update(_tensor_meta(node))


def _mark_recomputed(entries: list[dict[str, Any]], partitioned: Partitioned) -> None:
    recomputed = {r.name: r for r in partitioned.recomputed}
    for entry in entries:
        op = recomputed.get(entry["name"])
        if op is not None:
            entry["recomputed"] = {"reason": op.reason, "flops": op.flops}


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

    >>> embedded_document(_PAGE.format(data_id=DATA_ID, data='[1]', style="", script=""))
    [1]
    """
    opening = f'<script type="application/json" id="{DATA_ID}">'
    start = page.index(opening) + len(opening)
    return json.loads(page[start : page.index("</script>", start)])


def _tensor_meta(node: fx.Node) -> dict[str, Any]:
    """``shape`` and ``dtype`` of the node's value; a multi-output op gets a list of shapes."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return {"shape": _shape(val), "dtype": _dtype(val)}
    tensors = (
        [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, list | tuple) else []
    )
    if not tensors:
        return {"shape": None, "dtype": None}
    return {"shape": [_shape(t) for t in tensors], "dtype": _dtype(tensors[0])}


def _shape(t: torch.Tensor) -> list[int | str]:
    return [_dim(d) for d in t.shape]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dim(d: Any) -> int | str:
    return d if isinstance(d, int) else str(d)


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
<section><h2>forward</h2><table id="forward"></table></section>
<section><h2>backward</h2><table id="backward"></table></section>
<section><h2>saved for backward</h2><table id="saved"></table></section>
<section><h2>calling convention</h2><div id="signature"></div></section>
<section><h2>modules</h2><table id="modules"></table></section>
</main>
<script type="application/json" id="{data_id}">{data}</script>
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
body { font: 13px system-ui, sans-serif; margin: 0; }
header { position: sticky; top: 0; background: #f4f4f4; padding: 6px 12px;
  border-bottom: 1px solid #ccc; display: flex; gap: 12px; align-items: center; }
h1 { font-size: 16px; margin: 0; } h2 { font-size: 14px; }
main { display: grid; grid-template-columns: 1fr 1fr; gap: 0 16px; padding: 0 12px; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #eee; padding: 2px 6px; text-align: left;
  font-family: ui-monospace, monospace; white-space: nowrap; }
th { cursor: pointer; background: #fafafa; }
tr.node { cursor: pointer; }
tr.recomputed td:first-child { border-left: 3px solid #c0392b; }
tr.selected { background: #ffd966; } tr.linked { background: #c9e7ff; }
tr.hidden { display: none; } tr.total td { font-weight: bold; }
.muted { color: #888; } ul { margin: 0; padding-left: 18px; }
"""

_SCRIPT = r"""
"use strict";
const doc = JSON.parse(document.getElementById("aotgrad-data").textContent);
const rows = new Map();  // "phase:name" -> <tr>

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) tr.appendChild(el("td", c));
  return tr;
}

function header(table, names, onClick) {
  const tr = el("tr");
  names.forEach((n, i) => {
    const th = el("th", n);
    if (onClick) th.addEventListener("click", () => onClick(i));
    tr.appendChild(th);
  });
  table.appendChild(tr);
}

function shapeText(n) {
  if (!n.shape) return "";
  const one = s => "[" + s.join(", ") + "]";
  const shapes = Array.isArray(n.shape[0]) ? n.shape.map(one).join(" ") : one(n.shape);
  return shapes + " " + (n.dtype || "");
}

function opTime(n) {
  const t = doc.profile.ops.find(o => o.seq_nr === n.seq_nr && o.op === n.target);
  return t ? t.forward_us.toFixed(1) : "";
}

function recomputeText(n) {
  return n.recomputed ? n.recomputed.reason + " (" + n.recomputed.flops + " FLOPs)" : "";
}

function sourceText(s) {
  if (!s) return "";
  if (typeof s === "string") return s;
  return String(s.file).split("/").pop() + ":" + s.line + "  " + (s.code ?? "");
}

function nodeTable(phase) {
  const table = document.getElementById(phase);
  const nodes = doc.graphs[phase];
  if (!nodes) { table.appendChild(row(["(no backward graph)"])); return; }
  const columns = ["#", "name", "op", "shape", "module", "source"];
  if (phase === "backward") columns.push("recomputed");
  if (phase === "forward" && doc.profile) columns.push("forward us");
  header(table, columns);
  for (const n of nodes) {
    const source = sourceText(n.source);
    const cells = [n.seq_nr ?? "", n.name, n.target, shapeText(n), n.module ?? "", source];
    if (phase === "backward") cells.push(recomputeText(n));
    if (phase === "forward" && doc.profile) cells.push(opTime(n));
    const tr = row(cells, n.recomputed ? "node recomputed" : "node");
    tr.dataset.search = [n.target, n.module, source, n.name].join(" ").toLowerCase();
    tr.addEventListener("click", () => select(phase, n));
    rows.set(phase + ":" + n.name, tr);
    table.appendChild(tr);
  }
}

function clearMarks() {
  for (const tr of document.querySelectorAll(".selected, .linked")) {
    tr.classList.remove("selected", "linked");
  }
}

function select(phase, node) {
  clearMarks();
  rows.get(phase + ":" + node.name).classList.add("selected");
  const other = phase === "forward" ? "backward" : "forward";
  const linked = (doc.graphs[other] || []).filter(n => n.op === "call_function" &&
    node.seq_nr !== null && node.seq_nr !== undefined && n.seq_nr === node.seq_nr);
  const reads = phase === "backward" ? doc.saved.filter(s => s.users.includes(node.name)) : [];
  const marked = [...linked.map(n => rows.get(other + ":" + n.name)),
                  ...reads.map(s => rows.get("saved:" + s.name))];
  for (const tr of marked) tr.classList.add("linked");
  if (marked.length && marked[0].scrollIntoView) marked[0].scrollIntoView({ block: "nearest" });
  document.getElementById("summary").textContent = node.name + ": " + linked.length + " " +
    other + " op(s) with seq_nr " + (node.seq_nr ?? "-") +
    (phase === "backward" ? ", reads " + reads.length + " saved value(s)" : "");
}

const savedColumns = [
  ["name", s => s.name], ["bytes", s => s.nbytes], ["shape", s => shapeText(s)],
  ["producer", s => s.producer], ["module", s => s.module ?? ""],
  ["source", s => sourceText(s.source)], ["reason", s => s.reason ?? ""],
];
let savedOrder = { column: 1, descending: true };

function savedTable() {
  const table = document.getElementById("saved");
  table.replaceChildren();
  header(table, savedColumns.map(c => c[0]), sortSaved);
  const key = savedColumns[savedOrder.column][1];
  const sorted = [...doc.saved].sort((a, b) => {
    const x = key(a), y = key(b);
    const order = x < y ? -1 : x > y ? 1 : 0;
    return savedOrder.descending ? -order : order;
  });
  for (const s of sorted) {
    const tr = row(savedColumns.map(c => c[1](s)));
    tr.dataset.search = [s.name, s.module, sourceText(s.source), s.producer].join(" ").toLowerCase();
    rows.set("saved:" + s.name, tr);
    table.appendChild(tr);
  }
  table.appendChild(row(["total (unique storages)", doc.saved_bytes], "total"));
}

function sortSaved(column) {
  const same = savedOrder.column === column;
  savedOrder = { column, descending: same ? !savedOrder.descending : true };
  savedTable();
  search();
}

function descText(d) {
  if (d === null || d === undefined) return "None";
  const inner = d.of ? " of " + descText(d.of) : "";
  const name = d.name ?? d.path ?? d.index ?? "";
  return d.kind + (name !== "" ? " " + name : "") + inner;
}

function signaturePanel() {
  const panel = document.getElementById("signature");
  for (const [key, descs] of Object.entries(doc.signature)) {
    if (!Array.isArray(descs)) continue;
    panel.appendChild(el("h3", key.replace("_", " ")));
    const list = el("ol");
    for (const d of descs) list.appendChild(el("li", descText(d)));
    panel.appendChild(list);
  }
  const t = doc.tracer;
  panel.appendChild(el("p", "tracer: " + t.name + (t.fallback_reason ? " (" + t.fallback_reason + ")" : ""), "muted"));
}

function moduleStats() {
  const stats = new Map();  // module path -> {forward, backward, forward_us, backward_us}
  const entry = path => {
    if (!stats.has(path)) stats.set(path, { forward: 0, backward: 0, forward_us: 0, backward_us: 0 });
    return stats.get(path);
  };
  const ancestors = path => String(path).split(".").map((_, i, parts) => parts.slice(0, i + 1).join("."));
  for (const phase of ["forward", "backward"]) {
    for (const n of doc.graphs[phase] || []) {
      if (n.op !== "call_function" || n.module === undefined || n.module === null) continue;
      for (const path of ancestors(n.module)) entry(path)[phase] += 1;
    }
  }
  for (const m of (doc.profile && doc.profile.modules) || []) {
    for (const path of ancestors(m.module)) {
      entry(path).forward_us += m.forward_us;
      entry(path).backward_us += m.backward_us;
    }
  }
  return stats;
}

function modulePanel() {
  const table = document.getElementById("modules");
  const timed = Boolean(doc.profile);
  header(table, ["module", "forward ops", "backward ops",
                 ...(timed ? ["forward us", "backward us"] : [])]);
  const stats = moduleStats();
  for (const path of [...stats.keys()].sort()) {
    const s = stats.get(path);
    const depth = path.split(".").length - 1;
    const cells = ["\u00a0\u00a0".repeat(depth) + path, s.forward, s.backward];
    if (timed) cells.push(s.forward_us.toFixed(1), s.backward_us.toFixed(1));
    const tr = row(cells, "node");
    tr.addEventListener("click", () => {
      document.getElementById("search").value = path;
      search();
    });
    table.appendChild(tr);
  }
}

function search() {
  const q = document.getElementById("search").value.trim().toLowerCase();
  let shown = 0;
  for (const tr of rows.values()) {
    const hit = !q || tr.dataset.search.includes(q);
    tr.classList.toggle("hidden", !hit);
    if (hit) shown++;
  }
  document.getElementById("summary").textContent = q ? shown + " rows match" : "";
}

nodeTable("forward");
nodeTable("backward");
savedTable();
signaturePanel();
modulePanel();
document.getElementById("search").addEventListener("input", search);
"""
