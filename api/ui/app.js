// The xpu-jobs dashboard: plain JavaScript over the REST API with the tenant's own key (kept in this browser's
// localStorage), so it shows exactly what that key may see. Live views follow the SSE event streams.
"use strict";

const KEY = "xpujobs_api_key";
const ENDED = new Set(["succeeded", "failed", "cancelled", "completed", "expired"]);
const view = document.getElementById("view");
let leave = () => {};  // stops the live parts of the current view

function key() { return localStorage.getItem(KEY) || ""; }
function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

async function api(path, options = {}) {
  const response = await fetch("/v1" + path, {
    ...options, headers: { ...(options.headers || {}), Authorization: "Bearer " + key() },
  });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

// h("td", {class: "mono"}, "text", child...): text is always set as text, never parsed as HTML.
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined) el.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function svg(tag, attrs = {}) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, value);
  return el;
}

function when(seconds) { return seconds ? new Date(seconds * 1000).toLocaleString() : "–"; }
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
function status(s) { return h("span", { class: "status " + s }, s); }
function bar(fraction) {
  return h("span", { class: "bar" }, h("span", { style: `width:${Math.round(100 * Math.min(1, fraction || 0))}%` }));
}
function table(headers, rows) {
  return h("table", {}, h("tr", {}, headers.map((t) => h("th", {}, t))), rows);
}
function cancelButton(path, label, after) {
  return h("button", {
    class: "cancel", "data-cancel": path,
    onclick: async (event) => {
      event.preventDefault();
      try { await api(path, { method: "POST" }); } catch (e) { alert(e.message); }
      after();
    },
  }, label);
}

// Follow a job's events as server-sent events (fetch, since EventSource cannot send the key), resuming with
// Last-Event-ID after a dropped connection, until the server ends the stream (the job ended) or the view is left.
async function follow(path, onEvent, signal) {
  let last = null;
  while (!signal.aborted) {
    try {
      const headers = { Authorization: "Bearer " + key(), Accept: "text/event-stream" };
      if (last) headers["Last-Event-ID"] = last;
      const response = await fetch("/v1" + path, { headers, signal });
      if (!response.ok) throw new Error(response.statusText);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer = (buffer + value).replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim());
          const id = block.split("\n").find((l) => l.startsWith("id:"));
          if (id) last = id.slice(3).trim();
          if (data.length) onEvent(JSON.parse(data.join("\n")));
        }
      }
    } catch (error) {
      if (signal.aborted) return;
      await sleep(2000);
    }
  }
}

// A line chart of one or more series [{name, color, points: [[x, y], ...]}].
function chart(id, title, series, width = 480, height = 230) {
  const pad = { left: 52, right: 12, top: 10, bottom: 26 };
  const all = series.flatMap((s) => s.points);
  const root = svg("svg", { id, width, height, viewBox: `0 0 ${width} ${height}` });
  const box = h("div", { class: "chart" }, h("div", {}, h("b", {}, title), " ",
    h("span", { class: "legend" }, series.map((s) => h("span", { style: `color:${s.color}` }, "● " + s.name)))), root);
  if (!all.length) {
    root.append(Object.assign(svg("text", { x: width / 2 - 40, y: height / 2 }), { textContent: "no data yet" }));
    return box;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = (x) => pad.left + (x - x0) / (x1 - x0) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - (y - y0) / (y1 - y0) * (height - pad.top - pad.bottom);
  root.append(svg("line", { x1: pad.left, y1: height - pad.bottom, x2: width - pad.right, y2: height - pad.bottom,
                            stroke: "#99a" }));
  root.append(svg("line", { x1: pad.left, y1: pad.top, x2: pad.left, y2: height - pad.bottom, stroke: "#99a" }));
  const label = (x, y, text) => root.append(Object.assign(svg("text", { x, y }), { textContent: text }));
  label(2, pad.top + 8, y1.toPrecision(3));
  label(2, height - pad.bottom, y0.toPrecision(3));
  label(pad.left, height - 8, "step " + x0);
  label(width - pad.right - 60, height - 8, "step " + x1);
  for (const s of series) {
    const points = s.points.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points, fill: "none", stroke: s.color, "stroke-width": 1.6,
                                  "data-series": s.name, "data-count": s.points.length }));
    if (s.points.length < 30) {
      for (const [x, y] of s.points) root.append(svg("circle", { cx: X(x), cy: Y(y), r: 2.5, fill: s.color }));
    }
  }
  return box;
}

// ---------------------------------------------------------------------------------------------- views

async function jobsView() {
  const jobs = (await api("/fine_tuning/jobs?limit=100")).data;
  view.replaceChildren(h("h2", {}, "Fine-tuning jobs"), table(
    ["job", "model", "status", "created", "fine-tuned model", ""],
    jobs.map((j) => h("tr", { "data-id": j.id },
      h("td", { class: "mono" }, h("a", { href: "#/jobs/" + j.id }, j.id)), h("td", {}, j.model),
      h("td", {}, status(j.status)), h("td", {}, when(j.created_at)),
      h("td", { class: "mono" }, j.fine_tuned_model || "–"),
      h("td", {}, ENDED.has(j.status) ? "" : cancelButton(`/fine_tuning/jobs/${j.id}/cancel`, "Cancel", route))))));
}

async function jobView(id) {
  const controller = new AbortController();
  leave = () => controller.abort();
  const train = [], rate = [];
  let job = await api("/fine_tuning/jobs/" + id), checkpoints = [], latest = {};
  const header = h("div"), charts = h("div", { class: "charts" }), points = h("div");
  view.replaceChildren(h("h2", {}, "Fine-tuning job ", h("span", { class: "mono" }, id)), header, charts, points);

  function draw() {
    const eta = job.estimated_finish && !ENDED.has(job.status)
      ? `${when(job.estimated_finish)} (in ${Math.max(0, job.estimated_finish - Math.floor(Date.now() / 1000))} s)`
      : "–";
    header.replaceChildren(h("div", { class: "cards" },
      h("div", { class: "card" }, h("b", {}, "status"), h("span", { id: "job-status" }, status(job.status))),
      h("div", { class: "card" }, h("b", {}, "model"), job.model),
      h("div", { class: "card" }, h("b", {}, "step"), latest.step ? `${latest.step} / ${latest.total_steps}` : "–",
        " ", bar(latest.step / latest.total_steps)),
      h("div", { class: "card" }, h("b", {}, "ETA"), h("span", { id: "eta" }, eta)),
      h("div", { class: "card" }, h("b", {}, "speed"),
        latest.steps_per_second ? `${latest.steps_per_second.toFixed(2)} steps/s` : "–"),
      h("div", { class: "card" }, h("b", {}, "fine-tuned model"), h("span", { class: "mono" }, job.fine_tuned_model || "–")),
      ENDED.has(job.status) ? "" : cancelButton(`/fine_tuning/jobs/${id}/cancel`, "Cancel job", refresh)),
      job.error ? h("p", { class: "error" }, job.error.message) : "");
    const valid = checkpoints.filter((c) => c.metrics && c.metrics.valid_loss != null)
      .map((c) => [c.step_number, c.metrics.valid_loss]).sort((a, b) => a[0] - b[0]);
    charts.replaceChildren(
      chart("loss-chart", "Loss", [{ name: "training", color: "#2f7ed8", points: train },
                                   { name: "validation", color: "#e4572e", points: valid }]),
      chart("lr-chart", "Learning rate", [{ name: "learning rate", color: "#3a9d5d", points: rate }]));
    points.replaceChildren(h("h2", {}, "Checkpoints"), table(["step", "model id", "training loss", "validation loss"],
      checkpoints.map((c) => h("tr", {}, h("td", {}, c.step_number),
        h("td", { class: "mono" }, c.fine_tuned_model_checkpoint), h("td", {}, fixed(c.metrics.train_loss)),
        h("td", {}, fixed(c.metrics.valid_loss))))));
  }
  async function refresh() {
    [job, checkpoints] = [await api("/fine_tuning/jobs/" + id),
                          (await api(`/fine_tuning/jobs/${id}/checkpoints?limit=100`)).data];
    draw();
  }
  await refresh();
  const timer = setInterval(() => refresh().catch(() => {}), 3000);
  controller.signal.addEventListener("abort", () => clearInterval(timer));
  follow(`/fine_tuning/jobs/${id}/events`, (event) => {
    if (event.type === "metrics") {
      latest = event.data;
      train.push([event.data.step, event.data.train_loss]);
      if (event.data.learning_rate != null) rate.push([event.data.step, event.data.learning_rate]);
      job.estimated_finish = event.data.estimated_finish;
      draw();
    } else if (event.data && event.data.status) {
      refresh().catch(() => {});
    }
  }, controller.signal);
}

function fixed(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(4); }

async function batchesView() {
  const batches = (await api("/batches?limit=100")).data;
  view.replaceChildren(h("h2", {}, "Batches"), table(
    ["batch", "endpoint", "status", "progress", "created", ""],
    batches.map((b) => {
      const c = b.request_counts, done = c.completed + c.failed;
      return h("tr", { "data-id": b.id },
        h("td", { class: "mono" }, h("a", { href: "#/batches/" + b.id }, b.id)), h("td", {}, b.endpoint),
        h("td", {}, status(b.status)), h("td", {}, bar(c.total ? done / c.total : 0), ` ${done} / ${c.total}`),
        h("td", {}, when(b.created_at)),
        h("td", {}, ["validating", "in_progress"].includes(b.status)
          ? cancelButton(`/batches/${b.id}/cancel`, "Cancel", route) : ""));
    })));
}

async function batchView(id) {
  const controller = new AbortController();
  leave = () => controller.abort();
  const header = h("div"), log = h("tbody");
  view.replaceChildren(h("h2", {}, "Batch ", h("span", { class: "mono" }, id)), header,
                       h("h2", {}, "Events"), h("table", {}, log));
  async function refresh() {
    const b = await api("/batches/" + id), c = b.request_counts;
    header.replaceChildren(h("div", { class: "cards" },
      h("div", { class: "card" }, h("b", {}, "status"), status(b.status)),
      h("div", { class: "card" }, h("b", {}, "progress"), bar(c.total ? (c.completed + c.failed) / c.total : 0),
        ` ${c.completed} done, ${c.failed} failed of ${c.total}`),
      h("div", { class: "card" }, h("b", {}, "output file"), h("span", { class: "mono" }, b.output_file_id || "–")),
      h("div", { class: "card" }, h("b", {}, "error file"), h("span", { class: "mono" }, b.error_file_id || "–")),
      ["validating", "in_progress"].includes(b.status) ? cancelButton(`/batches/${id}/cancel`, "Cancel batch", refresh) : ""));
  }
  await refresh();
  follow(`/batches/${id}/events`, (event) => {
    log.prepend(h("tr", {}, h("td", {}, when(event.created_at)), h("td", {}, event.message)));
    refresh().catch(() => {});
  }, controller.signal);
}

async function filesView() {
  const files = (await api("/files")).data;
  view.replaceChildren(h("h2", {}, "Files"), table(["file", "name", "purpose", "size", "created"],
    files.map((f) => h("tr", { "data-id": f.id }, h("td", { class: "mono" }, f.id), h("td", {}, f.filename),
      h("td", {}, f.purpose), h("td", {}, bytes(f.bytes)), h("td", {}, when(f.created_at))))));
}

async function modelsView() {
  const models = (await api("/models")).data;
  view.replaceChildren(h("h2", {}, "Models"), table(["model", "owned by", "created"],
    models.map((m) => h("tr", { "data-id": m.id }, h("td", { class: "mono" }, m.id), h("td", {}, m.owned_by),
      h("td", {}, when(m.created))))));
}

async function workersView() {
  const workers = (await api("/workers")).data;
  view.replaceChildren(h("h2", {}, "Workers"), ...workers.map((w) => h("div", { class: "worker", "data-node": w.node },
    h("b", {}, w.node), ` · ${w.backend}`, w.device_ids ? ` · devices ${w.device_ids}` : "",
    table(["device", "name", "memory used", ""], (w.devices || []).map((d) => {
      const used = d.free_memory != null ? d.total_memory - d.free_memory : null;
      return h("tr", {}, h("td", {}, d.index), h("td", {}, d.name),
        h("td", {}, `${bytes(used)} of ${bytes(d.total_memory)}`), h("td", {}, bar(used / d.total_memory)));
    })),
    h("div", {}, h("b", {}, "current jobs: "), (w.current_jobs || []).length
      ? (w.current_jobs || []).map((j) => h("span", { class: "mono" }, j + " ")) : "none"),
    h("div", {}, h("b", {}, "models loaded: "), (w.models || []).length
      ? w.models.map((m) => `${m.model} (${(m.adapters || []).length} adapters) `) : "none"))));
}

const ROUTES = { jobs: [jobsView, jobView], batches: [batchesView, batchView], files: [filesView],
                 models: [modelsView], workers: [workersView] };

async function route() {
  leave();
  leave = () => {};
  const [, name = "jobs", id] = location.hash.replace(/^#/, "").split("/");
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.hash === "#/" + name);
  if (!key()) {
    view.replaceChildren(h("p", {}, "Enter an API key above: the dashboard shows what that key may see."));
    return;
  }
  const [list, detail] = ROUTES[name] || ROUTES.jobs;
  try {
    await (id && detail ? detail(id) : list());
  } catch (error) {
    view.replaceChildren(h("p", { class: "error" }, error.message));
  }
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY, document.getElementById("key").value.trim());
  document.getElementById("key").value = "";
  route();
});
window.addEventListener("hashchange", route);
route();
