// ggmux's operator page: the log tail (GET /logs/stream, admin key), live.
// Loaded before app.js, whose helpers ($, el, api, sseEvents, keys,
// keyWaiters) it uses once the page starts.
"use strict";

const LOG_LINES_KEPT = 1000;
let logAbort = null;

// what a log line may not show raw (as shm/logring.py's escape_controls):
// C0 and C1 controls, DEL, line and paragraph separators, bidi overrides;
// a record holding them cannot pass for several lines (issue 31, item 3)
const LOG_CONTROLS = /[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;
const LOG_NAMED = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };

function escapeControls(text) {
  return String(text).replace(LOG_CONTROLS, (c) => {
    if (LOG_NAMED[c]) return LOG_NAMED[c];
    const n = c.charCodeAt(0);
    return n < 0x100 ? "\\x" + n.toString(16).padStart(2, "0") : "\\u" + n.toString(16).padStart(4, "0");
  });
}

// One record as the text of one line (no newline): "HH:MM:SS.mmm LEVEL [src] msg".
function logText(rec) {
  const d = new Date((Number(rec.ts) || 0) * 1000);
  const stamp = d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
  return stamp + " " + escapeControls(rec.level || "") + " [" + escapeControls(rec.src || "?") + "] "
    + escapeControls(rec.msg || "");
}

function logLine(rec) {
  const level = /^[A-Z]+$/.test(rec.level) ? rec.level : "INFO";
  const span = el("span", level, logText(rec) + "\n");
  const pre = $("#log");
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.appendChild(span);
  while (pre.childNodes.length > LOG_LINES_KEPT) pre.removeChild(pre.firstChild);
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

function restartLogs() {
  if (logAbort) logAbort.abort();
  followLogs();
}

async function followLogs() {
  const ctl = new AbortController();
  logAbort = ctl;
  const state = $("#logs-state");
  const only = $("#logs-model-only").checked && selected;
  const path = "/logs/stream?lines=200" + (only ? "&model=" + encodeURIComponent(selected) : "");
  $("#log").textContent = "";
  while (!ctl.signal.aborted) {
    try {
      const resp = await api(path, { admin: true, ask: false, signal: ctl.signal });
      if (resp.status === 401) {
        state.textContent = keys.admin ? "the admin key was refused" : "the log tail needs the admin key";
        $("#logs-admin").hidden = false;
        keyWaiters.add(restartLogs); // starts by itself once a key is entered
        return;
      }
      keyWaiters.delete(restartLogs);
      if (!resp.ok) throw new Error(await errorText(resp));
      $("#logs-admin").hidden = true;
      state.textContent = "live";
      for await (const ev of sseEvents(resp)) {
        if ($("#logs-pause").checked) continue;
        logLine(JSON.parse(ev.data));
      }
    } catch (err) {
      if (ctl.signal.aborted) return;
      state.textContent = "reconnecting";
    }
    await new Promise((r) => setTimeout(r, RETRY_MS));
  }
}
