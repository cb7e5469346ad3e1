// The report's behaviour: a sortable, filterable table and two Pareto plots (inline SVG).
// A view can be linked: #sort=dppl&desc=1&family=eviction&model=M&rmin=0&rmax=0.3&text=kivi
window.onerror = (msg) => { document.getElementById("errors").textContent += msg + "\n"; };
const ROWS = JSON.parse(document.getElementById("data").textContent);
const COLS = [
  ["model", "model", "s"], ["name", "recipe", "s"], ["family", "family", "s"], ["setting", "setting", "s"],
  ["ratio", "held ÷ fp16", 3], ["bits", "bits/elem", 2], ["dppl", "ΔPPL %", 2], ["kld", "KLD mean", 4],
  ["kld99", "KLD p99", 3], ["top1", "top-1", 3], ["passkey", "passkey", 2], ["decode", "decode ÷ fp16", 2],
  ["peak", "peak MiB", 0], ["calib", "calib s", 1], ["wall", "wall s", 0]];
let sortKey = "ratio", sortUp = true;

function fmt(v, d) { return v === null || v === undefined ? "–" : d === "s" ? String(v) : Number(v).toFixed(d); }

function shown() {
  const fam = document.getElementById("family").value, mod = document.getElementById("model").value;
  const lo = parseFloat(document.getElementById("rmin").value), hi = parseFloat(document.getElementById("rmax").value);
  const text = document.getElementById("text").value.toLowerCase();
  return ROWS.filter(r => (!fam || r.family === fam) && (!mod || r.model === mod)
    && (isNaN(lo) || (r.ratio !== null && r.ratio >= lo)) && (isNaN(hi) || (r.ratio !== null && r.ratio <= hi))
    && (!text || r.name.toLowerCase().includes(text)));
}

function cmp(a, b) {
  const x = a[sortKey], y = b[sortKey];
  if (x === y) return 0;
  if (x === null || x === undefined) return 1;
  if (y === null || y === undefined) return -1;
  return (x < y ? -1 : 1) * (sortUp ? 1 : -1);
}

function drawTable(rows) {
  const head = document.querySelector("#board thead tr"), body = document.querySelector("#board tbody");
  head.innerHTML = "";
  for (const [key, label] of COLS) {
    const th = document.createElement("th");
    th.textContent = label + (key === sortKey ? (sortUp ? " ▲" : " ▼") : "");
    th.dataset.key = key;
    th.onclick = () => { sortUp = key === sortKey ? !sortUp : true; sortKey = key; update(); };
    head.appendChild(th);
  }
  body.innerHTML = "";
  for (const r of rows.slice().sort(cmp)) {
    const tr = document.createElement("tr");
    for (const [key, , d] of COLS) {
      const td = document.createElement("td");
      td.textContent = fmt(r[key], d);
      tr.appendChild(td);
    }
    const td = document.createElement("td"), det = document.createElement("details");
    const sum = document.createElement("summary"), pre = document.createElement("pre");
    sum.textContent = "recipe"; pre.textContent = r.recipe || "(no recipe text)";
    det.appendChild(sum); det.appendChild(pre); td.appendChild(det); tr.appendChild(td);
    body.appendChild(tr);
  }
  document.getElementById("count").textContent = rows.length + " of " + ROWS.length + " rows";
}

function front(pts) {  // lower is better on both axes
  const order = pts.slice().sort((a, b) => a.x - b.x || a.y - b.y);
  let best = Infinity; const out = [];
  for (const p of order) if (p.y < best) { out.push(p); best = p.y; }
  return out;
}

function drawPlot(id, rows, key, label, tr) {
  const svg = document.getElementById(id), W = 520, H = 340, L = 60, B = 40, NS = "http://www.w3.org/2000/svg";
  svg.innerHTML = "";
  const pts = rows.filter(r => r.ratio !== null && r[key] !== null && r[key] !== undefined)
    .map(r => ({x: r.ratio, y: tr(r[key]), r}));
  const el = (name, attrs, text) => {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  el("text", {x: W / 2, y: H - 6, "text-anchor": "middle", "font-size": 12}, "held bytes ÷ fp16");
  el("text", {x: 12, y: H / 2, transform: `rotate(-90 12 ${H / 2})`, "text-anchor": "middle", "font-size": 12}, label);
  if (!pts.length) return;
  const xs = pts.map(p => p.x), ys = pts.map(p => p.y);
  const x0 = 0, x1 = Math.max(...xs) * 1.05 || 1, y0 = Math.min(0, ...ys), y1 = Math.max(...ys) * 1.05 || 1;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - 10), Y = y => H - B - (y - y0) / (y1 - y0 || 1) * (H - B - 10);
  el("line", {x1: L, y1: H - B, x2: W - 10, y2: H - B, stroke: "#888"});
  el("line", {x1: L, y1: 10, x2: L, y2: H - B, stroke: "#888"});
  for (let i = 0; i <= 4; i++) {
    const xv = x0 + (x1 - x0) * i / 4, yv = y0 + (y1 - y0) * i / 4;
    el("text", {x: X(xv), y: H - B + 14, "text-anchor": "middle", "font-size": 10}, xv.toFixed(2));
    el("text", {x: L - 4, y: Y(yv) + 3, "text-anchor": "end", "font-size": 10}, yv.toFixed(2));
  }
  const f = front(pts);
  el("polyline", {points: f.map(p => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none", stroke: "#c33",
                  "stroke-dasharray": "4 3"});
  for (const p of pts) {
    const c = el("circle", {cx: X(p.x), cy: Y(p.y), r: 4, fill: p.r.family === "eviction" ? "#2a7" : "#37c",
                            class: "pt"});
    const t = document.createElementNS(NS, "title");
    t.textContent = `${p.r.name} (${p.r.model}): ${(p.r.ratio).toFixed(3)} of fp16, ${label} ${fmt(p.r[key], 4)}`;
    c.appendChild(t);
  }
}

function update() {
  const rows = shown();
  drawTable(rows);
  drawPlot("plot-ppl", rows, "dppl", "log10(1 + ΔPPL %)", v => Math.log10(1 + Math.max(v, 0)));
  drawPlot("plot-kld", rows, "kld", "KLD mean (nats)", v => v);
}

for (const [id, key] of [["family", "family"], ["model", "model"]]) {
  const sel = document.getElementById(id);
  for (const v of [...new Set(ROWS.map(r => r[key]))].sort()) {
    const o = document.createElement("option"); o.value = v; o.textContent = v; sel.appendChild(o);
  }
}
for (const id of ["family", "model", "rmin", "rmax", "text"]) document.getElementById(id).oninput = update;
const view = new URLSearchParams(location.hash.slice(1));
if (view.has("sort")) { sortKey = view.get("sort"); sortUp = view.get("desc") !== "1"; }
for (const id of ["family", "model", "rmin", "rmax", "text"]) if (view.has(id)) document.getElementById(id).value = view.get(id);
update();
