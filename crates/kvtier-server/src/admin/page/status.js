// The status page: polls /stats and /stats/history and fills every element
// that names a stats field (data-key, with data-format saying how to show
// it). Each filled element keeps the raw value in data-value, so what the
// page shows can be checked against the JSON.
"use strict";

const POLL_MS = 2000;
const WINDOW_S = 15 * 60;
const SVG = "http://www.w3.org/2000/svg";

let token = sessionStorage.getItem("kvtier-token") || "";
let lastOk = null;
let failingSince = null;
let timer = null;

function lookup(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = n, u = 0;
  while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
  return u === 0 ? `${n} B` : `${v.toFixed(1)} ${units[u]}`;
}

function formatSeconds(s) {
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(2)} ms`;
  return `${s.toFixed(2)} s`;
}

function formatDuration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d > 0) return `${d}d ${h}h`;
  if (h > 0) return `${h}h ${m}m`;
  return `${m}m ${s % 60}s`;
}

function format(value, kind) {
  if (value === null || value === undefined) return "–";
  switch (kind) {
    case "bytes": return formatBytes(value);
    case "percent": return `${(value * 100).toFixed(1)}%`;
    case "seconds": return formatSeconds(value);
    case "duration": return formatDuration(value);
    case "count": return Number(value).toLocaleString("en-US");
    case "yesno": return value ? "yes" : "no";
    case "rate": return `${formatBytes(value)}/s`;
    default: return String(value);
  }
}

function derive(stats) {
  const s = stats.store;
  const errors = Object.values(stats.server.ops).reduce((sum, op) => sum + op.errors, 0);
  stats.derived = {
    memory_fill: s.memory_capacity > 0 ? s.memory_bytes / s.memory_capacity : null,
    disk_fill: s.disk_capacity > 0 ? s.disk_used_bytes / s.disk_capacity : null,
    request_errors: errors,
  };
  return stats;
}

function fill(stats) {
  for (const el of document.querySelectorAll("[data-key]")) {
    const value = lookup(stats, el.dataset.key);
    el.textContent = format(value, el.dataset.format);
    el.dataset.value = value === null || value === undefined ? "" : String(value);
    if (el.dataset.alarm) el.classList.toggle("alarm", Number(value) > 0);
  }
  for (const tier of ["memory", "disk"]) {
    const f = stats.derived[`${tier}_fill`];
    const bar = document.getElementById(`${tier}-fill`);
    bar.style.width = `${Math.min(100, (f || 0) * 100).toFixed(2)}%`;
    bar.classList.toggle("high", (f || 0) > 0.95);
  }
  const cluster = document.getElementById("cluster");
  const members = document.getElementById("members");
  if (stats.cluster && stats.cluster.enabled) {
    const c = stats.cluster;
    cluster.textContent = `cluster ${c.name}: ${c.members.length} members in view, node ` +
      `${c.node_id.slice(0, 8)} incarnation ${c.incarnation}` +
      (c.etcd_reachable ? "" : " (etcd unreachable: last view kept)");
    // One row per member, with this node's calls to it.
    const rows = c.members.map((m) => {
      const peer = (c.peers || {})[m.id] || {};
      const row = document.createElement("tr");
      row.dataset.member = m.id;
      const cells = [
        m.self ? `${m.id.slice(0, 8)} (this node)` : m.id.slice(0, 8),
        m.address,
        String(m.incarnation),
        m.self ? "–" : format(peer.requests || 0, "count"),
        m.self ? "–" : format(peer.errors || 0, "count"),
        m.self ? "–" : format(peer.mean_seconds, "seconds"),
      ];
      cells.forEach((text, i) => {
        const cell = document.createElement(i === 0 ? "th" : "td");
        cell.textContent = text;
        if (i === 4 && (peer.errors || 0) > 0) cell.classList.add("alarm");
        row.appendChild(cell);
      });
      return row;
    });
    members.tBodies[0].replaceChildren(...rows);
    members.hidden = false;
  } else {
    cluster.textContent = "cluster mode is off: this server is the whole cache";
    members.hidden = true;
  }
  const shared = document.getElementById("shared");
  const writers = document.getElementById("writers");
  const s = stats.shared_storage;
  if (s && s.enabled) {
    shared.textContent = `log in ${s.dir} (node ${s.node.slice(0, 8)}): ` +
      `${s.writers.length} other writers followed, last pass ` +
      `${format(stats.store.shared_follow_age_ms / 1000, "seconds")} ago, ` +
      `${format(stats.store.shared_reads, "count")} reads from their files`;
    const rows = s.writers.map((w) => {
      const row = document.createElement("tr");
      row.dataset.writer = w.node;
      const cells = [
        w.node.slice(0, 8),
        format(w.regions, "count"),
        format(w.bytes, "bytes"),
        String(w.newest_seq),
        w.last_change_age_ms === null ? "never" : `${format(w.last_change_age_ms / 1000, "seconds")} ago`,
      ];
      cells.forEach((text, i) => {
        const cell = document.createElement(i === 0 ? "th" : "td");
        cell.textContent = text;
        row.appendChild(cell);
      });
      return row;
    });
    writers.tBodies[0].replaceChildren(...rows);
    writers.hidden = false;
  } else {
    shared.textContent = "no shared directory: the disk tier is this node's own";
    writers.hidden = true;
  }
}

// A line chart of `series` over the last 15 minutes, drawn as SVG.
function chart(container, points, series, kind) {
  // Drawn at the container's own width, so text and dots keep their shape.
  const width = Math.max(300, container.clientWidth || 600), height = 150, left = 70, bottom = 22, top = 8;
  const now = points.length ? points[points.length - 1].t : Date.now() / 1000;
  const start = now - WINDOW_S;
  const shown = points.filter((p) => p.t >= start);
  let max = 0;
  for (const s of series) for (const p of shown) max = Math.max(max, p[s.field] || 0);
  if (kind === "percent") max = 1;
  if (max === 0) max = 1;
  const x = (t) => left + ((t - start) / WINDOW_S) * (width - left);
  const y = (v) => top + (1 - v / max) * (height - top - bottom);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  for (const frac of [0, 0.5, 1]) {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", left); line.setAttribute("x2", width);
    line.setAttribute("y1", y(max * frac)); line.setAttribute("y2", y(max * frac));
    line.setAttribute("class", "grid");
    svg.appendChild(line);
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", left - 4); label.setAttribute("y", y(max * frac) + 4);
    label.setAttribute("class", "axis");
    label.textContent = format(max * frac, kind);
    svg.appendChild(label);
  }
  for (const [t, text] of [[start, "−15 min"], [now, "now"]]) {
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", Math.min(width - 2, Math.max(left + 20, x(t))));
    label.setAttribute("y", height - 2);
    label.setAttribute("class", "axis time");
    label.textContent = text;
    svg.appendChild(label);
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of series) {
    const values = shown.filter((p) => p[s.field] !== null && p[s.field] !== undefined);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", values.map((p) => `${x(p.t).toFixed(1)},${y(p[s.field]).toFixed(1)}`).join(" "));
    line.setAttribute("class", `series ${s.css}`);
    line.dataset.field = s.field;
    line.dataset.points = String(values.length);
    svg.appendChild(line);
    // Dots where points are few (a lone point draws no line), else the last.
    for (const p of values.length <= 60 ? values : values.slice(-1)) {
      const dot = document.createElementNS(SVG, "circle");
      dot.setAttribute("cx", x(p.t).toFixed(1));
      dot.setAttribute("cy", y(p[s.field]).toFixed(1));
      dot.setAttribute("r", "2.5");
      dot.setAttribute("class", `dot ${s.css}`);
      svg.appendChild(dot);
    }
    const latest = values.length ? values[values.length - 1][s.field] : null;
    const item = document.createElement("span");
    item.className = `key ${s.css}`;
    item.dataset.field = s.field;
    item.dataset.value = latest === null ? "" : String(latest);
    item.textContent = `${s.name}: ${format(latest, kind)}`;
    legend.appendChild(item);
  }
  container.dataset.max = String(max);
  container.replaceChildren(svg, legend);
}

function hitRatePoints(points) {
  return points.map((p) => {
    const lookups = p.memory_hits + p.disk_hits + p.misses;
    return {
      t: p.t,
      overall: lookups ? (p.memory_hits + p.disk_hits) / lookups : null,
      memory: lookups ? p.memory_hits / lookups : null,
    };
  });
}

function drawCharts(history) {
  const points = history.points;
  chart(document.getElementById("chart-throughput"), points, [
    { name: "get", field: "get_bytes_per_s", css: "get" },
    { name: "put", field: "put_bytes_per_s", css: "put" },
  ], "rate");
  chart(document.getElementById("chart-latency"), points, [
    { name: "get p50", field: "get_p50_seconds", css: "get" },
    { name: "get p99", field: "get_p99_seconds", css: "get dashed" },
    { name: "put p50", field: "put_p50_seconds", css: "put" },
    { name: "put p99", field: "put_p99_seconds", css: "put dashed" },
  ], "seconds");
  chart(document.getElementById("chart-hits"), hitRatePoints(points), [
    { name: "overall", field: "overall", css: "get" },
    { name: "memory", field: "memory", css: "put" },
  ], "percent");
}

function setState(ok, text) {
  const state = document.getElementById("state");
  state.textContent = text;
  state.className = `state ${ok ? "ok" : "down"}`;
}

async function fetchJson(path) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) {
    const error = new Error("this endpoint needs the server's token");
    error.unauthorized = true;
    throw error;
  }
  if (!response.ok) throw new Error(`${path} answered ${response.status}`);
  return response.json();
}

async function poll() {
  const banner = document.getElementById("banner");
  try {
    const [stats, history] = await Promise.all([fetchJson("stats"), fetchJson("stats/history")]);
    fill(derive(stats));
    drawCharts(history);
    lastOk = new Date();
    failingSince = null;
    banner.hidden = true;
    document.getElementById("token-form").hidden = true;
    document.getElementById("updated").textContent = lastOk.toLocaleTimeString();
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
    setState(true, "serving");
  } catch (error) {
    if (error.unauthorized) {
      document.getElementById("token-form").hidden = false;
      setState(false, "token needed");
    } else {
      failingSince = failingSince || new Date();
      banner.hidden = false;
      banner.textContent = lastOk
        ? `The server stopped answering at ${failingSince.toLocaleTimeString()} (${error.message}). ` +
          `The figures below are from ${lastOk.toLocaleTimeString()}; retrying every ${POLL_MS / 1000} s.`
        : `Cannot reach the server (${error.message}); retrying every ${POLL_MS / 1000} s.`;
      document.body.classList.toggle("stale", lastOk !== null);
      setState(false, "not answering");
    }
  }
  if (failingSince === null) document.body.classList.remove("stale");
  timer = setTimeout(poll, POLL_MS);
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  token = document.getElementById("token").value.trim();
  sessionStorage.setItem("kvtier-token", token);
  clearTimeout(timer);
  poll();
});

poll();
