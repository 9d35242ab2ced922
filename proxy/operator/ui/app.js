// ggmux's operator page: models with live status, memory, load/unload, a
// streaming playground, the requests served and the log tail. Plain
// JavaScript, no dependencies.
//
// Data: GET /v1/models once, then GET /models/sse for status changes as they
// happen; GET /ps every PS_INTERVAL_MS for counters (replicas, in flight,
// waiting, TTFT, memory, idle), and at once when a playground answer starts
// and ends (its in-flight count follows the stream, not the next tick);
// GET /requests/stream for the requests table. Keys: when the server answers
// 401 the page asks for the API key (or, for load, unload, logs and
// requests, the admin key) and keeps it in sessionStorage, for this tab
// only; a key the server refused is said so, and the panes that waited for
// a key start by themselves once it is known. Streams are read with fetch()
// rather than EventSource, which cannot send an Authorization header. The
// log tail and the requests table are logs.js and requests.js, loaded first.
"use strict";

const PS_INTERVAL_MS = 1000;
const RETRY_MS = 2000;

const $ = (sel) => document.querySelector(sel);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

// ---- keys ------------------------------------------------------------------
const keys = {
  api: sessionStorage.getItem("ggmux.apiKey") || "",
  admin: sessionStorage.getItem("ggmux.adminKey") || "",
};
let keyPrompt = null; // one dialog at a time: later askers share its answer
const keyWaiters = new Set(); // panes to start again once a key is entered

function askKey(kind, message) {
  if (keyPrompt) return keyPrompt;
  const dlg = $("#key-dialog");
  $("#key-message").textContent = message;
  $("#key-label").textContent = kind === "admin" ? "admin key" : "key";
  $("#key-input").value = "";
  keyPrompt = new Promise((resolve) => {
    const done = (ok) => {
      dlg.close();
      keyPrompt = null;
      if (ok) {
        const v = $("#key-input").value.trim();
        keys[kind] = v;
        sessionStorage.setItem(kind === "admin" ? "ggmux.adminKey" : "ggmux.apiKey", v);
      }
      resolve(ok);
      if (ok) for (const again of [...keyWaiters]) again(); // (the log pane, the requests)
    };
    $("#key-form").onsubmit = (ev) => { ev.preventDefault(); done(true); };
    $("#key-cancel").onclick = () => done(false);
    dlg.oncancel = (ev) => { ev.preventDefault(); done(false); };
  });
  dlg.showModal();
  $("#key-input").focus();
  return keyPrompt;
}

function authHeaders(admin) {
  const k = (admin && keys.admin) || keys.api;
  return k ? { authorization: "Bearer " + k } : {};
}

// fetch with the key; on 401 ask for it (once per call) and try again
async function api(path, { method = "GET", body, admin = false, signal, ask = true } = {}) {
  for (let tries = 0; ; tries++) {
    const headers = authHeaders(admin);
    if (body !== undefined) headers["content-type"] = "application/json";
    const resp = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (resp.status !== 401 || !ask || tries > 2) return resp;
    const kind = admin ? "admin" : "api";
    // the server's own answer names the keys it takes (its keys file's, an
    // --api-key key, the admin key) or that it has no admin key at all
    let msg = await errorText(resp.clone());
    if (keys[kind]) msg = "key refused: " + msg; // one was sent, and the server said no
    if (!(await askKey(kind, msg))) return resp;
  }
}

async function errorText(resp) {
  try {
    const doc = await resp.json();
    return (doc.error && doc.error.message) || resp.statusText;
  } catch {
    return resp.status + " " + resp.statusText;
  }
}

// Server-sent events from a fetch() response: yields {event, data}.
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const c = line.indexOf(":");
        const field = c < 0 ? line : line.slice(0, c);
        let v = c < 0 ? "" : line.slice(c + 1);
        if (v.startsWith(" ")) v = v.slice(1);
        if (field === "event") event = v;
        else if (field === "data") data.push(v);
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ---- formatting ---------------------------------------------------------------
function fmtBytes(n) {
  if (!n) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0) : n) + " " + units[i];
}
// one format for every duration of the page (TTFT, durations): ms below
// 10 s, else seconds with one decimal (issue 37: "87038 ms" beside "17.6 s")
function fmtMs(v) {
  if (v === null || v === undefined) return "";
  return v < 10000 ? Math.round(v) + " ms" : (v / 1000).toFixed(1) + " s";
}
function fmtSeconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
}

// ---- models -----------------------------------------------------------------
const models = new Map(); // id -> {status, ps, row, cells}
let selected = sessionStorage.getItem("ggmux.model") || "";
let showNodes = false;
const STATES = new Set(["unloaded", "loading", "loaded", "sleeping", "stopping", "measuring",
                        "failed", "waiting"]);
const COLUMNS = ["name", "state", "node", "replicas", "inflight", "waiting", "ttft",
                 "memory", "cache", "idle", "actions"];

// "waiting": an unloaded model whose requests wait for capacity (/ps counts
// them every second: the figure ggmux ps shows)
function stateOf(m) {
  const st = m.status || {};
  const value = st.value || (m.ps && m.ps.state) || "unloaded";
  if (value === "unloaded" && m.ps && m.ps.waiting > 0) return "waiting";
  if (st.failed && value === "unloaded") return "failed";
  return value;
}

// loaded, loading and asleep models are pinned above the others
const PINNED = new Set(["loaded", "loading", "sleeping"]);

function makeRow(id) {
  const tr = el("tr");
  tr.dataset.model = id;
  const cells = {};
  for (const name of COLUMNS) {
    const td = el("td", "col-" + name);
    if (["inflight", "waiting", "ttft", "memory", "cache"].includes(name)) td.classList.add("num");
    if (name === "node") { td.classList.add("node-col"); td.hidden = !showNodes; }
    cells[name] = td;
    tr.appendChild(td);
  }
  cells.name.appendChild(el("span", "id", id));
  cells.name.appendChild(el("span", "aliases"));
  cells.name.title = "use in the playground";
  cells.name.onclick = () => selectModel(id);
  cells.state.appendChild(el("span", "state"));
  const bar = el("progress", "load-progress");
  bar.max = 1;
  bar.hidden = true;
  cells.state.appendChild(bar);
  const load = el("button", "load", "load");
  load.type = "button";
  load.onclick = () => command("load", id, load);
  const unload = el("button", "unload", "unload");
  unload.type = "button";
  unload.onclick = () => command("unload", id, unload);
  cells.actions.append(load, unload);
  // why its requests wait, as a line under the row (as ggmux ps prints it),
  // so that a long reason widens no column
  const why = el("tr", "why-row");
  why.dataset.whyOf = id;
  why.appendChild(el("td", "why"));
  why.firstChild.colSpan = COLUMNS.length;
  why.hidden = true;
  return { row: tr, why, cells, load, unload };
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function render(id) {
  const m = models.get(id);
  if (!m) return;
  const c = m.cells;
  const ps = m.ps || {};
  const st = m.status || {};
  const state = stateOf(m);
  const badge = c.state.firstChild;
  let label = state;
  if (state === "loading" && st.progress !== undefined) label += " " + Math.round(st.progress * 100) + "%";
  setText(badge, label);
  badge.className = "state " + state;
  badge.title = st.error || ps.error || "";
  const bar = c.state.lastChild;
  bar.hidden = state !== "loading";
  bar.value = st.progress || 0;
  setText(c.name.lastChild, (m.aliases || []).join(", "));
  // cluster mode: the node that serves it, then the others that hold it
  const others = (m.nodes || []).map((n) => n.node).filter((n) => n && n !== st.node);
  setText(c.node, [st.node, ...others].filter(Boolean).join(", "));
  c.node.title = (m.nodes || []).map((n) => n.node + ": " + n.state).join("\n");
  const reps = ps.replicas || [];
  // speculative decoding's acceptance beside the replicas, when the model drafts
  const dr = ps.drafts;
  setText(c.replicas, (reps.length
    ? reps.map((r) => r.state + (r.where !== "local" ? " @" + r.where : "")).join(", ")
    : "") + (dr ? " · drafts " + (dr.drafted
      ? Math.round(100 * dr.accepted / dr.drafted) + "% of " + dr.drafted : "0") : ""));
  setText(c.inflight, ps.in_flight ? String(ps.in_flight) : "0");
  // why its requests wait: "waiting for capacity held by b, which drains in
  // 4 s", from /ps (each second, as ggmux ps) before the status events' copy
  const q = ps.queue || st.queue;
  setText(c.waiting, ps.waiting ? String(ps.waiting) : "0");
  m.whyText = ps.waiting && q && q.why
    ? (ps.waiting === 1 ? "1 request" : ps.waiting + " requests") + ", the oldest for "
      + fmtSeconds(q.oldest_wait_s) + ": " + q.why : "";
  setText(m.why.firstChild, m.whyText);
  m.why.hidden = !m.whyText || m.row.hidden;
  const draining = reps.some((r) => r.draining);
  if (draining) setText(badge, label + " (draining)");
  setText(c.ttft, fmtMs(ps.ttft_p50_ms));
  const mem = ps.memory || {};
  // a model that holds no memory shows what it would take: the measured estimate
  const held = mem.effective || (running(state) ? mem.min : 0);
  setText(c.memory, held ? fmtBytes(held) : mem.min ? "~" + fmtBytes(mem.min) + " est." : "");
  c.memory.title = mem.min ? (held ? "" : "not loaded: the measured estimate of what a load "
    + "takes; ") + "measured min " + fmtBytes(mem.min) + ", max " + fmtBytes(mem.max) : "";
  // its KV tiers (issue 29): prompt caches kept in RAM by its replicas, and on disk
  const cache = ps.cache || {};
  setText(c.cache, cache.ram || cache.disk
    ? (fmtBytes(cache.ram) || "0") + " / " + (fmtBytes(cache.disk) || "0") : "");
  c.cache.title = cache.ram || cache.disk
    ? "prompt caches: " + (fmtBytes(cache.ram) || "0 B") + " in RAM, " +
      (fmtBytes(cache.disk) || "0 B") + " on disk" : "";
  let idle = "";
  if (ps.idle_s !== null && ps.idle_s !== undefined) {
    idle = fmtSeconds(ps.idle_s);
    if (ps.unload_in_s !== null && ps.unload_in_s !== undefined) idle += " / " + fmtSeconds(ps.unload_in_s);
  }
  setText(c.idle, idle);
  const on = running(state);
  m.load.disabled = on || state === "stopping" || ps.kind === "upstream";
  m.unload.disabled = !on || ps.kind === "upstream";
  m.row.classList.toggle("selected", id === selected);
  if (state !== m.shown) { // the count above changes, and maybe its place
    m.shown = state;
    m.pinned = PINNED.has(state);
    m.row.classList.toggle("pinned", m.pinned);
    placeRows();
  }
  if (id === selected) showTemplate();
}

function running(state) {
  return ["loaded", "loading", "sleeping"].includes(state);
}

// pinned models first, each group in the server's order (rows move only
// when that order changed); the count above says how many run
let placing = false;
function placeRows() {
  if (placing) return;
  placing = true;
  queueMicrotask(() => {
    placing = false;
    const tb = $("#models tbody");
    const all = [...models.values()];
    const pinned = all.filter((m) => m.pinned);
    const order = [...pinned, ...all.filter((m) => !m.pinned)];
    if (order.some((m, i) => tb.children[2 * i] !== m.row)) {
      for (const m of order) tb.append(m.row, m.why);
    }
    for (const m of all) m.row.classList.toggle("pin-last", m === pinned[pinned.length - 1]);
    applyFilter();
  });
}

function ensureModel(id) {
  let m = models.get(id);
  if (!m) {
    m = { id, status: null, ps: null, aliases: [], nodes: null, pinned: false, shown: "",
          template: undefined, ...makeRow(id) };
    models.set(id, m);
    $("#models tbody").append(m.row, m.why);
    const opt = el("option", null, id);
    opt.value = id;
    $("#pg-model").appendChild(opt);
    if (!selected) selectModel(id);
    else if (id === selected) $("#pg-model").value = id;
    applyFilter();
  }
  return m;
}

function dropModel(id) {
  const m = models.get(id);
  if (!m) return;
  m.row.remove();
  m.why.remove();
  for (const o of $("#pg-model").options) if (o.value === id) o.remove();
  models.delete(id);
}

function setNodes(on) {
  if (on === showNodes) return;
  showNodes = on;
  for (const e of document.querySelectorAll(".node-col")) e.hidden = !on;
}

function applyFilter() {
  const words = $("#filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  let shown = 0;
  for (const m of models.values()) {
    const hay = [m.id, ...(m.aliases || [])].join(" ").toLowerCase();
    const state = stateOf(m);
    // a state's name matches that state ("loaded" is not "unloaded"); other
    // words match part of the name or an alias
    const ok = words.every((w) => (STATES.has(w) ? state === w : hay.includes(w)));
    m.row.hidden = !ok;
    m.why.hidden = !ok || !m.whyText;
    if (ok) shown++;
  }
  let loaded = 0;
  let loading = 0;
  for (const m of models.values()) {
    const st = stateOf(m);
    if (st === "loading") loading++;
    else if (PINNED.has(st)) loaded++;
  }
  const count = loaded + " loaded" + (loading ? ", " + loading + " loading" : "")
    + " of " + models.size;
  $("#model-count").textContent = words.length ? shown + " shown · " + count : count;
  $("#models-empty").hidden = shown > 0 || models.size === 0;
}

function selectModel(id) {
  selected = id;
  sessionStorage.setItem("ggmux.model", id);
  $("#pg-model").value = id;
  for (const k of models.keys()) render(k);
  showTemplate();
  showAttach();
  if ($("#logs-model-only").checked) restartLogs();
}

// a model without a chat template (a base model) gets plain completions in
// the playground: a chat would have no template to render it with (a model that
// reads images keeps chat: llama-server's default ChatML template places them)
let autoMode = false; // the mode is completion because of the model, not by choice
function showTemplate() {
  const m = models.get(selected);
  const note = $("#pg-note");
  if (m && m.template === false && !m.vision) {
    if ($("#pg-mode").value !== "completion") {
      $("#pg-mode").value = "completion";
      autoMode = true;
    }
    setText(note, m.id + " has no chat template: the playground uses completion mode");
    note.hidden = false;
  } else {
    if (autoMode) $("#pg-mode").value = "chat";
    autoMode = false;
    note.hidden = true;
  }
}

async function command(op, id, button) {
  button.disabled = true;
  try {
    const resp = await api("/models/" + op, { method: "POST", body: { model: id }, admin: true });
    if (!resp.ok) alert(op + " " + id + ": " + (await errorText(resp)));
  } finally {
    refreshPs();
  }
}

async function unloadIdle() {
  const resp = await api("/models/unload", { method: "POST", body: { model: "*" }, admin: true });
  if (!resp.ok) alert("unload idle: " + (await errorText(resp)));
  refreshPs();
}

function applyList(doc) {
  const seen = new Set();
  for (const d of doc.data || []) {
    seen.add(d.id);
    const m = ensureModel(d.id);
    m.status = d.status || m.status;
    m.aliases = d.aliases || [];
    if (typeof d.has_chat_template === "boolean") m.template = d.has_chat_template;
    m.vision = !!(d.modalities && d.modalities.vision); // its projector reads images
    if (d.nodes) { m.nodes = d.nodes; setNodes(true); } // cluster mode
    render(d.id);
  }
  showTemplate();
  showAttach();
  for (const id of [...models.keys()]) if (!seen.has(id)) dropModel(id);
  applyFilter();
  fillRequestModels();
}

let listTimer = null; // one list fetch for a burst of events
function scheduleList() {
  if (listTimer === null) listTimer = setTimeout(() => { listTimer = null; loadList(); }, 500);
}

async function loadList() {
  for (;;) {
    try {
      const resp = await api("/v1/models");
      if (resp.ok) { applyList(await resp.json()); return; }
    } catch { /* server restarting: try again */ }
    await new Promise((r) => setTimeout(r, RETRY_MS));
  }
}

async function followStatus() {
  const live = $("#live");
  for (;;) {
    try {
      const resp = await api("/models/sse");
      if (resp.ok) {
        live.textContent = "live";
        live.className = "badge on";
        for await (const ev of sseEvents(resp)) {
          if (ev.event !== "model") continue;
          const d = JSON.parse(ev.data);
          const known = models.has(d.id);
          const m = ensureModel(d.id);
          m.status = d.status; // with node and nodes in cluster mode, as the list has them
          if (d.nodes) { m.nodes = d.nodes; setNodes(true); }
          if (typeof d.has_chat_template === "boolean") m.template = d.has_chat_template;
          render(d.id);
          if (!known) scheduleList(); // a reload added it: fetch its aliases too
        }
      }
    } catch { /* connection lost */ }
    live.textContent = "reconnecting";
    live.className = "badge off";
    await new Promise((r) => setTimeout(r, RETRY_MS));
    loadList();
  }
}

let psBusy = false;
let psAgain = false; // asked while busy: once more after
async function refreshPs() {
  if (psBusy) { psAgain = true; return; }
  psBusy = true;
  try {
    const resp = await api("/ps", { ask: false });
    if (!resp.ok) return;
    const doc = await resp.json();
    if (doc.version) $("#version").textContent = "v" + doc.version;
    for (const p of doc.models || []) {
      const m = models.get(p.id);
      if (!m) continue;
      m.ps = p;
      render(p.id);
    }
    renderDevices(doc.devices || []);
  } catch { /* next tick */ } finally {
    psBusy = false;
    if (psAgain) { psAgain = false; refreshPs(); }
  }
}

function renderDevices(devices) {
  const box = $("#devices");
  box.textContent = "";
  for (const d of devices) {
    const div = el("div", "device");
    div.dataset.device = d.name;
    const label = el("div", "label");
    const b = (n) => fmtBytes(n) || "0 B";
    label.append(el("span", null, d.name),
      el("span", "muted", b(d.held) + " ggmux's models, " + b(d.external) + " other, "
        + b(d.free) + " free of " + b(d.total)));
    const bar = el("div", "bar");
    const pct = (n) => (d.total ? (100 * n) / d.total : 0).toFixed(2) + "%";
    const held = el("div", "held");
    held.style.width = pct(d.held);
    held.title = "held by ggmux's models: " + fmtBytes(d.held);
    const ext = el("div", "external");
    ext.style.width = pct(d.external);
    ext.title = "used by other processes: " + fmtBytes(d.external);
    bar.append(held, ext);
    div.append(label, bar);
    box.appendChild(div);
  }
}

// ---- playground -------------------------------------------------------------
let conversation = []; // chat messages of this model's conversation
let abort = null;

function addMessage(who, text, cls) {
  for (const hint of document.querySelectorAll("#pg-transcript .pg-hint")) hint.remove();
  const div = el("div", "msg " + (cls || who));
  div.appendChild(el("span", "who", who));
  const body = el("span", "text", text || "");
  div.appendChild(body);
  $("#pg-transcript").appendChild(div);
  $("#pg-transcript").scrollTop = $("#pg-transcript").scrollHeight;
  return body;
}

// an image for the next chat message, for a model whose projector reads images
let attached = null; // {name, url: a data: URL}

function showAttach() {
  const m = models.get(selected);
  const can = !!(m && m.vision) && $("#pg-mode").value === "chat";
  $("#pg-attach").hidden = !can;
  if (!can) setAttached(null);
}

function setAttached(a) {
  attached = a;
  $("#pg-attached").textContent = a ? "image: " + a.name : "";
  if (!a) $("#pg-image").value = "";
}

function readImage() {
  const f = $("#pg-image").files[0];
  if (!f) return;
  const reader = new FileReader();
  reader.onload = () => setAttached({ name: f.name, url: reader.result });
  reader.readAsDataURL(f);
}

async function send(ev) {
  ev.preventDefault();
  const text = $("#pg-input").value;
  const model = $("#pg-model").value;
  if (!text.trim() || !model || abort) return;
  $("#pg-input").value = "";
  const mode = $("#pg-mode").value;
  const body = { model, stream: true, max_tokens: Number($("#pg-max").value) || 256,
                 temperature: Number($("#pg-temp").value) };
  addMessage("you", text + (mode === "chat" && attached ? " [" + attached.name + "]" : ""),
    "user");
  if (mode === "chat") {
    const content = attached ? [{ type: "text", text },
      { type: "image_url", image_url: { url: attached.url } }] : text;
    setAttached(null);
    conversation.push({ role: "user", content });
    body.messages = conversation.slice();
  } else {
    body.prompt = text;
  }
  const out = addMessage(model, "", "assistant");
  const stats = $("#pg-stats");
  stats.textContent = "waiting for " + model + "...";
  abort = new AbortController();
  $("#pg-send").disabled = true;
  $("#pg-stop").disabled = false;
  const t0 = performance.now();
  let first = 0;
  let last = 0;
  let tokens = 0;
  let usage = null;
  let timings = null;
  let answer = "";
  try {
    const resp = await api(mode === "chat" ? "/v1/chat/completions" : "/v1/completions",
      { method: "POST", body, signal: abort.signal });
    refreshPs(); // it is in flight now
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const e of sseEvents(resp)) {
      // read on to the body's end: the proxy counts the request out of flight
      // before the response ends, not before [DONE] (which may leave first)
      if (e.data === "[DONE]") continue;
      const chunk = JSON.parse(e.data);
      if (chunk.error) throw new Error(chunk.error.message || "error");
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timings) timings = chunk.timings;
      const choice = (chunk.choices || [])[0];
      const piece = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
      if (piece) {
        const now = performance.now();
        if (!first) first = now;
        last = now;
        tokens++;
        answer += piece;
        out.textContent = answer;
        $("#pg-transcript").scrollTop = $("#pg-transcript").scrollHeight;
        const n = tokens - 1;
        stats.textContent = tokens + " tokens"
          + (n > 0 && last > first ? " · " + ((1000 * n) / (last - first)).toFixed(1) + " tokens/s" : "")
          + " · TTFT " + fmtMs(first - t0);
      }
    }
    const n = usage && usage.completion_tokens ? usage.completion_tokens : tokens;
    const secs = (last - first) / 1000;
    stats.textContent = n + " tokens"
      + (n > 1 && secs > 0 ? " · " + ((n - 1) / secs).toFixed(1) + " tokens/s" : "")
      + (first ? " · TTFT " + fmtMs(first - t0) : "")
      // speculative decoding: the share of draft tokens accepted (llama-server's timings)
      + (timings && timings.draft_n ? " · drafts " + Math.round(100 * timings.draft_n_accepted
        / timings.draft_n) + "% accepted" : "");
    if (mode === "chat") conversation.push({ role: "assistant", content: answer });
  } catch (err) {
    if (err.name === "AbortError") {
      stats.textContent = "stopped after " + tokens + " tokens";
      if (mode === "chat" && answer) conversation.push({ role: "assistant", content: answer });
    } else {
      addMessage("error", String(err.message || err), "error");
      stats.textContent = "";
      if (mode === "chat") conversation.pop(); // the question went unanswered
    }
  } finally {
    abort = null;
    $("#pg-send").disabled = false;
    $("#pg-stop").disabled = true;
    refreshPs(); // no longer in flight: shown as the stream ends, not at the next tick
  }
}

function clearChat() {
  if (abort) abort.abort();
  conversation = [];
  $("#pg-transcript").textContent = "";
  $("#pg-stats").textContent = "";
  emptyHint();
}

// an empty transcript says what to do
function emptyHint() {
  const t = $("#pg-transcript");
  if (t.childNodes.length) return;
  t.appendChild(el("p", "muted pg-hint", "Pick a model above, write a message below and press "
    + "Enter: the answer streams here, with its time to first token and tokens/s."));
}

// ---- start ------------------------------------------------------------------
function start() {
  $("#filter").addEventListener("input", applyFilter);
  $("#unload-all").onclick = unloadIdle;
  $("#pg-form").addEventListener("submit", send);
  $("#pg-image").addEventListener("change", readImage);
  $("#pg-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#pg-form").requestSubmit(); }
  });
  $("#pg-stop").onclick = () => abort && abort.abort();
  $("#pg-clear").onclick = clearChat;
  $("#pg-mode").addEventListener("change", showAttach);
  $("#pg-model").onchange = () => { clearChat(); selectModel($("#pg-model").value); };
  $("#logs-model-only").onchange = restartLogs;
  $("#logs-admin").onclick = () => askKey("admin", "The log tail needs the admin key (--admin-key).");
  $("#req-admin").onclick = () => askKey("admin", "The requests need the admin key (--admin-key).");
  $("#req-model").onchange = restartRequests;
  $("#usage-range").onchange = refreshUsage; // the usage view (usage.js)
  $("#usage-admin").onclick = () => askKey("admin", "Usage needs the admin key (--admin-key).");
  $("#key-button").onclick = async () => {
    if (await askKey("api", "Your key: a key of the server's keys file, an --api-key key, or "
                     + "the admin key; empty for none.")) {
      loadList();
      restartLogs();
      restartRequests();
    }
  };
  emptyHint();
  loadList().then(() => {
    followStatus();
    restartLogs();
    restartRequests();
    refreshUsage();
  });
  refreshPs();
  setInterval(refreshPs, PS_INTERVAL_MS);
}

start();
