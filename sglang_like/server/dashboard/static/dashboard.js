// The cache dashboard: polls /stats (1 Hz) and /cache_tree (every 2 s), draws the charts on
// canvases and the radix tree as an SVG icicle. No libraries; nothing is loaded from elsewhere.
"use strict";

const STATS_EVERY_MS = 1000;
const TREE_EVERY_MS = 2000;
const CHART_SPAN_S = 300;  // the charts show the last five minutes
const ROW_H = 22;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
const state = {
  samples: [],            // /stats history rows, oldest first
  lastT: 0,               // the newest sample's time (the next poll asks only for newer ones)
  maxNodes: 500,
  selected: null,         // the node id whose detail is shown
  matchPath: new Set(),   // node ids of the last prefix match
  lastOk: 0,
};

async function getJSON(url, options) {
  const response = await fetch(url, Object.assign({cache: "no-store"}, options || {}));
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    const message = body && body.error && body.error.message;
    throw new Error(`${response.status}: ${message || response.statusText}`);
  }
  return body;
}

function setStatus(kind, text) {
  const el = $("status");
  el.dataset.state = kind;
  el.textContent = text;
}

// ---- formatting ---------------------------------------------------------------------------
const fmtInt = (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US"));
const fmtPct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + "%");
const fmtNum = (v, d = 1) => (v == null ? "–" : Number(v).toFixed(d));
function fmtSeconds(v) {
  if (v == null) return "–";
  if (v < 1) return (1000 * v).toFixed(v < 0.01 ? 2 : 1) + " ms";
  return v.toFixed(2) + " s";
}
function fmtIdle(v) {
  if (v == null) return "–";
  if (v < 60) return v.toFixed(1) + " s";
  if (v < 3600) return (v / 60).toFixed(1) + " min";
  return (v / 3600).toFixed(1) + " h";
}
function visible(text) {  // an edge's text with its whitespace shown
  return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/\r/g, "");
}

// ---- charts -------------------------------------------------------------------------------
class Chart {
  // series: [{key, label, color, fill}]; options: {stacked, yMax, format}
  constructor(id, series, options) {
    this.figure = $(id);
    this.canvas = this.figure.querySelector("canvas");
    this.legend = this.figure.querySelector(".legend");
    this.series = series;
    this.options = options || {};
  }

  draw(samples) {
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
    if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    // the last five minutes, or less while the server is younger (at least one minute)
    const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
    const first = samples.length ? samples[0].t : now;
    const span = Math.min(CHART_SPAN_S, Math.max(60, Math.ceil((now - first) / 60) * 60));
    const t0 = now - span;
    const shown = samples.filter((s) => s.t >= t0);
    const pad = {l: 46, r: 8, t: 6, b: 16};
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    const stacked = this.options.stacked;
    let yMax = this.options.yMax || 0;
    if (!this.options.yMax) {
      for (const s of shown) {
        let sum = 0;
        for (const ser of this.series) {
          const v = s[ser.key];
          if (v == null) continue;
          sum = stacked ? sum + v : Math.max(sum, v);
        }
        yMax = Math.max(yMax, sum);
      }
      yMax = niceCeil(yMax || 1);
    }
    const x = (t) => pad.l + (pw * (t - t0)) / span;
    const y = (v) => pad.t + ph - (ph * v) / yMax;
    // grid and axis labels
    ctx.strokeStyle = "#e2e5eb"; ctx.fillStyle = "#6b7385"; ctx.lineWidth = 1;
    ctx.font = "10px system-ui, sans-serif"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let i = 0; i <= 3; i++) {
      const v = (yMax * i) / 3, yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
      ctx.fillText(this.format(v), pad.l - 4, yy);
    }
    ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
    ctx.fillText(`-${span / 60} min`, pad.l, h - 3);
    ctx.textAlign = "right"; ctx.fillText("now", w - pad.r, h - 3);
    // series
    const base = shown.map(() => 0);
    for (const ser of this.series) {
      const pts = shown.map((s, i) => {
        const v = s[ser.key];
        if (v == null) return null;
        const top = stacked ? base[i] + v : v;
        const p = {x: x(s.t), y: y(top), y0: y(stacked ? base[i] : 0)};
        if (stacked) base[i] = top;
        return p;
      });
      ctx.strokeStyle = ser.color; ctx.lineWidth = 1.6;
      if (ser.fill || stacked) {
        ctx.fillStyle = ser.color + (stacked ? "cc" : "33");
        forRuns(pts, (run) => {
          ctx.beginPath();
          run.forEach((p, i) => (i ? ctx.lineTo(p.x, p.y) : ctx.moveTo(p.x, p.y)));
          for (let i = run.length - 1; i >= 0; i--) ctx.lineTo(run[i].x, run[i].y0);
          ctx.closePath(); ctx.fill();
        });
      }
      forRuns(pts, (run) => {
        ctx.beginPath();
        run.forEach((p, i) => (i ? ctx.lineTo(p.x, p.y) : ctx.moveTo(p.x, p.y)));
        ctx.stroke();
        if (run.length === 1) {
          ctx.fillStyle = ser.color;
          ctx.beginPath(); ctx.arc(run[0].x, run[0].y, 2, 0, 2 * Math.PI); ctx.fill();
        }
      });
    }
    // legend with the latest values; the same values as data attributes (for scripts, tests)
    const last = {};
    this.legend.textContent = "";
    for (const ser of this.series) {
      let v = null;
      for (let i = shown.length - 1; i >= 0 && v == null; i--) v = shown[i][ser.key];
      last[ser.key] = v;
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = ser.color;
      item.append(swatch, `${ser.label} ${v == null ? "–" : this.format(v)}`);
      this.legend.append(item);
    }
    if (this.options.extra && shown.length) {
      const item = document.createElement("span");
      item.textContent = this.options.extra(shown[shown.length - 1]);
      this.legend.append(item);
    }
    this.figure.dataset.points = String(shown.length);
    this.figure.dataset.last = JSON.stringify(last);
  }

  format(v) {
    return (this.options.format || ((u) => (Math.abs(u) >= 100 ? fmtInt(u) : fmtNum(u))))(v);
  }
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function forRuns(points, fn) {  // call fn on each run of non-null points (nulls are gaps)
  let run = [];
  for (const p of points) {
    if (p == null) { if (run.length) fn(run); run = []; } else run.push(p);
  }
  if (run.length) fn(run);
}

const charts = [
  // free slots are the rest of the pool (in the legend): stacked, they would flatten the rest
  new Chart("chart-pool", [
    {key: "in_use", label: "in use (locked by requests)", color: "#f08a24"},
    {key: "evictable", label: "cached (evictable)", color: "#4c78a8"},
  ], {stacked: true, format: fmtInt, extra: (s) => `free ${fmtInt(s.free)} of ${fmtInt(s.total)}`}),
  new Chart("chart-hit", [
    {key: "hit_rate", label: "this second", color: "#2f9e44"},
    {key: "hit_rate_total", label: "since start", color: "#1d2330"},
  ], {yMax: 1, format: fmtPct}),
  new Chart("chart-reqs", [
    {key: "running", label: "running", color: "#4c78a8", fill: true},
    {key: "queued", label: "queued", color: "#d94848"},
  ], {format: fmtInt}),
  new Chart("chart-tps", [
    {key: "tokens_per_s", label: "tokens/s", color: "#6f42c1", fill: true},
  ], {}),
  new Chart("chart-evict", [
    {key: "evicted_per_s", label: "evicted/s", color: "#d94848", fill: true},
  ], {}),
  new Chart("chart-accept", [
    {key: "accept_length", label: "accept length", color: "#0b7285"},
  ], {}),
];

// ---- /stats -------------------------------------------------------------------------------
async function pollStats() {
  try {
    const stats = await getJSON(`/stats?since=${state.lastT}`);
    for (const s of stats.history) state.samples.push(s);
    if (stats.history.length) state.lastT = stats.history[stats.history.length - 1].t;
    const cutoff = state.lastT - 600;
    while (state.samples.length && state.samples[0].t < cutoff) state.samples.shift();
    showStats(stats);
    state.lastOk = Date.now();
    setStatus(stats.error ? "error" : "live",
              stats.error ? `engine: ${stats.error}` : `live · ${stats.model}`);
  } catch (e) {
    setStatus("error", `no stats: ${e.message}`);
  }
}

function showStats(stats) {
  const now = stats.now || {};
  const pool = stats.kv_pool;
  $("model").textContent = stats.model;
  $("v-running").textContent = fmtInt(now.running);
  $("v-queued").textContent = fmtInt(now.queued);
  $("v-free").textContent = `${fmtInt(pool.free_slots)} / ${fmtInt(pool.total_slots)}`;
  $("v-evictable").textContent = fmtInt(pool.evictable_slots);
  $("v-in-use").textContent = fmtInt(pool.used_slots);
  $("v-kv-format").textContent = pool.dtype ? `${pool.dtype} · ${fmtInt(pool.bytes_per_slot)} B` : "–";
  $("v-hit").textContent = fmtPct(now.hit_rate_total);
  $("v-tps").textContent = fmtNum(now.tokens_per_s);
  $("v-nodes").textContent = fmtInt(stats.counters.num_tree_nodes);
  let accept = null;
  for (let i = state.samples.length - 1; i >= 0 && accept == null; i--) {
    accept = state.samples[i].accept_length;
  }
  $("v-accept").textContent = accept == null ? "–" : fmtNum(accept, 2);
  for (const chart of charts) chart.draw(state.samples);
  const body = $("latency-table").querySelector("tbody");
  body.textContent = "";
  const names = {ttft: "time to first token", tpot: "time per output token",
                 itl: "inter-token (streams)", e2e: "end to end", queue: "queue"};
  for (const [key, label] of Object.entries(names)) {
    const row = document.createElement("tr");
    row.dataset.metric = key;
    const s = stats.latency[key];
    const cells = [label, s ? fmtInt(s.count) : "0"];
    for (const q of ["mean", "p50", "p90", "p99", "max"]) cells.push(s ? fmtSeconds(s[q]) : "–");
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      row.append(td);
    }
    body.append(row);
  }
}

// ---- the radix tree -----------------------------------------------------------------------
function edgeWidth(tokens) {  // grows with the edge's tokens (sqrt: long prompts stay on screen)
  return tokens === 0 ? 14 : Math.min(56 + 14 * Math.sqrt(tokens), 560);
}

async function pollTree() {
  if ($("tree-pause").checked || document.hidden) return;
  try {
    const tree = await getJSON(`/cache_tree?max_nodes=${state.maxNodes}`);
    renderTree(tree);
  } catch (e) {
    $("tree-summary").textContent = `tree unavailable: ${e.message}`;
  }
}

function renderTree(tree) {
  const t0 = performance.now();
  const nodes = tree.nodes;
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const kids = new Map(nodes.map((n) => [n.id, []]));
  for (const n of nodes) if (n.parent != null && kids.has(n.parent)) kids.get(n.parent).push(n);
  // rows: a leaf (or a node that hides children) takes one row; a node spans its children
  const rows = new Map();
  for (let i = nodes.length - 1; i >= 0; i--) {
    const n = nodes[i];
    let r = kids.get(n.id).reduce((acc, c) => acc + rows.get(c.id), 0);
    if (n.hidden_children > 0) r += 1;
    rows.set(n.id, Math.max(r, 1));
  }
  const pos = new Map();
  let maxX = 0;
  const stack = [nodes[0]];
  pos.set(nodes[0].id, {x: 0, y: 0});
  while (stack.length) {
    const n = stack.pop();
    const p = pos.get(n.id);
    const w = edgeWidth(n.tokens);
    let y = p.y;
    for (const c of kids.get(n.id)) {
      pos.set(c.id, {x: p.x + w, y});
      y += rows.get(c.id);
      stack.push(c);
    }
    maxX = Math.max(maxX, p.x + w + (n.hidden_children > 0 ? 110 : 0));
  }
  const svg = $("tree");
  const frag = document.createDocumentFragment();
  for (const n of nodes) {
    const p = pos.get(n.id);
    const w = edgeWidth(n.tokens), h = rows.get(n.id) * ROW_H;
    const g = document.createElementNS(SVG_NS, "g");
    let cls = n.state;
    if (n.evict_rank != null && n.state === "evictable") cls = "next-evict";
    g.setAttribute("class", `node ${cls}` + (n.id === state.selected ? " selected" : "")
                   + (state.matchPath.has(n.id) ? " on-path" : ""));
    g.dataset.id = n.id;
    g.dataset.tokens = n.tokens;
    g.dataset.state = n.state;
    g.dataset.hits = n.hit_count;
    if (n.evict_rank != null) g.dataset.evictRank = n.evict_rank;
    const rect = document.createElementNS(SVG_NS, "rect");
    rect.setAttribute("x", p.x); rect.setAttribute("y", p.y * ROW_H);
    rect.setAttribute("width", Math.max(w - 1, 1)); rect.setAttribute("height", h - 1);
    rect.setAttribute("rx", 2);
    const title = document.createElementNS(SVG_NS, "title");
    title.textContent = n.parent == null ? `root · ${fmtInt(tree.total_tokens)} tokens cached`
      : (n.lora_adapter ? `LoRA ${n.lora_adapter} · ` : "")
        + `${n.tokens} tokens · ${n.state}${n.evict_rank != null ? ` (evicted #${n.evict_rank})` : ""}`
        + ` · hits ${n.hit_count} · idle ${fmtIdle(n.idle_s)}`
        + (n.num_holders ? ` · held by ${n.num_holders}` : "") + `\n${n.text || ""}`;
    g.append(title, rect);
    const chars = Math.floor((w - 8) / 6.6);
    if (n.parent != null && chars >= 3) {
      // the token count, then the edge's text, wrapped over the rows the node spans
      const text = (n.lora_adapter ? `[${n.lora_adapter}] ` : "") + `${n.tokens} `
        + visible(n.text || "") + (n.text_truncated ? "…" : "");
      const lines = Math.min(rows.get(n.id), 6, Math.ceil(text.length / chars));
      for (let i = 0; i < lines; i++) {
        let line = text.slice(i * chars, (i + 1) * chars);
        if (i === lines - 1 && text.length > (i + 1) * chars) line = line.slice(0, -1) + "…";
        const label = document.createElementNS(SVG_NS, "text");
        label.setAttribute("x", p.x + 4);
        label.setAttribute("y", (p.y + i) * ROW_H + ROW_H / 2 + 4);
        label.textContent = line;
        g.append(label);
      }
    }
    frag.append(g);
    if (n.hidden_children > 0) {
      const stub = document.createElementNS(SVG_NS, "g");
      stub.setAttribute("class", "hidden-stub");
      stub.dataset.parent = n.id;
      stub.dataset.hiddenChildren = n.hidden_children;
      stub.dataset.hiddenTokens = n.hidden_tokens;
      const sy = (p.y + rows.get(n.id) - 1) * ROW_H;
      const r2 = document.createElementNS(SVG_NS, "rect");
      r2.setAttribute("x", p.x + w); r2.setAttribute("y", sy);
      r2.setAttribute("width", 108); r2.setAttribute("height", ROW_H - 1);
      const t2 = document.createElementNS(SVG_NS, "text");
      t2.setAttribute("x", p.x + w + 4); t2.setAttribute("y", sy + ROW_H / 2 + 4);
      t2.textContent = `+${n.hidden_children} · ${fmtInt(n.hidden_tokens)} tok`;
      const t3 = document.createElementNS(SVG_NS, "title");
      t3.textContent = `${n.hidden_children} smaller branches with ${n.hidden_tokens} tokens, `
        + "not shown (raise the node limit to see them)";
      stub.append(t3, r2, t2);
      frag.append(stub);
    }
  }
  svg.textContent = "";
  svg.append(frag);
  svg.setAttribute("width", Math.ceil(maxX) + 4);
  svg.setAttribute("height", rows.get(nodes[0].id) * ROW_H);
  const ms = performance.now() - t0;
  svg.dataset.renderMs = ms.toFixed(1);
  svg.dataset.shownNodes = tree.shown_nodes;
  svg.dataset.numNodes = tree.num_nodes;
  $("tree-summary").textContent =
    `${fmtInt(tree.num_nodes)} nodes, ${fmtInt(tree.total_tokens)} tokens `
    + `(${fmtInt(tree.locked_tokens)} locked, ${fmtInt(tree.evictable_tokens)} evictable), `
    + `${fmtInt(tree.evicted_tokens)} evicted so far · ${tree.eviction_policy}`
    + (tree.truncated ? ` · showing the ${fmtInt(tree.shown_nodes)} largest` : "")
    + (tree.taken_at ? ` · snapshot ${fmtIdle(Math.max(Date.now() / 1000 - tree.taken_at, 0))}`
       + ` old, took ${fmtNum(tree.snapshot_ms)} ms` : "")
    + (tree.disabled ? " · radix cache disabled" : "");
  if (state.selected != null && !byId.has(state.selected)) showDetailGone(state.selected);
}

async function selectNode(id) {
  state.selected = id;
  for (const g of $("tree").querySelectorAll(".node.selected")) g.classList.remove("selected");
  const g = $("tree").querySelector(`.node[data-id="${id}"]`);
  if (g) g.classList.add("selected");
  const panel = $("node-detail");
  try {
    const node = await getJSON(`/cache_tree/node/${id}`);
    panel.textContent = "";
    const h = document.createElement("h2");
    h.textContent = node.parent == null ? "root" : `node ${node.id}`;
    const dl = document.createElement("dl");
    const facts = [
      ["state", node.state], ["tokens", fmtInt(node.tokens)],
      ["starts at token", fmtInt(node.start)], ["prefix through it", fmtInt(node.start + node.tokens)],
      ["hits", fmtInt(node.hit_count)], ["lock_ref", fmtInt(node.lock_ref)],
      ["idle", fmtIdle(node.idle_s)], ["children", fmtInt(node.num_children)],
      ["held by", node.holders.length ? node.holders.join(", ") : "no running request"],
    ];
    if (node.lora_adapter) facts.unshift(["LoRA adapter", node.lora_adapter]);
    for (const [k, v] of facts) {
      const dt = document.createElement("dt"); dt.textContent = k;
      const dd = document.createElement("dd"); dd.textContent = v;
      dd.dataset.fact = k;
      dl.append(dt, dd);
    }
    const edge = document.createElement("pre");
    edge.className = "text"; edge.id = "node-text"; edge.textContent = node.text;
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = `the whole prefix (${fmtInt(node.start + node.tokens)} tokens)`;
    const prefix = document.createElement("pre");
    prefix.className = "text"; prefix.textContent = node.prefix_text;
    details.append(summary, prefix);
    const label = document.createElement("div");
    label.className = "hint"; label.textContent = "this edge's text";
    panel.append(h, dl, label, edge, details);
    panel.dataset.nodeId = node.id;
  } catch (e) {
    showDetailGone(id, e.message);
  }
}

function showDetailGone(id, message) {
  const panel = $("node-detail");
  panel.dataset.nodeId = "";
  panel.textContent = "";
  const p = document.createElement("p");
  p.className = "hint";
  p.textContent = message || `node ${id} has left the cache (evicted).`;
  panel.append(p);
}

// ---- prefix match -------------------------------------------------------------------------
async function runMatch() {
  const input = $("match-input").value;
  const mode = document.querySelector('input[name="match-mode"]:checked').value;
  const out = $("match-result");
  let body;
  if (mode === "chat") {
    let messages = null;
    try {
      const parsed = JSON.parse(input);
      if (Array.isArray(parsed)) messages = parsed;
    } catch (e) { messages = null; }
    body = {messages: messages || [{role: "user", content: input}]};
  } else {
    body = {text: input};
  }
  try {
    const m = await getJSON("/cache_match", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
    });
    out.textContent = "";
    out.dataset.matched = m.matched_tokens;
    out.dataset.total = m.num_tokens;
    const head = document.createElement("p");
    const share = m.num_tokens ? m.matched_tokens / m.num_tokens : 0;
    head.textContent = `${fmtInt(m.matched_tokens)} of ${fmtInt(m.num_tokens)} tokens are cached `
      + `(${fmtPct(share)}); a new request would reuse ${fmtInt(m.reusable_tokens)} and compute `
      + `${fmtInt(m.num_tokens - m.reusable_tokens)}.`;
    const where = document.createElement("p");
    if (m.path.length === 0) {
      where.textContent = "No cached prefix: the match ends at the root.";
    } else {
      const last = m.path[m.path.length - 1];
      where.className = "path";
      where.append(m.ends_inside
        ? `The match ends inside node ${last.id}, after ${last.matched} of its ${last.tokens} tokens `
          + "(admitting this prompt would split that node there). Path: "
        : `The match ends at the end of node ${last.id}. Path: `);
      for (const step of m.path) {
        const b = document.createElement("button");
        b.type = "button";
        b.textContent = `${step.id} (${step.matched})`;
        b.addEventListener("click", () => selectNode(step.id));
        where.append(b);
      }
    }
    const text = document.createElement("pre");
    text.className = "text";
    const mark = document.createElement("mark");
    mark.textContent = m.matched_text;
    const rest = document.createElement("span");
    rest.className = "rest";
    rest.textContent = m.rest_text;
    text.append(mark, rest);
    out.append(head, where, text);
    state.matchPath = new Set(m.path.map((s) => s.id));
    for (const g of $("tree").querySelectorAll(".node")) {
      g.classList.toggle("on-path", state.matchPath.has(Number(g.dataset.id)));
    }
  } catch (e) {
    out.textContent = "";
    const p = document.createElement("p");
    p.className = "error";
    p.textContent = e.message;
    out.append(p);
  }
}

// ---- wiring -------------------------------------------------------------------------------
$("tree").addEventListener("click", (ev) => {
  const g = ev.target.closest(".node");
  if (g) selectNode(Number(g.dataset.id));
});
$("max-nodes").addEventListener("change", (ev) => {
  state.maxNodes = Number(ev.target.value);
  pollTree();
});
$("match-run").addEventListener("click", runMatch);
window.addEventListener("resize", () => { for (const c of charts) c.draw(state.samples); });

function every(ms, fn) {
  let busy = false;
  const tick = async () => {
    if (!busy) {
      busy = true;
      try { await fn(); } finally { busy = false; }
    }
  };
  tick();
  setInterval(tick, ms);
}
every(STATS_EVERY_MS, pollStats);
every(TREE_EVERY_MS, pollTree);
