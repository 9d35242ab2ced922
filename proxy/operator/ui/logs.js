// ggmux's operator page: the log tail (GET /logs/stream, admin key), live.
// Loaded before app.js, whose helpers ($, el, api, sseEvents, keys,
// keyWaiters) it uses once the page starts.
"use strict";

const LOG_LINES_KEPT = 1000;
let logAbort = null;

function logLine(rec) {
  const d = new Date((rec.ts || 0) * 1000);
  const stamp = d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
  const span = el("span", rec.level || "INFO",
    stamp + " " + (rec.level || "") + " [" + (rec.src || "?") + "] " + (rec.msg || "") + "\n");
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
