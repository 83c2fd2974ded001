// radixlang dashboard: renders what /dashboard/api/* returns, nothing more.
// Plain script, no libraries: every chart is SVG built with createElementNS.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const KEY_NAME = "radixlang-api-key";
  const HISTORY_MAX = 600;
  const RETRY_MS = 2000;

  // The only client-side state: caches of what the server sent, plus UI choices.
  const state = {
    history: [],
    programsVersion: null,
    programs: [],
    selectedProgram: null,   // program id the user picked; null follows the newest
    lastEvictionTime: null,  // newest eviction time already seen (for ghost bars)
    nodeBoxes: new Map(),    // node id -> {x, y, w} of the last tree drawing
    connGen: 0,              // bumps on every (re)connect so stale loops stop
    streamAbort: null,
    poolCells: [],
  };

  // ---------- small DOM helpers ----------

  const $ = (sel) => document.querySelector(sel);

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    setAttrs(e, attrs);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function svg(tag, attrs, parent, text) {
    const e = document.createElementNS(SVG_NS, tag);
    setAttrs(e, attrs);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }

  function setAttrs(e, attrs) {
    if (!attrs) return;
    for (const [k, v] of Object.entries(attrs)) {
      if (v !== undefined && v !== null) e.setAttribute(k, String(v));
    }
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function fmtValue(v) {
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    return String(Math.round(v * 10000) / 10000);
  }

  function fmtShort(v) {
    // Axis labels: compact, never scientific for the ranges we see.
    if (!isFinite(v)) return "0";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    return v.toFixed(a >= 10 ? 1 : 2);
  }

  function fmtClock(t) {
    return t ? new Date(t * 1000).toLocaleTimeString() : "";
  }

  function truncate(s, n) {
    s = String(s || "");
    return s.length > n ? s.slice(0, n - 1) + "…" : s;
  }

  function oneLine(s) {
    return String(s || "").replace(/\s+/g, " ");
  }

  // ---------- API key and fetch ----------

  function apiKey() {
    try { return sessionStorage.getItem(KEY_NAME) || ""; } catch (e) { return ""; }
  }

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  class AuthError extends Error {}

  async function errorMessage(resp) {
    // The server answers {"error": {"message": ...}}; fall back to the status line.
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return String(body.error.message);
      if (body && body.detail) return String(body.detail);
    } catch (e) { /* not JSON */ }
    return "HTTP " + resp.status;
  }

  // fetch with the key; 401/403 become AuthError (and open the key form).
  async function apiFetch(path, opts) {
    opts = Object.assign({}, opts || {});
    opts.headers = authHeaders(opts.headers);
    const resp = await fetch(path, opts);
    if (resp.status === 401 || resp.status === 403) {
      const msg = await errorMessage(resp);
      showRefused(msg);
      throw new AuthError(msg);
    }
    return resp;
  }

  async function apiJson(path) {
    const resp = await apiFetch(path);
    if (!resp.ok) throw new Error(path + ": " + (await errorMessage(resp)));
    return resp.json();
  }

  function setStatus(text, cls) {
    const s = $("#status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  function showRefused(msg) {
    setStatus("refused: " + msg, "bad");
    $("#key-dialog").hidden = false;
    $("#api-key").focus();
  }

  function setupKeyDialog() {
    $("#key-dialog").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("#api-key").value.trim();
      try { sessionStorage.setItem(KEY_NAME, key); } catch (e) { /* private mode */ }
      connect();
    });
  }

  // ---------- connection: history + programs, then the SSE stream ----------

  async function connect() {
    const gen = ++state.connGen;
    if (state.streamAbort) state.streamAbort.abort();
    setStatus("connecting…", "");
    try {
      const hist = await apiJson("/dashboard/api/history");
      if (gen !== state.connGen) return;
      state.history = (hist.points || []).slice(-HISTORY_MAX);
      await loadPrograms();
      if (gen !== state.connGen) return;
      await streamEvents(gen);
      if (gen !== state.connGen) return;
      scheduleRetry(gen, "stream ended");
    } catch (e) {
      if (gen !== state.connGen) return;
      if (e instanceof AuthError) return;  // wait for the user's key
      if (e.name === "AbortError") return;
      scheduleRetry(gen, e.message || String(e));
    }
  }

  function scheduleRetry(gen, why) {
    setStatus("disconnected (" + why + "), retrying in 2 s", "warn");
    setTimeout(() => { if (gen === state.connGen) connect(); }, RETRY_MS);
  }

  async function loadPrograms() {
    const body = await apiJson("/dashboard/api/programs");
    state.programsVersion = body.version;
    state.programs = body.programs || [];
    renderPrograms();
  }

  async function streamEvents(gen) {
    const ctrl = new AbortController();
    state.streamAbort = ctrl;
    const resp = await apiFetch("/dashboard/api/events", { signal: ctrl.signal });
    if (resp.status === 404 || !resp.body) return pollSnapshots(gen);
    if (!resp.ok) throw new Error(await errorMessage(resp));
    markLive();
    await readSSE(resp, (event, data) => {
      if (gen !== state.connGen) return;
      if (event === "snapshot" || event === "message") onSnapshot(JSON.parse(data));
    });
  }

  // Fallback when the server has no event stream: poll the snapshot once per interval.
  async function pollSnapshots(gen) {
    markLive();
    while (gen === state.connGen) {
      const snap = await apiJson("/dashboard/api/snapshot");
      const hist = await apiJson("/dashboard/api/history");
      state.history = (hist.points || []).slice(-HISTORY_MAX);
      onSnapshot(snap);
      await new Promise((r) => setTimeout(r, 1000 * (snap.interval || 1)));
    }
  }

  function markLive() {
    setStatus("live", "ok");
    $("#key-dialog").hidden = true;
  }

  // Read a text/event-stream body line by line; onLine gets each line without its newline.
  async function readLines(resp, onLine) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).replace(/\r$/, "");
        buf = buf.slice(nl + 1);
        if (onLine(line) === false) { reader.cancel().catch(() => {}); return; }
      }
    }
    if (buf) onLine(buf);
  }

  // SSE framing: "event:" and "data:" lines, an event ends at a blank line.
  function readSSE(resp, onEvent) {
    let event = "message";
    let data = [];
    return readLines(resp, (line) => {
      if (line === "") {
        if (data.length) onEvent(event, data.join("\n"));
        event = "message";
        data = [];
      } else if (line.startsWith("event:")) {
        event = line.slice(6).trim();
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    });
  }

  // ---------- snapshot dispatch ----------

  function onSnapshot(snap) {
    if (snap.point) {
      const last = state.history[state.history.length - 1];
      if (!last || snap.point.time !== last.time) state.history.push(snap.point);
      if (state.history.length > HISTORY_MAX) state.history.splice(0, state.history.length - HISTORY_MAX);
    }
    $("#model").textContent = snap.model || "";
    state.model = snap.model || state.model;
    $("#snapshot-time").textContent = fmtClock(snap.time);
    renderCounters(snap.metrics || {});
    renderTree(snap.tree || {});
    renderPool(snap.pool || {});
    renderRequests(snap.requests || []);
    renderCharts();
    if (snap.programs_version !== undefined && snap.programs_version !== state.programsVersion) {
      state.programsVersion = snap.programs_version;  // avoid refetching twice in a row
      loadPrograms().catch(() => {});
    }
  }

  // ---------- counters ----------

  // "radixlang_requests_finished_by_reason_total{reason="stop"}" -> "requests finished (stop)"
  function counterLabel(name) {
    const m = name.match(/^radixlang_([a-z_]+?)(?:_by_reason_total)?\{reason="([^"]*)"\}$/);
    if (m) return m[1].replace(/_/g, " ") + " (" + m[2] + ")";
    return name.replace(/^radixlang_/, "").replace(/_/g, " ");
  }

  function renderCounters(metrics) {
    const box = $("#counters");
    const seen = new Set();
    for (const [name, value] of Object.entries(metrics)) {
      seen.add(name);
      let v = box.querySelector('[data-metric="' + CSS.escape(name) + '"]');
      if (!v) {
        const item = el("div", { class: "counter" });
        item.appendChild(el("span", { class: "label" }, counterLabel(name)));
        v = el("span", { class: "value", "data-metric": name });
        item.appendChild(v);
        box.appendChild(item);
      }
      v.textContent = fmtValue(value);
    }
    for (const v of box.querySelectorAll("[data-metric]")) {
      if (!seen.has(v.getAttribute("data-metric"))) v.parentNode.remove();
    }
  }

  // ---------- radix tree ----------

  const TREE = { row: 20, bar: 14, minW: 6, left: 8, band: 20, gap: 2 };

  function recencyColor(r) {
    // 0 -> pale blue, 1 -> hot orange
    r = Math.max(0, Math.min(1, Number(r) || 0));
    const hue = 205 + (25 - 205) * r;
    const sat = 55 + (95 - 55) * r;
    const light = 84 + (55 - 84) * r;
    return "hsl(" + hue.toFixed(0) + "," + sat.toFixed(0) + "%," + light.toFixed(0) + "%)";
  }

  // Children lists in node order; hidden entries become pseudo-children so they get a row.
  function buildTree(tree) {
    const nodes = tree.nodes || [];
    const byId = new Map();
    const kids = new Map();
    const roots = [];
    for (const n of nodes) {
      byId.set(n.id, n);
      kids.set(n.id, []);
    }
    for (const n of nodes) {
      if (n.parent === null || n.parent === undefined || !byId.has(n.parent)) roots.push(n);
      else kids.get(n.parent).push(n);
    }
    for (const h of tree.hidden || []) {
      if (kids.has(h.parent)) kids.get(h.parent).push({ hiddenEntry: h });
    }
    return { byId, kids, roots };
  }

  // Rows: a leaf takes a new row, an internal node sits on its first child's row.
  // x is in pixels: each bar right after its parent's bar.
  function layoutTree(t, scale) {
    const placed = [];
    let row = 0;
    const bands = [];
    const visit = (n, x) => {
      if (n.hiddenEntry) {
        placed.push({ n, x, row: row++, w: 0 });
        return;
      }
      const isDefaultRoot = n.parent == null && !n.tokens && !n.salt;
      const w = isDefaultRoot ? 0 : Math.max(TREE.minW, (n.tokens || 0) * scale);
      const children = t.kids.get(n.id) || [];
      const item = { n, x, w, row: -1, hasKids: children.length > 0 };
      placed.push(item);
      if (!children.length) {
        item.row = row++;
        return;
      }
      const childX = x + w + (w ? TREE.gap : 0);
      children.forEach((c, i) => {
        const before = placed.length;
        visit(c, childX);
        if (i === 0) item.row = placed[before].row;
      });
    };
    for (const r of t.roots) {
      const startRow = row;
      const label = r.salt ? "salt " + r.salt : (t.roots.length > 1 ? "default" : "");
      if (label) row++;  // the band's label takes one row
      bands.push({ label, startRow, root: r });
      visit(r, TREE.left);
      bands[bands.length - 1].endRow = row;
    }
    return { placed, bands, rows: row };
  }

  function longestPath(t) {
    let best = 0;
    const walk = (n, acc) => {
      if (n.hiddenEntry) return;
      const here = acc + (n.tokens || 0);
      best = Math.max(best, here);
      for (const c of t.kids.get(n.id) || []) walk(c, here);
    };
    for (const r of t.roots) walk(r, 0);
    return best;
  }

  function nodeTitle(n) {
    return [
      JSON.stringify(n.text || ""),
      "[" + n.start + ":" + n.end + ")  " + n.tokens + " tokens",
      "blocks " + n.blocks + ", tier blocks " + n.tier_blocks,
      "hits " + n.hits + ", lock_ref " + n.lock_ref + ", age " + n.age,
      n.salt ? "salt " + n.salt : "",
    ].filter(Boolean).join("\n");
  }

  function renderTree(tree) {
    const root = $("#tree");
    clear(root);
    $("#tree-caption").textContent =
      (tree.num_nodes || 0) + " nodes (shown " + (tree.shown_nodes || 0) + "), " +
      (tree.cached_tokens || 0) + " tokens";
    $("#eviction-count").textContent = String(tree.evicted_blocks_total || 0);

    const t = buildTree(tree);
    const avail = Math.max(300, root.parentNode.clientWidth - 140);
    const scale = avail / Math.max(1, longestPath(t));
    const lay = layoutTree(t, scale);
    const rowY = (r) => 4 + r * TREE.row;
    let maxX = 0;

    drawBands(root, lay, rowY);
    const boxes = new Map();
    const byNode = new Map(lay.placed.filter((p) => !p.n.hiddenEntry).map((p) => [p.n.id, p]));
    for (const p of lay.placed) {
      const parent = p.n.hiddenEntry ? byNode.get(p.n.hiddenEntry.parent) : byNode.get(p.n.parent);
      if (parent) drawConnector(root, parent, p, rowY);
    }
    for (const p of lay.placed) {
      if (p.n.hiddenEntry) {
        maxX = Math.max(maxX, drawHidden(root, p, rowY));
        continue;
      }
      if (!p.w) continue;  // the default root has no bar
      maxX = Math.max(maxX, drawNode(root, p, rowY));
      boxes.set(p.n.id, { x: p.x, y: rowY(p.row), w: p.w });
    }
    maxX = Math.max(maxX, drawGhosts(root, tree.evictions || []));
    state.nodeBoxes = new Map([...state.nodeBoxes, ...boxes]);
    if (state.nodeBoxes.size > 2000) state.nodeBoxes = boxes;  // bound the memory of old places

    const height = Math.max(40, rowY(lay.rows) + 4);
    root.setAttribute("width", String(Math.max(avail + 140, maxX + 10)));
    root.setAttribute("height", String(height));
    if (!lay.placed.some((p) => p.w || p.n.hiddenEntry)) {
      svg("text", { x: 10, y: 24, class: "muted" }, root, "the tree is empty");
    }
    renderEvictions(tree.evictions || []);
  }

  function drawBands(root, lay, rowY) {
    lay.bands.forEach((b, i) => {
      if (!b.label) return;
      const y = rowY(b.startRow) - 2;
      svg("rect", { x: 0, y, width: "100%", height: (b.endRow - b.startRow) * TREE.row,
        class: "tree-band" + (i % 2 ? " alt" : "") }, root);
      svg("text", { x: 4, y: y + 13, class: "band-label" }, root, b.label);
    });
  }

  function drawConnector(root, parent, child, rowY) {
    const x0 = parent.x + parent.w;
    const y0 = rowY(parent.row) + TREE.bar / 2;
    const y1 = rowY(child.row) + TREE.bar / 2;
    const x1 = child.x;
    const d = y0 === y1 ? "M" + x0 + "," + y0 + "H" + x1
      : "M" + (x0 + 0.5) + "," + y0 + "V" + y1 + "H" + x1;
    svg("path", { d, class: "tree-link" }, root);
  }

  function drawNode(root, p, rowY) {
    const n = p.n;
    const y = rowY(p.row);
    const inTier = n.tier_blocks > 0 && n.blocks === 0;
    const locked = n.lock_ref > 0;
    const g = svg("g", {
      class: "tree-node" + (inTier ? " tier" : "") + (locked ? " locked" : ""),
      "data-node-id": n.id, "data-tokens": n.tokens, "data-hits": n.hits,
      "data-locked": locked ? 1 : 0, "data-salt": n.salt || "",
    }, root);
    svg("title", null, g, nodeTitle(n));
    svg("rect", { x: p.x, y, width: p.w, height: TREE.bar, rx: 2,
      fill: inTier ? "#d9d9d9" : recencyColor(n.recency) }, g);
    const label = String(n.hits);
    if (n.hits > 0 && p.w >= 8 + label.length * 6) {
      svg("text", { x: p.x + 3, y: y + 11, class: "hits" }, g, label);
    }
    let end = p.x + p.w;
    const isLeaf = !p.hasKids;
    if (p.w >= 90) {
      // Enough room: show the start of the edge text inside the bar.
      const room = Math.floor((p.w - 30) / 6.2);
      svg("text", { x: p.x + 24, y: y + 11, class: "snippet" }, g, truncate(oneLine(n.text), room));
    } else if (isLeaf) {
      svg("text", { x: end + 4, y: y + 11, class: "snippet outside" }, g, truncate(oneLine(n.text), 24));
      end += 4 + 6.2 * Math.min(24, oneLine(n.text).length);
    }
    return end;
  }

  function drawHidden(root, p, rowY) {
    const h = p.n.hiddenEntry;
    const y = rowY(p.row);
    const g = svg("g", { class: "tree-hidden", "data-parent": h.parent }, root);
    const label = "+" + h.nodes + " nodes, " + h.tokens + " tokens";
    const w = 12 + label.length * 6.2;
    svg("rect", { x: p.x, y, width: w, height: TREE.bar, rx: 7 }, g);
    svg("text", { x: p.x + 6, y: y + 11 }, g, label);
    return p.x + w;
  }

  // Nodes evicted since the previous snapshot flash as red ghosts where they were drawn.
  function drawGhosts(root, evictions) {
    let maxX = 0;
    const prev = state.lastEvictionTime;
    let newest = prev;
    for (const e of evictions) {
      if (newest === null || e.time > newest) newest = e.time;
      if (prev === null || e.time <= prev) continue;
      const box = state.nodeBoxes.get(e.id);
      if (!box) continue;
      svg("rect", { x: box.x, y: box.y, width: box.w, height: TREE.bar, class: "tree-ghost",
        "data-node-id": e.id }, root);
      maxX = Math.max(maxX, box.x + box.w);
    }
    state.lastEvictionTime = newest === undefined ? null : newest;
    return maxX;
  }

  function renderEvictions(evictions) {
    const ul = $("#evictions");
    clear(ul);
    if (!evictions.length) {
      ul.appendChild(el("li", { class: "muted" }, "no evictions yet"));
      return;
    }
    for (const e of evictions.slice().reverse()) {
      const li = el("li");
      li.appendChild(el("span", { class: "when" }, fmtClock(e.time)));
      li.appendChild(el("span", null,
        " node " + e.id + " [" + e.start + ":" + e.end + ") " + e.tokens + " tokens, " +
        e.blocks + " blocks "));
      li.appendChild(el("span", { class: e.to_tier ? "to-tier" : "dropped" }, e.to_tier ? "→ tier" : "dropped"));
      li.appendChild(el("span", { class: "snippet" }, " " + truncate(oneLine(e.text), 60)));
      ul.appendChild(li);
    }
  }

  // ---------- block pool ----------

  const POOL_COLORS = { free: "#e8ecef", cached: "#7fb7e6", locked: "#e8793a", request: "#8c5fd3" };

  function renderPool(pool) {
    const fig = $("#pool-figures");
    clear(fig);
    const items = [["total", pool.total], ["free", pool.free], ["used", pool.used],
      ["evictable", pool.evictable], ["held", pool.held], ["block size", pool.block_size]];
    if (pool.tier_total) items.push(["tier", (pool.tier_used || 0) + "/" + pool.tier_total]);
    for (const [k, v] of items) {
      const s = el("span", { class: "fig" });
      s.appendChild(el("b", null, v === undefined ? "–" : fmtValue(v)));
      s.appendChild(document.createTextNode(" " + k));
      fig.appendChild(s);
    }
    renderPoolMap(pool.map || { cells: 0, runs: [], owners: [] });
  }

  // Expand the run-length map; one rect per cell, updated in place when the size holds.
  function renderPoolMap(map) {
    const cells = [];
    for (const [st, owner, count] of map.runs || []) {
      for (let i = 0; i < count; i++) cells.push([st, owner]);
    }
    const box = $("#pool-map");
    let root = box.querySelector("svg");
    const n = cells.length;
    const size = n <= 256 ? 12 : n <= 1024 ? 8 : 5;
    const width = Math.max(200, box.clientWidth || 400);
    const perRow = Math.max(1, Math.floor(width / (size + 1)));
    if (!root || state.poolCells.length !== n) {
      if (root) root.remove();
      root = svg("svg", { width, height: Math.ceil(n / perRow) * (size + 1) + 2, class: "pool-svg" });
      box.prepend(root);
      state.poolCells = [];
      for (let i = 0; i < n; i++) {
        state.poolCells.push(svg("rect", { x: (i % perRow) * (size + 1), y: Math.floor(i / perRow) * (size + 1),
          width: size, height: size }, root));
      }
      root.addEventListener("mousemove", onPoolHover);
    }
    const per = map.blocks_per_cell || 1;
    const owners = map.owners || [];
    cells.forEach(([st, owner], i) => {
      const r = state.poolCells[i];
      const title = "cell " + i + (per > 1 ? " (blocks " + i * per + "–" + ((i + 1) * per - 1) + ")" : "") +
        ": " + st + (owners[owner] ? " · " + owners[owner] : "");
      if (r.getAttribute("data-state") !== st) {
        r.setAttribute("data-state", st);
        r.setAttribute("fill", POOL_COLORS[st] || "#999");
      }
      if (r.getAttribute("title") !== title) r.setAttribute("title", title);
    });
    let hover = $("#pool-hover");
    if (!hover) {
      hover = el("div", { id: "pool-hover", class: "pool-hover" });
      box.appendChild(hover);
      box.appendChild(legend(Object.entries(POOL_COLORS)));
    }
    if (!n) hover.textContent = "no pool map";
    else if (!hover.textContent || hover.textContent === "no pool map") hover.textContent = "hover a cell to see its holder";
  }

  function onPoolHover(ev) {
    const t = ev.target.getAttribute && ev.target.getAttribute("title");
    if (t) $("#pool-hover").textContent = t;
  }

  function legend(entries) {
    const d = el("div", { class: "legend" });
    for (const [name, color] of entries) {
      const s = el("span");
      s.appendChild(el("i", { style: "background:" + color }));
      s.appendChild(document.createTextNode(name));
      d.appendChild(s);
    }
    return d;
  }

  // ---------- time-series charts ----------

  const CHART = { w: 560, h: 180, l: 42, r: 42, t: 34, b: 22 };

  function chartFrame(root, title) {
    clear(root);
    root.setAttribute("viewBox", "0 0 " + CHART.w + " " + CHART.h);
    svg("text", { x: CHART.l, y: 14, class: "chart-title" }, root, title);
    return { x0: CHART.l, x1: CHART.w - CHART.r, y0: CHART.h - CHART.b, y1: CHART.t };
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // Axes: y ticks on the left (and optional right), x ticks as seconds before the newest point.
  function drawAxes(root, f, pts, yMax, yFmt, rightMax) {
    for (let i = 0; i <= 4; i++) {
      const y = f.y0 - (f.y0 - f.y1) * i / 4;
      svg("line", { x1: f.x0, x2: f.x1, y1: y, y2: y, class: "grid" }, root);
      svg("text", { x: f.x0 - 4, y: y + 4, class: "tick", "text-anchor": "end" }, root, yFmt(yMax * i / 4));
      if (rightMax) {
        svg("text", { x: f.x1 + 4, y: y + 4, class: "tick" }, root, Math.round(rightMax * i * 25) + "%");
      }
    }
    if (pts.length < 2) return;
    const tEnd = pts[pts.length - 1].time;
    const span = tEnd - pts[0].time;
    for (let i = 0; i <= 4; i++) {
      const x = f.x0 + (f.x1 - f.x0) * i / 4;
      const ago = span * (1 - i / 4);
      svg("text", { x, y: f.y0 + 15, class: "tick", "text-anchor": "middle" }, root,
        i === 4 ? fmtClock(tEnd) : "-" + fmtShort(ago) + "s");
    }
  }

  function xScale(f, n) {
    return (i) => n <= 1 ? f.x1 : f.x0 + (f.x1 - f.x0) * i / (n - 1);
  }

  function noData(root, f) {
    svg("text", { x: (f.x0 + f.x1) / 2, y: (f.y0 + f.y1) / 2, class: "muted", "text-anchor": "middle" },
      root, "no history yet");
  }

  function renderCharts() {
    const pts = state.history;
    drawThroughput($("#throughput-chart"), pts);
    drawHitRate($("#hitrate-chart"), pts);
    drawPoolChart($("#pool-chart"), pts);
  }

  function drawThroughput(root, pts) {
    const last = pts[pts.length - 1];
    const f = chartFrame(root, "tokens / s" + (last ? ": " + fmtShort(last.tokens_per_second || 0) +
      " (running " + (last.running || 0) + ", waiting " + (last.waiting || 0) + ")" : ""));
    const yMax = niceMax(Math.max(0, ...pts.map((p) => p.tokens_per_second || 0)));
    drawAxes(root, f, pts, yMax, fmtShort);
    if (!pts.length) return noData(root, f);
    const x = xScale(f, pts.length);
    const y = (v) => f.y0 - (f.y0 - f.y1) * (v || 0) / yMax;
    const d = pts.map((p, i) => (i ? "L" : "M") + x(i).toFixed(1) + "," + y(p.tokens_per_second).toFixed(1)).join("");
    svg("path", { d: d + "L" + x(pts.length - 1) + "," + f.y0 + "L" + x(0) + "," + f.y0 + "Z", class: "area-tps" }, root);
    svg("path", { d, class: "line-tps" }, root);
  }

  function drawHitRate(root, pts) {
    const last = pts[pts.length - 1];
    const f = chartFrame(root, "prompt tokens reused / computed" + (last ? ": hit rate " +
      Math.round((last.cache_hit_rate || 0) * 100) + "%, " + (last.prompt_tokens_reused || 0) +
      " reused, " + (last.prompt_tokens_computed || 0) + " computed" : ""));
    const yMax = niceMax(Math.max(0, ...pts.map((p) => (p.prompt_tokens_reused || 0) + (p.prompt_tokens_computed || 0))));
    drawAxes(root, f, pts, yMax, fmtShort, 1);
    if (!pts.length) return noData(root, f);
    const x = xScale(f, pts.length);
    const h = (v) => (f.y0 - f.y1) * (v || 0) / yMax;
    const bw = Math.max(1, (f.x1 - f.x0) / Math.max(pts.length, 1) - 1);
    pts.forEach((p, i) => {
      const cx = x(i) - bw / 2;
      const hr = h(p.prompt_tokens_reused);
      const hc = h(p.prompt_tokens_computed);
      if (hr > 0) svg("rect", { x: cx, y: f.y0 - hr, width: bw, height: hr, class: "bar-reused" }, root);
      if (hc > 0) svg("rect", { x: cx, y: f.y0 - hr - hc, width: bw, height: hc, class: "bar-computed" }, root);
    });
    const yr = (v) => f.y0 - (f.y0 - f.y1) * (v || 0);
    const d = pts.map((p, i) => (i ? "L" : "M") + x(i).toFixed(1) + "," + yr(p.cache_hit_rate).toFixed(1)).join("");
    svg("path", { d, class: "line-hit" }, root);
    chartLegend(root, [["reused", "#3d9a6a"], ["computed", "#e0a33a"], ["hit rate", "#1f4e79"]]);
  }

  function drawPoolChart(root, pts) {
    const last = pts[pts.length - 1];
    const f = chartFrame(root, "blocks over time" + (last ? ": " + (last.blocks_used || 0) + " used, " +
      (last.blocks_free || 0) + " free" : ""));
    const series = [["held", "blocks_held", "#e8793a"], ["evictable", "blocks_evictable", "#7fb7e6"],
      ["free", "blocks_free", "#dfe5ea"]];
    const total = (p) => series.reduce((s, [, k]) => s + (p[k] || 0), 0);
    const yMax = Math.max(1, ...pts.map(total));  // the pool size: the stack fills the chart
    drawAxes(root, f, pts, yMax, fmtShort);
    if (!pts.length) return noData(root, f);
    const x = xScale(f, pts.length);
    const y = (v) => f.y0 - (f.y0 - f.y1) * v / yMax;
    let base = pts.map(() => 0);
    for (const [, key, color] of series) {
      const top = pts.map((p, i) => base[i] + (p[key] || 0));
      const up = top.map((v, i) => (i ? "L" : "M") + x(i).toFixed(1) + "," + y(v).toFixed(1)).join("");
      const down = base.map((v, i) => "L" + x(i).toFixed(1) + "," + y(v).toFixed(1)).reverse().join("");
      svg("path", { d: up + down + "Z", fill: color, class: "stack" }, root);
      base = top;
    }
    chartLegend(root, series.map(([n, , c]) => [n, c]));
  }

  function chartLegend(root, entries) {
    // One line under the title, so a long title never overlaps it.
    let x = CHART.l;
    for (const [name, color] of entries) {
      svg("rect", { x, y: 19, width: 9, height: 9, fill: color }, root);
      svg("text", { x: x + 12, y: 27.5, class: "tick" }, root, name);
      x += name.length * 6 + 24;
    }
  }

  // ---------- requests ----------

  function renderRequests(reqs) {
    const tbody = $("#requests tbody");
    const existing = new Map([...tbody.children].map((tr) => [tr.getAttribute("data-rid"), tr]));
    for (const r of reqs) {
      let tr = existing.get(r.rid);
      if (!tr) tr = makeRequestRow(r.rid);
      existing.delete(r.rid);
      fillRequestRow(tr, r);
      tbody.appendChild(tr);  // appending in order also reorders
    }
    for (const tr of existing.values()) tr.remove();
    $("#requests-empty").hidden = reqs.length > 0;
    $("#requests").classList.toggle("is-empty", reqs.length === 0);
  }

  function makeRequestRow(rid) {
    const tr = el("tr", { "data-rid": rid });
    for (const cls of ["rid", "state", "num", "reused", "num out", "num", "output", "act"]) {
      tr.appendChild(el("td", { class: cls }));
    }
    const btn = el("button", { class: "abort", type: "button", title: "abort this request" }, "abort");
    btn.addEventListener("click", () => abortRequest(rid, btn));
    tr.lastChild.appendChild(btn);
    const bar = el("span", { class: "reuse-bar" });
    bar.appendChild(el("i", { class: "r" }));
    bar.appendChild(el("i", { class: "c" }));
    tr.children[3].appendChild(el("span", { class: "reuse-num" }));
    tr.children[3].appendChild(bar);
    return tr;
  }

  function fillRequestRow(tr, r) {
    const c = tr.children;
    c[0].textContent = truncate(r.rid, 10);
    c[0].title = r.rid + (r.salt ? "\nsalt " + r.salt : "") + "\n" + (r.prompt_text || "");
    c[1].textContent = r.state;
    c[1].setAttribute("data-state", r.state);
    c[2].textContent = String(r.prompt_tokens);
    c[3].firstChild.textContent = r.reused_tokens + " / " + r.computed_tokens;
    // Bar: reused (green) then computed so far (orange) out of the prompt; the rest is still to do.
    const pct = (v) => (r.prompt_tokens ? Math.min(100, 100 * (v || 0) / r.prompt_tokens) : 0).toFixed(1) + "%";
    c[3].lastChild.firstChild.style.width = pct(r.reused_tokens);
    c[3].lastChild.lastChild.style.width = pct(r.computed_tokens);
    c[3].title = r.reused_tokens + " reused from the cache, " + r.computed_tokens + " computed";
    c[4].textContent = r.output_tokens + " / " + r.max_new_tokens + (r.retractions ? " ↺" + r.retractions : "");
    c[5].textContent = (Number(r.age) || 0).toFixed(1) + " s";
    c[6].textContent = String(r.output_text || "").slice(-400);
  }

  async function abortRequest(rid, btn) {
    btn.disabled = true;
    try {
      const resp = await apiFetch("/abort_request", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ rid }),
      });
      if (!resp.ok) btn.title = await errorMessage(resp);
    } catch (e) {
      btn.title = String(e.message || e);
    }
  }

  // ---------- programs ----------

  function renderPrograms() {
    const list = $("#program-list");
    const progs = state.programs;
    const wanted = state.selectedProgram !== null && progs.some((p) => p.id === state.selectedProgram)
      ? state.selectedProgram : (progs.length ? progs[progs.length - 1].id : null);
    clear(list);
    for (const p of progs.slice().reverse()) {  // newest first
      const o = el("option", { value: p.id }, p.name + " · " + fmtClock(p.time) + " · " + p.status);
      if (p.id === wanted) o.selected = true;
      list.appendChild(o);
    }
    $("#programs-empty").hidden = progs.length > 0;
    $("#programs").classList.toggle("is-empty", progs.length === 0);
    const prog = progs.find((p) => p.id === wanted);
    drawProgramGraph($("#program-graph"), prog ? prog.graph || {} : { nodes: [], edges: [] });
  }

  function setupPrograms() {
    $("#program-list").addEventListener("change", (ev) => {
      state.selectedProgram = Number(ev.target.value);
      renderPrograms();
    });
  }

  const PG = { col: 200, row: 56, nodeW: 156, top: 30, left: 12 };

  // Rows compacted: a node goes one row below its lowest predecessor and its chain's last node.
  function layoutProgram(graph) {
    const nodes = graph.nodes || [];
    const preds = new Map(nodes.map((n) => [n.id, []]));
    for (const e of graph.edges || []) if (preds.has(e.dst)) preds.get(e.dst).push(e.src);
    const row = new Map();
    const chainLast = new Map();
    for (const n of nodes) {
      let r = 0;
      for (const s of preds.get(n.id)) if (row.has(s)) r = Math.max(r, row.get(s) + 1);
      if (chainLast.has(n.chain)) r = Math.max(r, chainLast.get(n.chain) + 1);
      row.set(n.id, r);
      chainLast.set(n.chain, r);
    }
    const chains = [...new Set(nodes.map((n) => n.chain || 0))].sort((a, b) => a - b);
    const col = new Map(chains.map((c, i) => [c, i]));
    const pos = new Map();
    for (const n of nodes) {
      pos.set(n.id, {
        x: PG.left + col.get(n.chain || 0) * PG.col + PG.nodeW / 2,
        y: PG.top + row.get(n.id) * PG.row + 20,
      });
    }
    return { pos, chains, rows: Math.max(0, ...row.values()) + 1 };
  }

  function drawProgramGraph(root, graph) {
    clear(root);
    const nodes = graph.nodes || [];
    if (!nodes.length) {
      root.setAttribute("width", "300");
      root.setAttribute("height", "40");
      svg("text", { x: 10, y: 24, class: "muted" }, root, "no programs reported yet");
      return;
    }
    const lay = layoutProgram(graph);
    arrowDefs(root);
    lay.chains.forEach((c, i) => {
      svg("text", { x: PG.left + i * PG.col + PG.nodeW / 2, y: 16, class: "chain-label", "text-anchor": "middle" },
        root, c === 0 ? "root" : "branch " + c);
    });
    for (const e of graph.edges || []) {
      const a = lay.pos.get(e.src);
      const b = lay.pos.get(e.dst);
      if (a && b) drawEdge(root, a, b, e.kind);
    }
    for (const n of nodes) drawProgramNode(root, n, lay.pos.get(n.id));
    root.setAttribute("width", String(PG.left * 2 + lay.chains.length * PG.col));
    root.setAttribute("height", String(PG.top + lay.rows * PG.row + 10));
  }

  function arrowDefs(root) {
    const defs = svg("defs", null, root);
    const m = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
    svg("path", { d: "M0,0L10,5L0,10Z", class: "arrowhead" }, m);
  }

  function drawEdge(root, a, b, kind) {
    const y0 = a.y + 16;
    const y1 = b.y - 17;
    const midY = (y0 + y1) / 2;
    const d = a.x === b.x ? "M" + a.x + "," + y0 + "L" + b.x + "," + y1
      : "M" + a.x + "," + y0 + "C" + a.x + "," + midY + " " + b.x + "," + midY + " " + b.x + "," + y1;
    svg("path", { d, class: "edge edge-" + (kind || "prefix"), "marker-end": "url(#arrow)" }, root);
  }

  function drawProgramNode(root, n, p) {
    const kind = n.kind || "text";
    const g = svg("g", { class: "program-node kind-" + kind, "data-node-id": n.id, "data-kind": kind }, root);
    const hw = PG.nodeW / 2;
    const tip = [kind + " #" + n.id, n.label || ""];
    if (n.prompt_tokens !== undefined) tip.push("cached " + (n.cached_tokens || 0) + "/" + n.prompt_tokens);
    if (n.completion_tokens !== undefined) tip.push("completion " + n.completion_tokens);
    if (n.latency_ms !== undefined) tip.push("tools ran " + n.latency_ms + " ms");
    svg("title", null, g, tip.join("\n"));
    if (kind === "gen") {
      svg("rect", { x: p.x - hw, y: p.y - 17, width: PG.nodeW, height: 34, rx: 3, class: "shape" }, g);
    } else if (kind === "select") {
      svg("polygon", { points: [[p.x - hw, p.y], [p.x - hw + 14, p.y - 17], [p.x + hw - 14, p.y - 17],
        [p.x + hw, p.y], [p.x + hw - 14, p.y + 17], [p.x - hw + 14, p.y + 17]].join(" "), class: "shape" }, g);
    } else if (kind === "tool") {  // a tool call: a hexagon-ish tab, with how long it ran
      svg("rect", { x: p.x - hw + 4, y: p.y - 17, width: PG.nodeW - 8, height: 34, rx: 12, class: "shape" }, g);
    } else if (kind === "fork" || kind === "join") {
      const dy = kind === "fork" ? 1 : -1;  // fork points down (spreads), join points up (gathers)
      svg("polygon", { points: [[p.x - 40, p.y - 13 * dy], [p.x + 40, p.y - 13 * dy], [p.x, p.y + 13 * dy]].join(" "),
        class: "shape" }, g);
    } else {
      svg("rect", { x: p.x - hw + 8, y: p.y - 10, width: PG.nodeW - 16, height: 20, rx: 10, class: "shape" }, g);
    }
    const small = kind === "fork" || kind === "join";
    const twoLines = kind === "gen" || kind === "select" || kind === "tool";
    const labelY = twoLines ? p.y - 3 : p.y + 4;
    svg("text", { x: small ? p.x + 44 : p.x, y: labelY, class: "label", "text-anchor": small ? "start" : "middle" }, g,
      truncate(oneLine(small ? kind : n.label || kind), 24));
    if (kind === "gen" || kind === "select") {
      let hits = n.prompt_tokens !== undefined ? "cached " + (n.cached_tokens || 0) + "/" + n.prompt_tokens : "";
      if (n.completion_tokens !== undefined) hits += (hits ? " · " : "") + "+" + n.completion_tokens + " tok";
      svg("text", { x: p.x, y: p.y + 11, class: "hits", "text-anchor": "middle" }, g, hits || kind);
    } else if (kind === "tool") {
      const ran = n.latency_ms !== undefined ? n.latency_ms + " ms" : "tool";
      svg("text", { x: p.x, y: p.y + 11, class: "hits", "text-anchor": "middle" }, g, ran);
    }
  }

  // ---------- playground ----------

  const pg = { ctrl: null, conversation: [] };

  function setupPlayground() {
    $("#pg-mode").addEventListener("change", syncMode);
    $("#pg-send").addEventListener("click", () => { pgSend(); });
    $("#pg-stop").addEventListener("click", () => { if (pg.ctrl) pg.ctrl.abort(); });
    $("#pg-reset").addEventListener("click", () => { pg.conversation = []; renderConversation(); });
    $("#pg-prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) pgSend();
    });
    syncMode();
  }

  function syncMode() {
    $("#playground").classList.toggle("chat", $("#pg-mode").value === "chat");
  }

  function renderConversation() {
    const box = $("#pg-conversation");
    clear(box);
    for (const m of pg.conversation) {
      const d = el("div", { class: "msg " + m.role });
      d.appendChild(el("b", null, m.role + ": "));
      d.appendChild(el("span", null, m.content));
      box.appendChild(d);
    }
  }

  function numInput(sel, dflt, lo, hi) {
    const v = Number($(sel).value);
    if (!isFinite(v) || $(sel).value === "") return dflt;
    return Math.min(hi, Math.max(lo, v));
  }

  async function pgSend() {
    if (pg.ctrl) return;  // one run at a time
    const mode = $("#pg-mode").value;
    const prompt = $("#pg-prompt").value;
    const params = {
      temperature: numInput("#pg-temperature", 0.7, 0, 10),
      top_p: numInput("#pg-top-p", 1, 0, 1),
      max: Math.round(numInput("#pg-max-tokens", 64, 1, 1e6)),
    };
    const n = Math.round(numInput("#pg-n", 1, 1, 8));
    let messages = null;
    if (mode === "chat") {
      pg.conversation.push({ role: "user", content: prompt });
      renderConversation();
      const sys = $("#pg-system").value.trim();
      messages = (sys ? [{ role: "system", content: sys }] : []).concat(pg.conversation);
    }
    const outs = $("#pg-outputs");
    clear(outs);
    const boxes = [];
    for (let i = 0; i < n; i++) {
      const b = el("div", { class: "pg-output", "data-branch": i });
      b.appendChild(el("div", { class: "pg-branch" }, n > 1 ? "branch " + i + " (seed " + i + ")" : "output"));
      b.appendChild(el("div", { class: "pg-text" }));
      outs.appendChild(b);
      boxes.push(b.lastChild);
    }
    pg.ctrl = new AbortController();
    setPgStatus("streaming…", "");
    $("#pg-send").disabled = true;
    const runs = boxes.map((box, i) => {
      const run = mode === "chat" ? streamChat(messages, params, i, box) : streamText(prompt, params, i, box);
      return run.then((text) => {
        if (i === 0 && mode === "chat") {
          pg.conversation.push({ role: "assistant", content: text });
          renderConversation();
        }
        box.parentNode.classList.add("finished");
        return text;
      });
    });
    const results = await Promise.allSettled(runs);
    const failed = results.find((r) => r.status === "rejected");
    if (failed && failed.reason && failed.reason.name === "AbortError") setPgStatus("stopped", "warn");
    else if (failed) setPgStatus("error: " + (failed.reason && failed.reason.message || failed.reason), "bad");
    else setPgStatus("done", "ok");
    pg.ctrl = null;
    $("#pg-send").disabled = false;
  }

  function setPgStatus(text, cls) {
    const s = $("#pg-status");
    s.textContent = text;
    s.className = "pg-status " + cls;
  }

  async function postStream(path, body) {
    const resp = await apiFetch(path, {
      method: "POST", signal: pg.ctrl.signal,
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
    });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    return resp;
  }

  // Parse "data: {json}" lines until "data: [DONE]"; onChunk gets each parsed object.
  async function readDataLines(resp, onChunk) {
    let failure = null;
    await readLines(resp, (line) => {
      if (!line.startsWith("data:")) return true;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return false;
      let obj;
      try { obj = JSON.parse(data); } catch (e) { return true; }
      if (obj && obj.error) {
        failure = new Error(obj.error.message || String(obj.error));
        return false;
      }
      onChunk(obj);
      return true;
    });
    if (failure) throw failure;
  }

  async function streamText(prompt, params, seed, box) {
    const resp = await postStream("/generate", {
      text: prompt,
      sampling_params: { temperature: params.temperature, top_p: params.top_p,
        max_new_tokens: params.max, seed },
      stream: true,
    });
    let text = "";
    await readDataLines(resp, (obj) => {
      // /generate streams the CUMULATIVE text.
      if (typeof obj.text === "string") text = obj.text;
      box.textContent = text;
    });
    return text;
  }

  async function streamChat(messages, params, seed, box) {
    const resp = await postStream("/v1/chat/completions", {
      model: state.model || "default", messages, temperature: params.temperature, top_p: params.top_p,
      max_tokens: params.max, seed, stream: true,
    });
    let text = "";
    await readDataLines(resp, (obj) => {
      // OpenAI chunks are INCREMENTAL deltas.
      const c = obj.choices && obj.choices[0];
      const delta = c && c.delta && c.delta.content;
      if (delta) text += delta;
      box.textContent = text;
    });
    return text;
  }

  // ---------- start ----------

  function start() {
    setupKeyDialog();
    setupPrograms();
    setupPlayground();
    renderCounters({});
    renderTree({});
    renderPool({});
    renderRequests([]);
    renderCharts();
    renderPrograms();
    const key = apiKey();
    if (key) $("#api-key").value = key;
    connect();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
