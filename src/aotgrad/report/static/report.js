// aotgrad HTML report (aotgrad.report.html inlines this file last; tests/html_smoke.js runs it).
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

function searchText(n) {
  return [n.target, n.module, sourceText(n.source), n.name].join(" ").toLowerCase();
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
    tr.dataset.search = searchText(n);
    tr.dataset.phase = phase;  // test hooks, as on the drawn boxes
    tr.dataset.name = n.name;
    tr.addEventListener("click", () => select(phase, n));
    rows.set(phase + ":" + n.name, tr);
    table.appendChild(tr);
  }
}

let marks = [];  // the current selection: [kind, name, class], kind "forward" | "backward" | "saved"

function clearMarks() {
  for (const e of document.querySelectorAll(".selected, .linked")) {
    e.classList.remove("selected", "linked");
  }
}

// Marks the rows and the drawn nodes (or the collapsed groups holding them) of `marks`. A saved
// value is drawn twice: as the forward node that produces it and the backward input reading it.
function paintMarks() {
  clearMarks();
  for (const [kind, name, cls] of marks) {
    const tr = rows.get(kind + ":" + name);
    if (tr) tr.classList.add(cls);
    for (const phase of kind === "saved" ? ["forward", "backward"] : [kind]) {
      const drawn = drawnElement(phase, name);
      if (drawn) drawn.classList.add(cls);
    }
  }
}

// Marks `node` and what it links to. A click in a table scrolls the first linked row into view;
// a click in a drawing (`fromDrawing`) leaves the page where it is.
function select(phase, node, fromDrawing) {
  const other = phase === "forward" ? "backward" : "forward";
  const linked = (doc.graphs[other] || []).filter(n => n.op === "call_function" &&
    node.seq_nr !== null && node.seq_nr !== undefined && n.seq_nr === node.seq_nr);
  const reads = phase === "backward" ? doc.saved.filter(s => s.users.includes(node.name)) : [];
  marks = [[phase, node.name, "selected"],
           ...linked.map(n => [other, n.name, "linked"]),
           ...reads.map(s => ["saved", s.name, "linked"])];
  paintMarks();
  const first = marks.slice(1).map(([kind, name]) => rows.get(kind + ":" + name)).find(Boolean);
  if (first && first.scrollIntoView && !fromDrawing) first.scrollIntoView({ block: "nearest" });
  for (const p of ["forward", "backward"]) scrollGraphTo(p, p === phase ? node.name : null);
  document.getElementById("summary").textContent = node.name + ": " + linked.length + " " +
    other + " op(s) with seq_nr " + (node.seq_nr ?? "-") +
    (phase === "backward" ? ", reads " + reads.length + " saved value(s)" : "");
}

// ---- The predicted peak (document "peak": PeakEstimate.to_dict() + by_kind) ----

function formatBytes(n) {  // report/saved_report.py's format_bytes
  let size = n;
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (size < 1024 || unit === "GiB") {
      return unit === "B" ? Math.trunc(size) + " B" : size.toFixed(1) + " " + unit;
    }
    size /= 1024;
  }
}

function exactBytes(n) {  // "1.5 KiB (1536 B)", or "12 B" where nothing is rounded
  const text = formatBytes(n);
  return text === n + " B" ? text : text + " (" + n + " B)";
}

// A button selecting node `name` of `graph` ("gradients": a value of the backward graph), or
// the bare name when no table has it.
function nodeLink(graph, name) {
  const phase = graph === "gradients" ? "backward" : graph;
  const node = (doc.graphs[phase] || []).find(n => n.name === name);
  if (!node) return el("span", name);
  const button = el("button", name, "nodelink");
  button.dataset.phase = phase;
  button.dataset.name = name;
  button.title = "select " + name + " in the " + phase + " graph";
  button.addEventListener("click", () => select(phase, node));
  return button;
}

function peakWhere(p) {
  const where = el("p");
  if (!p.node) {
    where.textContent = "at: the step's start (only its inputs are live)";
    return where;
  }
  where.appendChild(el("span", p.graph === "gradients"
    ? "at: as the gradients become .grad, autograd copies "
    : "at: " + p.graph + " graph, node "));
  where.appendChild(nodeLink(p.graph, p.node));
  where.appendChild(el("span", " (" + p.op + ")" + (p.module ? ", module " + p.module : "")));
  if (p.source) where.appendChild(el("div", p.source, "muted"));
  return where;
}

function peakPanel() {
  const panel = document.getElementById("peak");
  const p = doc.peak;
  const step = doc.graphs.backward ? "a step (forward, then .backward(), every .grad None)"
                                   : "a call (forward only: nothing needs a gradient)";
  panel.appendChild(el("p", "peak of " + step + ": " + exactBytes(p.nbytes) + " = " +
    formatBytes(p.inputs) + " inputs + " + exactBytes(p.allocated) +
    " allocated by the step (what aotgrad.testing.measure_peak measures)", "peaktotal"));
  if (p.sizes.length) {  // dynamic shapes: Note [A peak of symbolic sizes]
    panel.appendChild(el("p", "at the example sizes " + p.sizes.map(
      s => s.symbol + " = " + s.value + (s.source ? " (" + s.source + ")" : "")).join(", ") +
      "; other sizes hold more or less", "muted"));
  }
  panel.appendChild(peakWhere(p));
  panel.appendChild(el("p", "live then: " +
    p.by_kind.map(k => formatBytes(k.nbytes) + " " + k.title).join(", ")));
  const table = el("table");
  table.id = "peak-live";
  header(table, ["name", "graph", "kind", "bytes", "module", "source"]);
  for (const v of p.live) {
    const tr = el("tr");
    tr.appendChild(el("td")).appendChild(nodeLink(v.graph, v.name));
    for (const c of [v.graph, v.kind, formatBytes(v.nbytes), v.module, v.source ?? ""]) {
      tr.appendChild(el("td", c));
    }
    tr.dataset.phase = "peak";
    tr.dataset.name = v.name;
    tr.dataset.nbytes = String(v.nbytes);
    table.appendChild(tr);
  }
  panel.appendChild(table);
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
    tr.dataset.phase = "saved";
    tr.dataset.name = s.name;
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
    tr.dataset.module = path;
    tr.addEventListener("click", () => {
      document.getElementById("search").value = path;
      search();
    });
    table.appendChild(tr);
  }
}

// ---- Graph drawings: SVG, laid out by dagre (vendor/dagre.min.js, global `dagre`) ----
//
// A drawing shows "units": a node, or a collapsed module group standing for every node whose
// module path starts with the group's path. `state.expanded` holds the module paths that are
// open; a node's unit is the shortest prefix of its module path that is not open (or the node
// itself when all are). The bar above a grouped drawing has a button per open module with no
// open submodule, to collapse it again. (dagre's compound layout could draw open modules as
// boxes around their units, but takes ~0.5 s on gpt12 where the flat layout takes ~0.05 s.)
//
// The output node is not drawn: edges from everything it returns (in the forward, every saved
// value) to one box would cross the whole drawing, and make dagre ~8x slower on gpt12. Units
// holding a value the graph returns get a dot instead (class `gout`).

const SVG_NS = "http://www.w3.org/2000/svg";
const GRAPH_LIMIT = 150;  // most units drawn before a drawing is collapsed by module
const MIN_SCALE = 0.5;    // the smallest zoom a drawing opens at (labels still readable)
const ZOOM_STEP = 1.25;
const FANOUT_LIMIT = 8;   // most units one unit has edges to (see unitEdges)
const CHAR_W = 6.7;       // width of one character of the 11px monospace labels
const UNIT_H = 34;
const graphs = {};        // phase -> drawing state (see initGraph)

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function modulePrefixes(n) {
  if (n.module === null || n.module === undefined) return [];
  return String(n.module).split(".").map((_, i, parts) => parts.slice(0, i + 1).join("."));
}

function parentPath(path) {
  const i = path.lastIndexOf(".");
  return i < 0 ? null : path.slice(0, i);
}

function unitKey(state, n) {
  for (const path of modulePrefixes(n)) {
    if (!state.expanded.has(path)) return "group:" + path;
  }
  return "node:" + n.name;
}

// The open paths when every module deeper than `depth` components is collapsed.
function openToDepth(nodes, depth) {
  const open = new Set();
  for (const n of nodes) {
    for (const path of modulePrefixes(n).slice(0, depth)) open.add(path);
  }
  return open;
}

function unitCount(state) {
  return new Set(state.nodes.map(n => unitKey(state, n))).size;
}

// Small graphs are drawn whole. A bigger one is grouped by module at the deepest level whose
// drawing still has at most GRAPH_LIMIT units (the top level if none has).
function initialExpansion(state) {
  const depths = state.nodes.map(n => modulePrefixes(n).length);
  const deepest = Math.max(0, ...depths);
  state.expanded = openToDepth(state.nodes, deepest);
  state.grouped = unitCount(state) > GRAPH_LIMIT;
  if (!state.grouped) return;
  let chosen = 0;
  for (let depth = 1; depth < deepest; depth++) {
    state.expanded = openToDepth(state.nodes, depth);
    if (unitCount(state) > GRAPH_LIMIT) break;
    chosen = depth;
  }
  state.expanded = openToDepth(state.nodes, chosen);
}

function initGraph(phase) {
  const svg = document.getElementById(phase + "-graph");
  const nodes = doc.graphs[phase];
  const bar = document.getElementById(phase + "-graph-bar");
  if (!nodes && bar) bar.appendChild(el("span", "(no " + phase + " graph)", "muted"));
  if (!svg || !nodes || typeof dagre === "undefined") return;
  const drawn = nodes.filter(n => n.op !== "output");
  const returned = nodes.filter(n => n.op === "output").flatMap(n => n.inputs || []);
  const state = { phase, svg, nodes: drawn, byName: new Map(drawn.map(n => [n.name, n])),
                  returned: new Set(returned),
                  expanded: new Set(), grouped: false, units: new Map(), elements: new Map() };
  graphs[phase] = state;
  initialExpansion(state);
  drawGraph(state);
  fitGraph(state);
}

function opLabel(n) {
  if (n.op !== "call_function") return n.name;
  return String(n.target).replace(/^aten\./, "").replace(/\.default$/, "");
}

function clip(text, most) {
  return text.length > most ? text.slice(0, most - 1) + "\u2026" : text;
}

// unit key -> {key, path (groups), node (nodes), members, lines}
function collectUnits(state) {
  const units = new Map();
  for (const n of state.nodes) {
    const key = unitKey(state, n);
    if (!units.has(key)) {
      const path = key.startsWith("group:") ? key.slice(6) : null;
      units.set(key, { key, path, node: path === null ? n : null, members: [] });
    }
    units.get(key).members.push(n);
  }
  return units;
}

// Edges from fx args, one per pair of units (none inside a group): unit key -> Set of unit
// keys. A unit read by more than FANOUT_LIMIT others (a weight every layer reads, say) keeps
// no edges: they would span the whole drawing, and their dummy nodes make dagre take seconds
// (13 s for a 100-step loop reading one weight). Its label says how many units read it.
function unitEdges(state) {
  const edges = new Map();
  for (const n of state.nodes) {
    const to = unitKey(state, n);
    for (const input of n.inputs || []) {
      const source = state.byName.get(input);
      if (!source) continue;
      const from = unitKey(state, source);
      if (from === to) continue;
      if (!edges.has(from)) edges.set(from, new Set());
      edges.get(from).add(to);
    }
  }
  for (const [from, targets] of edges) {
    if (targets.size > FANOUT_LIMIT) {
      state.units.get(from).readers = targets.size;
      edges.delete(from);
    }
  }
  return edges;
}

function unitLines(u) {
  const mark = u.node && u.node.recomputed ? "\u21bb " : "";  // a recomputed backward op
  const lines = u.node ? [mark + opLabel(u.node), shapeText(u.node)]
                       : [u.path, u.members.length + " nodes"];
  if (u.readers) lines[1] += " \u2192 " + u.readers + " readers";
  return lines.map(t => clip(t, 44));
}

function layoutGraph(state, edges) {
  const g = new dagre.graphlib.Graph();
  g.setGraph({ rankdir: "TB", nodesep: 14, ranksep: 26, marginx: 10, marginy: 10 });
  g.setDefaultEdgeLabel(() => ({}));
  for (const u of state.units.values()) {
    const chars = Math.max(...u.lines.map(t => t.length));
    g.setNode(u.key, { width: Math.max(60, chars * CHAR_W + 14), height: UNIT_H });
  }
  for (const [from, targets] of edges) {
    for (const to of targets) g.setEdge(from, to);
  }
  dagre.layout(g);
  return g;
}

function drawGraph(state) {
  state.units = collectUnits(state);
  const edges = unitEdges(state);
  for (const u of state.units.values()) u.lines = unitLines(u);
  const g = layoutGraph(state, edges);
  const svg = state.svg;
  svg.replaceChildren();
  const size = g.graph();
  state.size = { width: Math.ceil(size.width || 0), height: Math.ceil(size.height || 0) };
  svg.setAttribute("viewBox", "0 0 " + state.size.width + " " + state.size.height);
  setScale(state, state.scale ?? 1);
  svg.appendChild(arrowDefs(state.phase));
  state.elements = new Map();
  state.positions = new Map();
  for (const e of g.edges()) svg.appendChild(drawEdge(state.phase, g.edge(e)));
  for (const u of state.units.values()) {
    const box = g.node(u.key);
    const drawn = u.node ? drawNode(state.phase, u, box) : drawGroup(state, u, box);
    state.elements.set(u.key, drawn);
    state.positions.set(u.key, box);
    svg.appendChild(drawn);
  }
  drawOpenBar(state);
}

function arrowDefs(phase) {
  const defs = svgEl("defs");
  const marker = svgEl("marker", { id: phase + "-arrow", viewBox: "0 0 8 8", refX: 8, refY: 4,
                                   markerWidth: 7, markerHeight: 7, orient: "auto" });
  marker.appendChild(svgEl("path", { d: "M0,0 L8,4 L0,8 z", class: "garrow" }));
  defs.appendChild(marker);
  return defs;
}

function drawEdge(phase, edge) {
  const d = edge.points.map((p, i) => (i ? "L" : "M") + p.x.toFixed(1) + "," + p.y.toFixed(1));
  return svgEl("path", { d: d.join(" "), class: "gedge", "marker-end": "url(#" + phase + "-arrow)" });
}

// A box centred on (box.x, box.y) holding one or two lines of text.
function boxed(cls, box, lines, returns) {
  const g = svgEl("g", { class: cls, transform: "translate(" + (box.x - box.width / 2).toFixed(1) +
                                               "," + (box.y - box.height / 2).toFixed(1) + ")" });
  g.appendChild(svgEl("rect", { width: box.width, height: box.height, rx: 4 }));
  lines.forEach((line, i) => {
    g.appendChild(svgEl("text", { x: 7, y: 14 + i * 13, class: i ? "gsub" : "" }, line));
  });
  if (returns) {
    g.classList.add("gout");
    g.appendChild(svgEl("circle", { cx: box.width - 5, cy: box.height - 5, r: 3 }));
  }
  return g;
}

function returnsValue(phase, unit) {
  return unit.members.some(n => graphs[phase].returned.has(n.name));
}

function drawNode(phase, unit, box) {
  const n = unit.node;
  const cls = "gnode" + (n.recomputed ? " recomputed" : "") +
              (n.op !== "call_function" ? " gio" : "") + (unit.readers ? " gfanout" : "");
  const g = boxed(cls, box, unit.lines, returnsValue(phase, unit));
  g.dataset.phase = phase;
  g.dataset.name = n.name;
  const readers = unit.readers ? "read by " + unit.readers + " boxes (edges not drawn)" : "";
  g.appendChild(svgEl("title", {}, [n.name, n.target, n.module ?? "", recomputeText(n), readers]
    .filter(Boolean).join("\n")));
  g.addEventListener("click", () => select(phase, n, true));
  return g;
}

function drawGroup(state, unit, box) {
  const g = boxed("ggroup", box, unit.lines, returnsValue(state.phase, unit));
  g.dataset.phase = state.phase;
  g.dataset.module = unit.path;
  g.appendChild(svgEl("title", {}, unit.path + ": " + unit.members.length + " nodes (click to expand)"));
  g.addEventListener("click", () => setExpanded(state, unit.path, true));
  return g;
}

// ---- Zoom and the opening view ----
//
// A drawing is scaled by its SVG's size against its viewBox (the layout's size). It opens
// fitted on its content: the whole drawing when that takes a zoom of at least MIN_SCALE,
// else at MIN_SCALE (the widest zoom whose labels read), scrolled to the top of the drawing
// (where the graph's inputs are) and, across, to the part of that band holding the most
// boxes -- never an empty stretch of a wide layout (a 4-block GPT's backward is 1000+ units
// wide, with its first boxes at the far right).

function setScale(state, scale) {
  state.scale = scale;
  state.svg.setAttribute("width", Math.ceil(state.size.width * scale));
  state.svg.setAttribute("height", Math.ceil(state.size.height * scale));
}

// The scroll box around a drawing, when the page is laid out (not in tests/html_smoke.js).
function viewOf(state) {
  const view = state.svg.parentNode;
  return view && view.clientWidth > 0 && view.scrollTo ? view : null;
}

function fitGraph(state) {
  const view = viewOf(state);
  if (!view || !state.size.width || !state.size.height) return;
  const fit = Math.min(view.clientWidth / state.size.width,
                       viewHeight(view) / state.size.height);
  setScale(state, Math.min(1, Math.max(MIN_SCALE, fit)));
  view.scrollTo(bestLeft(state, view), 0);
}

// The height the scroll box shows at most (its CSS max-height): it shrinks to small drawings.
function viewHeight(view) {
  const most = parseFloat(getComputedStyle(view).maxHeight);
  return Number.isFinite(most) && most > 0 ? most : view.clientHeight;
}

// The scroll offset across that shows the most boxes of the drawing's top band.
function bestLeft(state, view) {
  const s = state.scale, width = view.clientWidth, height = viewHeight(view);
  const widest = Math.max(0, state.size.width * s - width);
  const boxes = [...state.positions.values()].filter(b => (b.y - b.height / 2) * s < height);
  let best = 0, most = -1;
  for (const b of boxes) {
    const left = Math.min(widest, Math.max(0, b.x * s - width / 2));
    const seen = boxes.filter(o => (o.x + o.width / 2) * s > left &&
                                   (o.x - o.width / 2) * s < left + width).length;
    if (seen > most || (seen === most && left < best)) { best = left; most = seen; }
  }
  return best;
}

// Zooms by `factor` about the centre of the scroll box (factor null: fit again).
function zoom(state, factor) {
  const view = viewOf(state);
  if (factor === null) { fitGraph(state); return; }
  const before = state.scale;
  setScale(state, Math.min(4, Math.max(0.05, before * factor)));
  if (!view) return;
  const ratio = state.scale / before;
  const cx = view.scrollLeft + view.clientWidth / 2, cy = view.scrollTop + view.clientHeight / 2;
  view.scrollTo(cx * ratio - view.clientWidth / 2, cy * ratio - view.clientHeight / 2);
}

function zoomButtons(state) {
  const buttons = [["\u2212", 1 / ZOOM_STEP, "zoom out"], ["+", ZOOM_STEP, "zoom in"],
                   ["fit", null, "fit the drawing"]];
  return buttons.map(([text, factor, title]) => {
    const button = el("button", text, "gzoom");
    button.title = title;
    button.dataset.phase = state.phase;
    button.addEventListener("click", () => zoom(state, factor));
    return button;
  });
}

// Zoom buttons; then one button per innermost open module: clicking it collapses that module
// back into a group.
function drawOpenBar(state) {
  const bar = document.getElementById(state.phase + "-graph-bar");
  if (!bar) return;
  bar.replaceChildren(...zoomButtons(state));
  if (!state.grouped) return;
  const open = [...state.expanded].sort();
  const innermost = open.filter(p => !open.some(q => q.startsWith(p + ".")));
  bar.appendChild(el("span", innermost.length ? "open modules:" : "all collapsed", "muted"));
  for (const path of innermost) {
    const button = el("button", "\u2212 " + path, "gcollapse");
    button.title = "collapse " + path;
    button.dataset.phase = state.phase;
    button.dataset.module = path;
    button.addEventListener("click", () => setExpanded(state, path, false));
    bar.appendChild(button);
  }
}

// Opens a group one level (its submodules become groups, its own ops nodes), or closes an open
// module and everything opened inside it; then lays the drawing out again.
function setExpanded(state, path, open) {
  if (open) {
    state.expanded.add(path);
  } else {
    for (const p of [...state.expanded]) {
      if (p === path || p.startsWith(path + ".")) state.expanded.delete(p);
    }
  }
  drawGraph(state);
  paintMarks();
  searchGraph(state.phase, document.getElementById("search").value.trim().toLowerCase());
  const opened = open && state.nodes.find(n => modulePrefixes(n).includes(path));
  if (opened) scrollGraphTo(state.phase, opened.name);  // the group's first box, in view
}

// The drawn element standing for node `name`: its own box or its collapsed group's.
function drawnElement(phase, name) {
  const state = graphs[phase];
  const n = state && state.byName.get(name);
  return n ? state.elements.get(unitKey(state, n)) : undefined;
}

// Scrolls a drawing's box so `name` (or else the first linked unit) is in view.
function scrollGraphTo(phase, name) {
  const state = graphs[phase];
  if (!state) return;
  const n = name !== null ? state.byName.get(name) : null;
  const key = n ? unitKey(state, n)
                : [...state.elements].find(([, e]) => e.classList.contains("linked"))?.[0];
  const box = key && state.positions.get(key);
  const view = viewOf(state);
  if (!box || !view) return;
  const x = box.x * state.scale, y = box.y * state.scale;
  const visible = x >= view.scrollLeft && x <= view.scrollLeft + view.clientWidth &&
                  y >= view.scrollTop && y <= view.scrollTop + view.clientHeight;
  if (!visible) view.scrollTo(x - view.clientWidth / 2, y - view.clientHeight / 2);
}

// Search: units with a matching member are marked `match`, the others dimmed.
function searchGraph(phase, q) {
  const state = graphs[phase];
  if (!state) return;
  for (const [key, e] of state.elements) {
    const hit = Boolean(q) && state.units.get(key).members.some(n => searchText(n).includes(q));
    e.classList.toggle("match", hit);
    e.classList.toggle("dim", Boolean(q) && !hit);
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
  for (const phase of ["forward", "backward"]) searchGraph(phase, q);
  document.getElementById("summary").textContent = q ? shown + " rows match" : "";
}

nodeTable("forward");
nodeTable("backward");
initGraph("forward");
initGraph("backward");
peakPanel();
savedTable();
signaturePanel();
modulePanel();
document.getElementById("search").addEventListener("input", search);
document.body.dataset.ready = String(performance.now());  // for tests: time to interactive
