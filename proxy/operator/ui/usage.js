// ggmux's operator page: the usage ledger (GET /usage, admin key): tokens
// per key and model over time, one small chart each (SVG bars, no library),
// their totals, and the ledger's health (a store that fails, rows waiting,
// rows lost). Refreshed every USAGE_INTERVAL_MS. Loaded before app.js, whose
// helpers ($, el, api, errorText, keys, keyWaiters) it uses once the page starts.
"use strict";

const USAGE_INTERVAL_MS = 10000;
const USAGE_RANGES = { "24h": ["24h", "hour", 24, 3600], "7d": ["7d", "day", 7, 86400],
                       "30d": ["30d", "day", 30, 86400] };
const SVG_NS = "http://www.w3.org/2000/svg";
let usageTimer = null;

function svg(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

// bucket label ("2026-12-03" or "2026-12-03T19") -> Unix seconds (UTC)
function bucketTime(label) {
  return Date.parse(label.length === 10 ? label + "T00:00:00Z" : label + ":00:00Z") / 1000;
}

function fmtCount(n) {
  return n >= 1e6 ? (n / 1e6).toFixed(n < 1e7 ? 1 : 0) + "M"
    : n >= 1e3 ? (n / 1e3).toFixed(n < 1e4 ? 1 : 0) + "k" : String(n);
}

// one chart: bars of prompt (lower) and completion tokens per bucket, on
// the scale every row shares (`max`: the largest bucket of any row), with
// its axis: the scale's top at the left, the range's start and end below
function usageChart(points, start, count, step, max) {
  const w = 240, h = 48, left = 30, bottom = 11, ph = h - bottom - 2;
  const s = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: w, height: h, class: "usage-chart",
                         role: "img" });
  const byT = new Map(points.map((p) => [bucketTime(p.bucket), p]));
  const axis = (x1, y1, x2, y2) => s.appendChild(svg("line", { x1, y1, x2, y2, class: "axis" }));
  axis(left - 1, 1, left - 1, h - bottom);
  axis(left - 1, h - bottom, w, h - bottom);
  const label = (x, y, text, anchor) => {
    const t = svg("text", { x, y, class: "axis-label", "text-anchor": anchor });
    t.textContent = text;
    s.appendChild(t);
  };
  label(left - 3, 8, fmtCount(max), "end");
  label(left - 3, h - bottom, "0", "end");
  const day = (t) => new Date(t * 1000).toISOString().slice(step === 3600 ? 11 : 5,
                                                            step === 3600 ? 16 : 10);
  label(left, h - 1, day(start), "start");
  label(w, h - 1, day(start + (count - 1) * step), "end");
  const bw = (w - left) / count;
  for (let i = 0; i < count; i++) {
    const p = byT.get(start + i * step);
    if (!p) continue;
    const base = h - bottom;
    const hp = (p.prompt_tokens / max) * ph, hc = (p.completion_tokens / max) * ph;
    const x = left + i * bw + 0.5;
    s.appendChild(svg("rect", { x, y: base - hp, width: Math.max(1, bw - 1),
                                height: hp, class: "bar-prompt" }));
    s.appendChild(svg("rect", { x, y: base - hp - hc, width: Math.max(1, bw - 1),
                                height: hc, class: "bar-completion" }));
  }
  const t = svg("title");
  t.textContent = `tokens per ${step === 3600 ? "hour" : "day"} (prompt below, completion `
    + `above); every row's chart has one scale, up to ${max}`;
  s.appendChild(t);
  return s;
}

function ledgerLine(st) {
  if (!st) return "the usage ledger is off";
  let text = st.store + (st.ok ? "" : " FAILING: " + st.error);
  if (st.pending) text += `, ${st.pending} rows waiting`;
  if (st.lost) text += `, ${st.lost} requests missed (request ring lapped)`;
  if (st.dropped) text += `, ${st.dropped} rows dropped (buffer full)`;
  if (st.warning) text += ` WARNING: ${st.warning}`;
  return text;
}

function fmtIn(s) {
  if (s === null || s === undefined) return "";
  return s < 120 ? s + " s" : s < 7200 ? Math.floor(s / 60) + " min"
    : s < 172800 ? Math.floor(s / 3600) + " h" : Math.floor(s / 86400) + " days";
}

// GET /key/info with the page's key: a team member's own limits and use
async function showMine() {
  const box = $("#usage-mine");
  let resp;
  try {
    resp = await api("/key/info", { ask: false });
  } catch {
    return;
  }
  if (!resp.ok) { box.hidden = true; return; }
  const doc = await resp.json();
  if (doc.kind !== "keys-file") { box.hidden = true; return; }
  let head = `your key ${doc.name}: models ${(doc.models || ["*"]).join(", ")}`;
  if (doc.disabled) head += ", disabled";
  if (doc.expires) head += ", expires " + new Date(doc.expires * 1000).toISOString().slice(0, 16) + " UTC";
  if (!doc.limits.length) head += ", no limits";
  $("#usage-mine-head").textContent = head;
  const body = $("#usage-mine-limits tbody");
  body.textContent = "";
  for (const l of doc.limits) {
    const tr = el("tr");
    tr.dataset.limit = l.limit;
    tr.appendChild(el("td", "", l.limit.replace(/_/g, "-")));
    for (const v of [l.max, l.used, l.left]) tr.appendChild(el("td", "num", String(v)));
    tr.appendChild(el("td", "num", fmtIn(l.resets_in_s)));
    body.appendChild(tr);
  }
  $("#usage-mine-limits").hidden = !doc.limits.length;
  box.hidden = false;
}

async function refreshUsage() {
  clearTimeout(usageTimer);
  usageTimer = setTimeout(refreshUsage, USAGE_INTERVAL_MS);
  const [from, group, count, step] = USAGE_RANGES[$("#usage-range").value] || USAGE_RANGES["24h"];
  const state = $("#usage-state");
  let resp;
  try {
    resp = await api(`/usage?from=${from}&group=key,model,${group}`, { admin: true, ask: false });
  } catch {
    state.textContent = "no answer";
    return;
  }
  if (resp.status === 401 || resp.status === 403) {
    state.textContent = keys.admin ? "the admin key was refused"
      : "everyone's usage needs the admin key";
    $("#usage-admin").hidden = false;
    keyWaiters.add(refreshUsage);
    showMine(); // what the page's own key may see: its limits and what is left
    return;
  }
  keyWaiters.delete(refreshUsage);
  $("#usage-admin").hidden = true;
  $("#usage-mine").hidden = true;
  if (!resp.ok) {
    state.textContent = await errorText(resp);
    state.classList.add("failed");
    return;
  }
  const doc = await resp.json();
  state.textContent = ledgerLine(doc.ledger);
  state.classList.toggle("failed", !!(doc.ledger && !doc.ledger.ok));
  const series = new Map(); // "key\0model" -> rows
  for (const r of doc.data) {
    const id = r.key + "\0" + r.model;
    if (!series.has(id)) series.set(id, []);
    series.get(id).push({ ...r, bucket: r[group] });
  }
  const now = Date.now() / 1000;
  const start = Math.floor(now / step) * step - (count - 1) * step;
  const body = $("#usage tbody");
  body.textContent = "";
  let max = 1; // one scale for every row: a 1-request row is not as tall as a 400-request one
  for (const points of series.values()) {
    for (const p of points) max = Math.max(max, p.prompt_tokens + p.completion_tokens);
  }
  for (const [id, points] of [...series.entries()].sort()) {
    const [key, model] = id.split("\0");
    const sum = (f) => points.reduce((a, p) => a + (p[f] || 0), 0);
    const tr = el("tr");
    tr.dataset.usageKey = key;
    tr.dataset.usageModel = model;
    const cell = (cls, text, label) => {
      const td = el("td", cls, text);
      td.dataset.label = label; // shown before the value in a narrow window
      tr.appendChild(td);
      return td;
    };
    cell("col-key", key || "(no key)", "key");
    cell("col-model", model, "model");
    cell("col-chart", undefined, "tokens").appendChild(usageChart(points, start, count, step, max));
    for (const [f, label] of [["requests", "requests"], ["prompt_tokens", "prompt"],
                              ["cached_tokens", "cached"], ["completion_tokens", "completion"]]) {
      cell("num col-" + f, String(sum(f)), label);
    }
    cell("num col-cost", sum("cost") ? sum("cost").toFixed(4) : "", "cost");
    body.appendChild(tr);
  }
  $("#usage-empty").hidden = series.size > 0;
}
