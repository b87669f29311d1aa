// Runs a report page's inline scripts (dagre, then the report's) against a tiny fake DOM (no
// browser): reads the page from stdin, clicks the backward node named argv[2] in its table and
// then in its drawing, searches for argv[3], prints what got highlighted as JSON.
"use strict";
const fs = require("fs");
const page = fs.readFileSync(0, "utf8");
const data = /<script type="application\/json" id="aotgrad-data">([\s\S]*?)<\/script>/.exec(page)[1];
const scripts = [...page.matchAll(/<script>([\s\S]*?)<\/script>/g)].map(m => m[1]);
const code = scripts.pop();  // the report's; before it, the vendored dagre
const byId = new Map();

class Element {
  constructor(tag) {
    this.tagName = tag; this.children = []; this.dataset = {}; this.listeners = {};
    this.textContent = ""; this.hidden = false; this.value = ""; this.attributes = {};
    const names = new Set();
    this.classList = {
      add: (...c) => c.forEach(x => names.add(x)), remove: (...c) => c.forEach(x => names.delete(x)),
      toggle: (c, on) => (on ? names.add(c) : names.delete(c)), contains: c => names.has(c),
    };
    this.names = names;
  }
  set className(c) { this.names.clear(); c.split(" ").filter(Boolean).forEach(x => this.names.add(x)); }
  set innerHTML(_) { throw new Error("innerHTML used"); }
  appendChild(c) { this.children.push(c); c.parentNode = this; return c; }
  setAttribute(k, v) { this.attributes[k] = v; if (k === "class") this.className = v; }
  replaceChildren(...c) { this.children = []; c.forEach(x => this.appendChild(x)); }
  addEventListener(kind, fn) { this.listeners[kind] = fn; }
  all() { return [this, ...this.children.flatMap(c => c.all())]; }
}

const body = new Element("body");
for (const id of ["forward", "backward", "saved", "signature", "modules", "search", "summary", "peak",
                  "forward-graph", "backward-graph", "forward-graph-bar", "backward-graph-bar"]) {
  byId.set(id, body.appendChild(new Element(id)));
}
byId.set("aotgrad-data", { textContent: data });
global.document = {
  body,
  getElementById: id => byId.get(id),
  createElement: tag => new Element(tag),
  createElementNS: (_, tag) => new Element(tag),
  querySelectorAll: sel => body.all().filter(e => sel.split(", ").some(s => e.names.has(s.slice(1)))),
};
// dagre.min.js is UMD: with no `module` or `exports` in scope it sets the global `dagre`.
for (const library of scripts) new Function("module", "exports", library)();
eval(code);

const texts = e => e.children.map(c => c.textContent);
const marked = (table, cls) =>
  byId.get(table).children.filter(r => r.names.has(cls)).map(texts);
const target = byId.get("backward").children.find(r => texts(r)[1] === process.argv[2]);
target.listeners.click();
const search = byId.get("search");
const clicked = byId.get("summary").textContent;
const graph = phase => byId.get(phase + "-graph").all();
const drawn = (phase, cls) => graph(phase).filter(e => e.names.has(cls));
const drawnTarget = drawn("backward", "gnode").find(g => g.dataset.name === process.argv[2]);
if (drawnTarget) drawnTarget.listeners.click();  // absent when inside a collapsed group
const clickedInDrawing = drawnTarget ? byId.get("summary").textContent : null;
const drawnName = g => g.dataset.name ?? "module " + g.dataset.module;
const graphMarks = phase => ["selected", "linked"].map(cls => drawn(phase, cls).map(drawnName));
search.value = process.argv[3] || "";
search.listeners.input();
const seen = {
  selected: marked("backward", "selected"), forward: marked("forward", "linked"),
  saved: marked("saved", "linked"), hidden: marked("forward", "hidden").length,
  summary: byId.get("summary").textContent,
  signature: byId.get("signature").all().filter(e => e.tagName === "li").map(e => e.textContent),
  clicked, clickedInDrawing,
  drawn: ["forward", "backward"].map(p => drawn(p, "gnode").length + drawn(p, "ggroup").length),
  graphMarks: { forward: graphMarks("forward"), backward: graphMarks("backward") },
  graphMatches: drawn("forward", "match").map(g => g.dataset.name),
  groups: drawn("forward", "ggroup").map(g => g.dataset.module),
  fanout: drawn("forward", "gfanout").map(drawnName),
  modules: byId.get("modules").children.slice(1).map(texts),
  peak: byId.get("peak").all().map(e => e.textContent).filter(Boolean),
};
// Last, as it changes the selection: the peak panel's first link (the peak's op).
const peakLink = byId.get("peak").all().find(e => e.names.has("nodelink"));
if (peakLink) {
  peakLink.listeners.click();
  seen.peakLink = [peakLink.dataset.phase, peakLink.dataset.name];
  seen.peakSelected = ["forward", "backward"].flatMap(p => marked(p, "selected"));
}
console.log(JSON.stringify(seen));
