// Runs a report page's inline script against a tiny fake DOM (no browser): reads the page from
// stdin, clicks the backward node named argv[2], prints what got highlighted as JSON.
"use strict";
const fs = require("fs");
const page = fs.readFileSync(0, "utf8");
const data = /<script type="application\/json" id="aotgrad-data">([\s\S]*?)<\/script>/.exec(page)[1];
const code = page.slice(page.lastIndexOf("<script>") + 8, page.lastIndexOf("</script>"));
const byId = new Map();

class Element {
  constructor(tag) {
    this.tagName = tag; this.children = []; this.dataset = {}; this.listeners = {};
    this.textContent = ""; this.hidden = false; this.value = "";
    const names = new Set();
    this.classList = {
      add: (...c) => c.forEach(x => names.add(x)), remove: (...c) => c.forEach(x => names.delete(x)),
      toggle: (c, on) => (on ? names.add(c) : names.delete(c)), contains: c => names.has(c),
    };
    this.names = names;
  }
  set className(c) { this.names.clear(); c.split(" ").filter(Boolean).forEach(x => this.names.add(x)); }
  set innerHTML(_) { throw new Error("innerHTML used"); }
  appendChild(c) { this.children.push(c); return c; }
  replaceChildren() { this.children = []; }
  addEventListener(kind, fn) { this.listeners[kind] = fn; }
  all() { return [this, ...this.children.flatMap(c => c.all())]; }
}

const body = new Element("body");
for (const id of ["forward", "backward", "saved", "signature", "modules",
                  "search", "summary"]) byId.set(id, body.appendChild(new Element(id)));
byId.set("aotgrad-data", { textContent: data });
global.document = {
  getElementById: id => byId.get(id),
  createElement: tag => new Element(tag),
  querySelectorAll: sel => body.all().filter(e => sel.split(", ").some(s => e.names.has(s.slice(1)))),
};
eval(code);

const texts = e => e.children.map(c => c.textContent);
const marked = (table, cls) =>
  byId.get(table).children.filter(r => r.names.has(cls)).map(texts);
const target = byId.get("backward").children.find(r => texts(r)[1] === process.argv[2]);
target.listeners.click();
const search = byId.get("search");
const clicked = byId.get("summary").textContent;
search.value = process.argv[3] || "";
search.listeners.input();
console.log(JSON.stringify({
  selected: marked("backward", "selected"), forward: marked("forward", "linked"),
  saved: marked("saved", "linked"), hidden: marked("forward", "hidden").length,
  summary: byId.get("summary").textContent, 
  signature: byId.get("signature").all().filter(e => e.tagName === "li").map(e => e.textContent),
  clicked,
  modules: byId.get("modules").children.slice(1).map(texts),
}));
