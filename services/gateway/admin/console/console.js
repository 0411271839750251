// Lockstep operator console: polls the admin API once a second and renders tables.
// No framework, no build step. The admin token comes from the URL fragment (#token=…,
// removed from the address bar at once) or the form, lives in sessionStorage and is
// sent only as the Authorization header. Every value is written with textContent.
"use strict";

const TOKEN_KEY = "lockstep.admin.token";
const POLL_MS = 1000;
const CHART_S = 300;
const $ = (sel) => document.querySelector(sel);

const state = {
  token: null,
  prevSteps: new Map(),   // "dep/rank/pid" -> {step, t}
  prevTokens: null,       // {total, t} for the tokens/s chart
  tps: [],                // [t, tokens/s]
  depTps: new Map(),      // deployment id -> {tokens, t, rate}
  ttft: [],               // [t, model ms, visible ms]
  ttftSeen: new Set(),
  skew: 0,                // server wall clock minus ours, seconds
  timer: null,
};

// --- auth -------------------------------------------------------------------------

function takeFragmentToken() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search); // off the address bar
}

function showLogin(message) {
  $("#login").hidden = false;
  $("#main").hidden = true;
  $("#logout").hidden = true;
  $("#login-error").textContent = message || "";
}

function showMain() {
  $("#login").hidden = true;
  $("#main").hidden = false;
  $("#logout").hidden = false;
}

async function api(method, path) {
  const r = await fetch(path, {method, cache: "no-store", credentials: "omit",
                               headers: {"Authorization": "Bearer " + state.token}});
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (r.status === 401) throw {auth: true, message: (body && body.error && body.error.message) || "unauthorized"};
  if (!r.ok) throw {auth: false, message: (body && body.error && body.error.message) || ("HTTP " + r.status)};
  return body;
}

// --- formatting -------------------------------------------------------------------

function fmtBytes(n) {
  if (!n) return "0";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}

// A rank's KV against its budget (issue 45): held now / budget, and the most held.
function fmtKv(kv) {
  if (!kv) return "–";
  if (!kv.budget) return fmtBytes(kv.held) + " (no budget)";
  return {text: fmtBytes(kv.held) + " / " + fmtBytes(kv.budget) + " (peak " +
                fmtBytes(kv.held_peak) + ")",
          cls: kv.held_peak > kv.budget ? "bad" : ""};
}

// Rank 0's queue: waiting by priority, and what the budget did (waits, preemptions, refusals).
function fmtQueue(kv) {
  if (!kv) return "–";
  const prios = Object.entries(kv.queued_by_priority || {})
    .sort((a, b) => Number(a[0]) - Number(b[0]))
    .map(([p, n]) => n + " at " + p).join(", ");
  return {text: kv.waiting + " waiting" + (prios ? " (" + prios + ")" : "") + "; waits " +
                kv.waits + ", preempted " + kv.preemptions + ", refused " + kv.refused,
          cls: "wrap", title: Object.entries(kv.queued_by_tenant || {})
            .map(([t, n]) => t + ": " + n + " waiting").join("\n")};
}

function fmtAge(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
}

function fmtMs(v) { return (v === null || v === undefined) ? "–" : v.toFixed(0) + " ms"; }
function fmtTime(t) { return new Date(t * 1000).toLocaleTimeString(); }
function now() { return Date.now() / 1000 + state.skew; }

// --- keyed table rows: a row lives as long as its key (no flicker, stable buttons) ---

function syncRows(table, items, keyOf, cellsOf, decorate) {
  const tbody = $(table + " tbody");
  const old = new Map();
  for (const tr of Array.from(tbody.rows)) old.set(tr.dataset.key, tr);
  let prev = null;
  for (const item of items) {
    const key = keyOf(item);
    let tr = old.get(key);
    const cells = cellsOf(item);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.key = key;
      for (let i = 0; i < cells.length; i++) tr.appendChild(document.createElement("td"));
    }
    old.delete(key);
    cells.forEach((c, i) => setCell(tr.cells[i], c));
    if (decorate) decorate(tr, item);
    const want = prev ? prev.nextSibling : tbody.firstChild;
    if (want !== tr) tbody.insertBefore(tr, want);
    prev = tr;
  }
  for (const tr of old.values()) tr.remove();
}

// A cell is text, or {text, cls, title}, or {node} (built once, updated by `update`).
function setCell(td, c) {
  if (c !== null && typeof c === "object" && "make" in c) {
    if (!td.firstChild || td.firstChild.dataset.kind !== c.kind) {
      td.textContent = "";
      const n = c.make();
      n.dataset.kind = c.kind;
      td.appendChild(n);
    }
    c.update(td.firstChild);
    return;
  }
  const o = (c !== null && typeof c === "object") ? c : {text: c};
  const text = o.text === null || o.text === undefined ? "" : String(o.text);
  if (td.textContent !== text) td.textContent = text;
  td.className = o.cls || "";
  if (o.title) td.title = o.title; else td.removeAttribute("title");
}

// --- renderers --------------------------------------------------------------------

// A deployment is born `launching` (no event: deployment_state.py), so its first
// event is the move to loading.
const FIRST_EVENT = "loading";

function depHistory(events, depId) {
  return events.filter((e) => e.topic === "deployment" && e.name === "state" && e.deployment_id === depId);
}

function renderDeployments(status, reqs) {
  const deps = status.deployments || [];
  const events = status.events || [];
  $("#dep-count").textContent = "(" + deps.length + ")";
  syncRows("#deployments", deps, (d) => d.deployment_id, (d) => {
    const hist = depHistory(events, d.deployment_id);
    const serving = hist.filter((e) => e.state === "serving").pop();
    const since = serving ? serving.at : (hist.length ? hist[0].at : null);
    const hosts = Array.from(new Set((d.ranks || []).map((r) => r.host))).join(", ");
    const gw = (reqs.deployments || {})[d.deployment_id];
    const rate = state.depTps.get(d.deployment_id);
    const c0 = ((d.ranks || []).find((r) => r.rank === 0) || {}).cache;
    const cache = c0 ? (c0.entries + " entries, " + fmtBytes(c0.bytes) + ", hits " + c0.hits +
                        "/" + (c0.hits + c0.misses) + ", " + c0.hit_tokens + " tok" +
                        (c0.disk_entries || c0.disk_hits || c0.disk_rejected ?
                          "; disk " + c0.disk_entries + " entries, " + fmtBytes(c0.disk_bytes) +
                          ", hits " + c0.disk_hits + ", rejected " + c0.disk_rejected : ""))
                     : "off";
    return [
      d.deployment_id,
      d.model + (d.replicas > 1 ? " (replica " + (d.replica + 1) + "/" + d.replicas + ")" : ""),
      d.tp + "×" + d.pp, d.backend, hosts,
      {text: d.state, cls: "state-" + d.state},
      {text: (hist.length && hist[0].state === FIRST_EVENT ? ["launching"] : [])
         .concat(hist.map((e) => e.state)).join(" → "), cls: "wrap",
       title: hist.map((e) => fmtTime(e.at) + " " + e.state + (e.reason ? ": " + e.reason : "")).join("\n")},
      d.state === "serving" && since ? fmtAge(now() - since) : "–",
      gw ? gw.active + (d.replicas > 1 ? " (load " + gw.load + (gw.draining ? ", draining" : "") + ")" : "") : 0,
      rate && rate.rate !== null ? rate.rate.toFixed(1) : "–",
      fmtQueue(((d.ranks || []).find((r) => r.rank === 0) || {}).kv),
      cache,
      {text: d.error || "", cls: "wrap bad"},
    ];
  });
}

function renderRanks(status) {
  const rows = [];
  for (const d of status.deployments || []) {
    for (const r of d.ranks || []) rows.push([d, r]);
  }
  $("#epoch").textContent = "cluster cancel epoch " + status.cancel_epoch;
  const t = now();
  syncRows("#ranks", rows, ([d, r]) => d.deployment_id + "/" + r.rank, ([d, r]) => {
    const k = d.deployment_id + "/" + r.rank + "/" + r.pid;
    const prev = state.prevSteps.get(k);
    let sps = null;
    if (prev && r.last_seen > prev.t) sps = (r.step - prev.step) / (r.last_seen - prev.t);
    if (!prev || r.last_seen > prev.t) state.prevSteps.set(k, {step: r.step, t: r.last_seen, sps});
    else sps = prev.sps;
    const age = r.last_seen ? t - r.last_seen : null;
    const ld = r.load;
    return [
      d.deployment_id, r.rank, r.host + (r.remote ? " (remote)" : ""), r.pid,
      {text: r.phase, cls: "phase state-" + r.phase},
      r.step, sps === null || sps === undefined ? "–" : sps.toFixed(1), r.active,
      fmtBytes(r.mem_active),
      fmtKv(r.kv),
      {text: fmtAge(age), cls: age !== null && age > 5 ? "bad" : ""},
      {text: r.cancel_epoch + " / " + r.acked_epoch,
       cls: r.acked_epoch < status.cancel_epoch ? "warn" : ""},
      ld && ld.total_bytes ? {kind: "load", make: () => {
        const s = document.createElement("span");
        s.appendChild(document.createElement("progress"));
        s.appendChild(document.createElement("span"));
        return s;
      }, update: (s) => {
        s.firstChild.max = ld.total_bytes;
        s.firstChild.value = Math.min(ld.read_bytes, ld.total_bytes);
        s.lastChild.textContent = " " + fmtBytes(ld.read_bytes) + " / " + fmtBytes(ld.total_bytes);
      }} : "",
    ];
  });
}

function renderRequests(reqs) {
  const rows = reqs.requests || [];
  $("#req-count").textContent = "(" + rows.length + ")";
  syncRows("#requests", rows, (q) => q.request_id, (q) => [
    q.request_id, q.model, q.deployment_id, fmtAge(q.age_s), q.prompt_tokens, q.cached_tokens,
    q.generated_tokens, fmtMs(q.model_ttft_ms), fmtMs(q.visible_ttft_ms),
    q.finished ? "finishing" : (q.aborting ? "aborting (" + q.abort_reason + ")" : "running"),
    {kind: "abort", make: () => {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "abort";
      b.textContent = "Abort";
      return b;
    }, update: (b) => { b.dataset.rid = q.request_id; b.disabled = q.finished || q.aborting; }},
  ], (tr, q) => { tr.dataset.rid = q.request_id; });
}

// An incident row from one journal event (services/supervisor/service.py), or null.
function incidentOf(e) {
  const data = e.data || {};
  if (e.topic === "incident") {
    const extra = data.outcome ? ladder(data.outcome) : "";
    return {kind: e.name, cls: "bad", what: e.reason, detail: extra};
  }
  if (e.topic === "deployment" && e.name === "teardown") {
    return {kind: "teardown", cls: "warn", what: e.reason, detail: data.outcome ? ladder(data.outcome) : ""};
  }
  if (e.topic === "deployment" && e.name === "state") {
    if (["failed", "teardown_failed", "stopped"].includes(e.state)) {
      const n = e.state === "stopped" ? 0 : ((resumedFrom || {})[e.deployment_id] || 0);
      const resumed = n ? n + " request(s) resumed elsewhere" : "";
      return {kind: e.state, cls: e.state === "stopped" ? "" : "bad", what: e.reason,
              detail: [data.teardown ? ladder(data.teardown) : "", resumed].filter(Boolean).join("; ")};
    }
    if (e.state === FIRST_EVENT) return {kind: "deploy", cls: "", what: "launched: " + e.reason, detail: ""};
    if (e.state === "serving") return {kind: "serving", cls: "ok", what: e.reason, detail: ""};
    return null;
  }
  if (e.topic === "reap") {
    if (e.name === "pass" && !((data.reaped || []).length || e.outcome === "blocked")) return null;
    const detail = e.name === "reaped" ? "job " + data.job_id + ", " + data.ranks + " rank(s), " +
      ((data.path || []).join(" → ") || "none alive") : "";
    return {kind: "reap " + e.name, cls: e.name === "reaped" ? "warn" : "bad", what: e.reason, detail};
  }
  return null;
}

function ladder(outcome) {
  const path = (outcome.path || []).join(" → ") || "none alive";
  const s = outcome.survivors && outcome.survivors.length ? "; survivors " + outcome.survivors.length : "";
  return "teardown " + path + (outcome.proven === false ? " (NOT proven)" : " (proven)") + s;
}

let resumedFrom = {};  // failed deployment → requests the gateway resumed elsewhere

function renderIncidents(status) {
  resumedFrom = (status.gateway || {}).resumed || {};
  const evs = status.events || [];
  const rows = [];
  let failedBefore = false;
  evs.forEach((e, i) => {
    const inc = incidentOf(e);
    if (!inc) return;
    if (inc.kind === "failed" || inc.kind === "rank_lost") failedBefore = true;
    if (inc.kind === "deploy" && failedBefore) { inc.kind = "redeploy"; inc.cls = "warn"; failedBefore = false; }
    rows.push(Object.assign({key: i + ":" + e.at + ":" + e.name, e}, inc));
  });
  rows.reverse();
  syncRows("#incidents", rows, (r) => r.key, (r) => [
    fmtTime(r.e.at), {text: r.kind, cls: r.cls}, r.e.deployment_id || "–",
    {text: r.what, cls: "wrap"}, {text: r.detail, cls: "wrap"},
  ], (tr, r) => { tr.dataset.kind = r.kind; });
  const rej = (status.rejections || []).filter((r) => r.count > 0);
  syncRows("#rejections", rej, (r) => r.service + "/" + r.socket + "/" + r.reason,
           (r) => [r.service, r.socket, r.reason, {text: r.count, cls: "warn"}]);
}

// --- charts (canvas, drawn here) ---------------------------------------------------

function sampleCharts(reqs) {
  const t = reqs.at;
  let total = 0;
  for (const [id, d] of Object.entries(reqs.deployments || {})) {
    total += d.tokens_out;
    const p = state.depTps.get(id);
    const rate = p && t > p.t ? Math.max(0, (d.tokens_out - p.tokens) / (t - p.t)) : null;
    state.depTps.set(id, {tokens: d.tokens_out, t, rate});
  }
  const p = state.prevTokens;
  if (p && t > p.t) state.tps.push([t, Math.max(0, (total - p.total) / (t - p.t))]);
  state.prevTokens = {total, t};
  for (const q of reqs.requests || []) {
    if (q.visible_ttft_ms !== null && !state.ttftSeen.has(q.request_id)) {
      state.ttftSeen.add(q.request_id);
      state.ttft.push([t, q.model_ttft_ms, q.visible_ttft_ms]);
    }
  }
  const cut = t - CHART_S;
  while (state.tps.length && state.tps[0][0] < cut) state.tps.shift();
  while (state.ttft.length && state.ttft[0][0] < cut) state.ttft.shift();
  if (state.ttftSeen.size > 4096) state.ttftSeen.clear();
  drawChart($("#chart-tps"), t, [{pts: state.tps.map((x) => [x[0], x[1]]), line: true}]);
  drawChart($("#chart-ttft"), t, [
    {pts: state.ttft.filter((x) => x[1] !== null).map((x) => [x[0], x[1]]), fill: true},
    {pts: state.ttft.map((x) => [x[0], x[2]]), fill: false},
  ]);
}

function drawChart(canvas, tNow, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 4, left = 44;
  ctx.clearRect(0, 0, w, h);
  let max = 1;
  for (const s of series) for (const p of s.pts) max = Math.max(max, p[1]);
  ctx.strokeStyle = "#dedee3";
  ctx.fillStyle = "#6b6b70";
  ctx.font = "10px sans-serif";
  ctx.beginPath(); ctx.moveTo(left, pad); ctx.lineTo(left, h - pad); ctx.lineTo(w - pad, h - pad); ctx.stroke();
  ctx.fillText(max.toFixed(max < 10 ? 1 : 0), 2, pad + 8);
  ctx.fillText("0", 2, h - pad);
  const x = (t) => left + (w - left - pad) * (1 - (tNow - t) / CHART_S);
  const y = (v) => h - pad - (h - 2 * pad) * (v / max);
  ctx.strokeStyle = ctx.fillStyle = "#1a5fb4";
  for (const s of series) {
    if (s.line) {
      ctx.beginPath();
      s.pts.forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1]))));
      ctx.stroke();
      continue;
    }
    for (const p of s.pts) {
      ctx.beginPath();
      ctx.arc(x(p[0]), y(p[1]), 2.5, 0, 2 * Math.PI);
      if (s.fill) ctx.fill(); else ctx.stroke();
    }
  }
}

// --- the loop -----------------------------------------------------------------------

async function poll() {
  state.timer = null;
  try {
    const [status, reqs] = await Promise.all([api("GET", "/admin/api/cluster/status"),
                                              api("GET", "/admin/api/requests")]);
    state.skew = reqs.at - Date.now() / 1000;
    showMain();
    sampleCharts(reqs);
    renderDeployments(status, reqs);
    renderRanks(status);
    renderRequests(reqs);
    renderIncidents(status);
    $("#conn").textContent = "live";
    $("#conn").className = "conn ok";
    $("#clock").textContent = "updated " + fmtTime(reqs.at);
  } catch (err) {
    if (err && err.auth) {
      sessionStorage.removeItem(TOKEN_KEY);
      state.token = null;
      showLogin(err.message);
      return; // no polling without a token
    }
    $("#conn").textContent = "error: " + ((err && err.message) || err);
    $("#conn").className = "conn bad";
  }
  state.timer = setTimeout(poll, POLL_MS); // one poll at a time, never overlapping
}

function start() {
  state.token = sessionStorage.getItem(TOKEN_KEY);
  if (!state.token) { showLogin(""); return; }
  if (state.timer === null) poll();
}

document.addEventListener("DOMContentLoaded", () => {
  takeFragmentToken();
  $("#login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = $("#token").value.trim();
    if (!v) return;
    sessionStorage.setItem(TOKEN_KEY, v);
    $("#token").value = "";
    start();
  });
  $("#logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    if (state.timer !== null) { clearTimeout(state.timer); state.timer = null; }
    state.token = null;
    showLogin("");
  });
  $("#requests tbody").addEventListener("click", async (ev) => {
    const b = ev.target.closest("button.abort");
    if (!b || !b.dataset.rid) return;
    b.disabled = true;
    try {
      await api("POST", "/admin/api/requests/" + encodeURIComponent(b.dataset.rid) + "/abort");
    } catch (err) {
      $("#conn").textContent = "abort failed: " + ((err && err.message) || err);
      $("#conn").className = "conn bad";
    }
  });
  window.addEventListener("hashchange", () => { takeFragmentToken(); start(); });
  start();
});
