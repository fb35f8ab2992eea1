// The operator's page: polls the router's dashboard API (a few requests a second) with the
// admin key kept in this tab's session, and draws what it gets. No library, no build step.
"use strict";

const KEY = "kvmesh-admin-key";
const FAST_MS = 1000; // the mesh and the recent requests
const SLOW_MS = 5000; // the figures and the series
let selected = null; // the request whose waterfall is open

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

class Unauthorized extends Error {}

async function api(path) {
  const key = sessionStorage.getItem(KEY);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401 || resp.status === 403) {
    const body = await resp.json().catch(() => ({}));
    throw new Unauthorized((body.error && body.error.message) || `HTTP ${resp.status}`);
  }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function showLogin(message) {
  $("#main").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
}

function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Math.abs(x) >= 1e9) return (x / 1e9).toFixed(digits) + "G";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}

function bar(used, total) {
  const share = total ? Math.min(1, used / total) : 0;
  const inner = el("span");
  inner.style.width = `${(share * 100).toFixed(1)}%`;
  return el("span", { title: `${used} / ${total}` }, el("span", { class: "bar" }, inner), ` ${(share * 100).toFixed(0)}%`);
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// -- the mesh --------------------------------------------------------------------------------

function drawMesh(mesh) {
  $("#router").textContent = `router ${mesh.router}`;
  $("#missing").textContent = mesh.missing_roles.length ? `no ready ${mesh.missing_roles.join(", ")}` : "";
  const order = ["router", "cachemeta", "encoder", "prefill", "decode"];
  const services = [...mesh.services].sort(
    (a, b) => order.indexOf(a.role) - order.indexOf(b.role) || a.id.localeCompare(b.id),
  );
  const rows = services.map((s) => {
    const load = s.load || {};
    const memory = load.memory_tier_bytes !== undefined && load.memory_tier_capacity
      ? bar(load.memory_tier_bytes, load.memory_tier_capacity) : "–";
    const kv = load.kv_blocks_total ? bar(load.kv_blocks_used, load.kv_blocks_total) : "–";
    return el("tr", { "data-service": s.id, "data-state": s.status },
      el("td", {}, s.id), el("td", {}, s.role),
      el("td", { class: `state-${s.status}` }, s.status),
      el("td", {}, `${s.age_s.toFixed(1)} s ago`),
      el("td", {}, fmt(load.inflight, 0)), el("td", {}, fmt(load.queued, 0)),
      el("td", {}, kv), el("td", {}, memory),
      el("td", {}, s.role === "prefill" || s.role === "decode" ? s.breaker : "–"),
      el("td", { class: s.kv_events === "ok" ? "" : "state-stale", title: s.kv_events },
        s.role === "prefill" || s.role === "decode" ? (s.kv_events === "ok" ? "ok" : "stale") : "–"));
  });
  for (const g of mesh.gone) {
    rows.push(el("tr", { class: "gone", "data-service": g.id, "data-state": "gone" },
      el("td", {}, g.id), el("td", {}, g.role), el("td", { class: "state-gone" }, "gone"),
      el("td", {}, `${g.gone_s.toFixed(0)} s ago`), el("td", {}, "–"), el("td", {}, "–"),
      el("td", {}, "–"), el("td", {}, "–"), el("td", {}, "–"), el("td", {}, "–")));
  }
  fill($("#mesh tbody"), rows);
}

// What the recent traffic needs (/v1/plan): what an autoscaler moves the pools to.
function drawPlan(plan) {
  const pools = ["prefill", "decode"].map(
    (role) => `${role} ${plan.recommended[role]} (now ${plan.current[role]})`);
  $("#plan").textContent =
    `plan: ${pools.join(", ")}, from ${plan.requests} requests in the last ${plan.window_s} s`;
}

// -- DeepInfer's figures ---------------------------------------------------------------------

function figureRow(name, f) {
  return el("tr", {},
    el("td", {}, name), el("td", {}, fmt(f.requests, 0)), el("td", {}, fmt(f.tokens_per_day)),
    el("td", {}, fmt(f.input_tokens_per_request)),
    el("td", {}, f.ttft_mean_s === null ? "–" : `${(f.ttft_mean_s * 1e3).toFixed(1)} ms`),
    el("td", {}, fmt(f.generation_tok_s_per_request)),
    el("td", {}, f.input_cache_hit_ratio === null ? "–" : `${(f.input_cache_hit_ratio * 100).toFixed(1)}%`),
    el("td", {}, fmt(f.requests_per_worker_hour)), el("td", {}, fmt(f.tokens_per_worker_hour)));
}

function drawFigures(stats) {
  // Over the last 24 h once the routers have seen that much; before, per day is a projection
  // of what they saw (/v1/stats says so: extrapolated).
  const seen = stats.window_s >= 3600 ? `${(stats.window_s / 3600).toFixed(1)} h` :
    `${Math.max(1, Math.round(stats.window_s / 60))} min`;
  $("#figures-window").textContent = stats.extrapolated ?
    `(DeepInfer's, over the ${seen} seen; per day extrapolated from them)` :
    "(DeepInfer's, over the last 24 h)";
  const rows = [figureRow("all", stats.overall)];
  for (const [name, f] of Object.entries(stats.by_class || {})) rows.push(figureRow(name, f));
  fill($("#figures tbody"), rows);
  const ms = (v) => (v === null || v === undefined ? "–" : `${fmt(v)} ms`);
  const waits = (t) => [el("td", {}, ms(t.ttft_p50_ms)), el("td", {}, ms(t.ttft_p99_ms)),
    el("td", {}, fmt(t.refused || 0, 0))];
  const classes = Object.entries(stats.by_priority || {}).map(([name, t]) => el("tr", {},
    el("td", {}, name), el("td", {}, fmt(t.requests, 0)), ...waits(t)));
  fill($("#classes tbody"), classes);
  const tenants = Object.entries(stats.by_tenant || {}).map(([name, t]) => el("tr", {},
    el("td", {}, name), el("td", {}, fmt(t.requests, 0)), el("td", {}, fmt(t.input_tokens)),
    el("td", {}, fmt(t.cached_tokens)),
    el("td", {}, t.input_cache_hit_ratio === null ? "–" : `${(t.input_cache_hit_ratio * 100).toFixed(1)}%`),
    ...waits(t)));
  fill($("#tenants tbody"), tenants);
}

// -- per-minute series -----------------------------------------------------------------------

function chart(svg, minutes, keyA, keyB) {
  const w = svg.clientWidth || 340, h = svg.clientHeight || 120, pad = 24;
  const values = minutes.flatMap((m) => [m[keyA], m[keyB]]).filter((v) => v !== null && v !== undefined);
  const top = Math.max(1e-9, ...values);
  const t0 = minutes.length ? minutes[0].minute : 0;
  const span = Math.max(1, (minutes.length ? minutes[minutes.length - 1].minute : 1) - t0);
  const x = (m) => pad + ((m.minute - t0) / span) * (w - pad - 4);
  const y = (v) => h - 14 - (v / top) * (h - 24);
  const line = (key) => minutes.filter((m) => m[key] !== null && m[key] !== undefined)
    .map((m, i) => `${i ? "L" : "M"}${x(m).toFixed(1)},${y(m[key]).toFixed(1)}`).join("");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.innerHTML = `<path class="a" d="${line(keyA)}"/><path class="b" d="${line(keyB)}"/>` +
    `<text x="2" y="10">${fmt(top)}</text><text x="2" y="${h - 4}">0</text>` +
    `<text x="${w - 60}" y="${h - 2}">${minutes.length} min</text>`;
}

function drawSeries(series) {
  // From the first minute with traffic (a young mesh's hours before it are empty).
  const first = series.minutes.findIndex((x) => x.requests || x.ok || x.errors);
  const m = first < 0 ? series.minutes.slice(-2) : series.minutes.slice(first);
  chart($("#chart-ttft"), m, "ttft_p50_ms", "ttft_p99_ms");
  chart($("#chart-hits"), m, "hit_ratio_memory", "hit_ratio_storage");
  chart($("#chart-tokens"), m, "input_tok_s", "output_tok_s");
  chart($("#chart-status"), m, "ok", "errors");
}

// -- recent requests and their waterfalls ----------------------------------------------------

function drawRequests(body) {
  fill($("#requests tbody"), body.requests.map((r) => el("tr", {
    class: "clickable", "data-request": r.id, onclick: () => openRequest(r.id),
  },
  el("td", {}, new Date(r.time * 1000).toLocaleTimeString()), el("td", {}, r.id),
  el("td", {}, r.tenant || "–"), el("td", {}, r.model || "–"),
  el("td", {}, fmt(r.prompt_tokens, 0)), el("td", {}, fmt(r.cached_tokens, 0)),
  el("td", {}, fmt(r.completion_tokens, 0)),
  el("td", {}, r.ttft_ms === null ? "–" : `${r.ttft_ms.toFixed(1)} ms`), el("td", {}, r.status))));
}

function serviceClass(span) {
  const role = (span.service || "").replace("kvmesh-", "");
  return ["router", "prefill", "decode", "cachemeta", "encoder"].includes(role) ? `svc-${role}` : "svc-other";
}

function drawWaterfall(detail) {
  const spans = detail.spans;
  const box = $("#waterfall");
  if (!spans.length) {
    box.replaceChildren(el("p", { class: "muted" }, "no spans (tracing off, or gone from the services' memory)"));
    return;
  }
  const t0 = Math.min(...spans.map((s) => s.start_ns));
  const t1 = Math.max(...spans.map((s) => s.end_ns));
  const total = Math.max(1, t1 - t0);
  const byId = Object.fromEntries(spans.map((s) => [s.span_id, s]));
  const depth = (s) => (s.parent_id && byId[s.parent_id] ? 1 + depth(byId[s.parent_id]) : 0);
  box.replaceChildren(...spans.map((s) => {
    const b = el("span", {
      class: `span-bar ${serviceClass(s)}${s.status === "error" ? " span-error" : ""}`,
      title: `${s.name} ${JSON.stringify(s.attributes)}${s.error ? " — " + s.error : ""}`,
    });
    b.style.left = `${((s.start_ns - t0) / total) * 100}%`;
    b.style.width = `${Math.max(0.3, ((s.end_ns - s.start_ns) / total) * 100)}%`;
    const name = el("span", {}, `${"\u00a0\u00a0".repeat(depth(s))}${s.name}`);
    return el("div", { class: "span-row", "data-span": s.name, "data-service": s.service_id },
      el("span", {}, s.service_id), name, el("span", { class: "span-track" }, b),
      el("span", {}, `${((s.end_ns - s.start_ns) / 1e6).toFixed(1)} ms`));
  }));
  const route = detail.route || {};
  const candidates = route.candidates || [];
  fill($("#decision tbody"), candidates.length
    ? candidates.map((c) => el("tr", {}, el("td", {}, c.worker || "–"), el("td", {}, JSON.stringify(c))))
    : [el("tr", {}, el("td", {}, route.chosen || "–"), el("td", {}, JSON.stringify(route)))]);
}

async function openRequest(id) {
  selected = id;
  $("#detail").hidden = false;
  $("#detail-id").textContent = id;
  try {
    drawWaterfall(await api(`/v1/dashboard/requests/${encodeURIComponent(id)}`));
  } catch (err) {
    if (err instanceof Unauthorized) showLogin(err.message);
    else $("#waterfall").textContent = String(err.message);
  }
}

// -- polling ---------------------------------------------------------------------------------

async function refresh(parts) {
  try {
    const got = await Promise.all(parts.map(([path]) => api(path)));
    $("#login").hidden = true;
    $("#main").hidden = false;
    parts.forEach(([, draw], i) => draw(got[i]));
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    return true;
  } catch (err) {
    if (err instanceof Unauthorized) showLogin(sessionStorage.getItem(KEY) ? err.message : "");
    else $("#updated").textContent = `not updated: ${err.message}`;
    return false;
  }
}

const FAST = [
  ["/v1/dashboard/mesh", drawMesh],
  ["/v1/dashboard/requests", drawRequests],
  ["/v1/plan", drawPlan],
];
const SLOW = [["/v1/stats", drawFigures], ["/v1/dashboard/series?minutes=180", drawSeries]];

function loop(parts, every) {
  const tick = async () => {
    if (!document.hidden && $("#login").hidden !== false) await refresh(parts);
    setTimeout(tick, every);
  };
  tick();
}

$("#login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("#key").value.trim());
  if (await refresh([...FAST, ...SLOW])) $("#key").value = "";
});

refresh([...FAST, ...SLOW]).then(() => {
  loop(FAST, FAST_MS);
  loop(SLOW, SLOW_MS);
});
