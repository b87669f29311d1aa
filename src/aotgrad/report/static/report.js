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
