// ggmux's operator page: the requests served (GET /requests/stream, admin
// key), live, newest first, for every model or one. Loaded before app.js,
// whose helpers ($, el, api, sseEvents, keys, keyWaiters, models) it uses
// once the page starts.
"use strict";

const REQUEST_ROWS_KEPT = 200;
const REQUEST_LABELS = { time: "time", model: "model", replica: "replica", api: "API",
  status: "status", prompt: "prompt", cached: "cached", generated: "generated", ttft: "TTFT",
  rate: "tokens/s", duration: "duration" };
// nginx's code, which ggmux records for a request its client left
const STATUS_499 = "499: the client closed the connection before the answer was complete "
  + "(it gave up or was stopped); the replica's work for it was cancelled";
let reqAbort = null;

function requestRow(r) {
  const tr = el("tr");
  tr.dataset.requestOf = r.model || ""; // (data-model is a models-table row)
  const d = new Date((r.time || 0) * 1000);
  const stamp = d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
  const n = (v) => (v === null || v === undefined ? "" : String(v));
  const where = r.replica === null ? "" : "#" + r.replica + (r.where && r.where !== "local" ? " @" + r.where : "");
  const cells = [
    ["time", stamp], ["model", r.model || ""], ["replica", where],
    ["api", r.api + " " + r.path + (r.stream ? " (stream)" : "")], ["status", n(r.status)],
    ["prompt", n(r.prompt_tokens)], ["cached", n(r.cached_tokens)],
    ["generated", n(r.generated_tokens) + (r.tokens_from === "proxy" ? "~" : "")],
    ["ttft", fmtMs(r.ttft_ms)], ["rate", r.tokens_per_s === null ? "" : r.tokens_per_s.toFixed(1)],
    ["duration", fmtMs(r.duration_ms)],
  ];
  for (const [name, text] of cells) {
    const td = el("td", "col-" + name, text);
    td.dataset.label = REQUEST_LABELS[name]; // shown before the value in a narrow window
    if (!["time", "model", "replica", "api"].includes(name)) td.classList.add("num");
    tr.appendChild(td);
  }
  if (r.status === 499) {
    const st = tr.querySelector(".col-status");
    st.title = STATUS_499;
    st.classList.add("explained");
    $("#requests-note").hidden = false;
  }
  if (r.status >= 400) tr.classList.add("failed");
  tr.title = "request " + (r.request_id || "") + (r.wait_ms ? ", waited " + fmtMs(r.wait_ms) : "")
    + (r.prompt !== undefined ? "\nprompt: " + r.prompt + "\nanswer: " + r.answer : "");
  return tr;
}

function restartRequests() {
  if (reqAbort) reqAbort.abort();
  followRequests();
}

async function followRequests() {
  const ctl = new AbortController();
  reqAbort = ctl;
  const state = $("#req-state");
  const only = $("#req-model").value;
  const path = "/requests/stream?limit=100" + (only ? "&model=" + encodeURIComponent(only) : "");
  const body = $("#requests tbody");
  body.textContent = "";
  while (!ctl.signal.aborted) {
    try {
      const resp = await api(path, { admin: true, ask: false, signal: ctl.signal });
      if (resp.status === 401) {
        state.textContent = keys.admin ? "the admin key was refused" : "the requests need the admin key";
        $("#req-admin").hidden = false;
        keyWaiters.add(restartRequests);
        return;
      }
      keyWaiters.delete(restartRequests);
      if (!resp.ok) throw new Error(await errorText(resp));
      $("#req-admin").hidden = true;
      state.textContent = "live";
      body.textContent = "";
      $("#requests-empty").hidden = false;
      for await (const ev of sseEvents(resp)) {
        body.insertBefore(requestRow(JSON.parse(ev.data)), body.firstChild); // newest first
        while (body.childNodes.length > REQUEST_ROWS_KEPT) body.removeChild(body.lastChild);
        $("#requests-empty").hidden = true;
      }
    } catch (err) {
      if (ctl.signal.aborted) return;
      state.textContent = "reconnecting";
    }
    await new Promise((r) => setTimeout(r, RETRY_MS));
  }
}

function fillRequestModels() {
  const sel = $("#req-model");
  const have = new Set([...sel.options].map((o) => o.value));
  for (const id of models.keys()) {
    if (have.has(id)) continue;
    const opt = el("option", null, id);
    opt.value = id;
    sel.appendChild(opt);
  }
}
