// The page's list of recent executions, kept live by one EventSource on
// GET /api/executions/live: the server sends the list, then a frame for each execution
// whose status changes (on any replica), so nothing here polls. Each row links to the
// execution's hash (`#ex_…`), which page.js attaches to, and a reload re-attaches.
//
// Frames: `executions` (the whole list: replace), `execution` (one row: insert or
// update), `execution:unlisted` (a row left the status filter: drop it). With an API
// key, the stream is opened with a list token (EventSource cannot send headers), and
// each row carries a token for its own execution's stream.

import { headers } from "./api.js";
import { $ } from "./dom.js";
import { formatDuration, queuedLabel } from "./format.js";
import { apiKey } from "./keys.js";
import { hashOf } from "./routing.js";

const LIMIT = 20;
const FINISHED = new Set(["completed", "failed", "cancelled"]);
const RETRY_MS = [1000, 2000, 5000, 10000, 30000];

const list = {
  rows: new Map(), // id -> row as the server sent it
  source: null,
  attempt: 0, // connections that failed in a row, for the retry delay
  retry: null,
  generation: 0, // bumped by every connect(), so a stale one gives up
  ticker: null,
  scrollToRun: false, // a row was clicked: show the run it attached to
};

// ---------------------------------------------------------------- formatting

const pad = (number) => String(number).padStart(2, "0");

function formatStart(iso) {
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return "";
  const time = `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  if (date.toDateString() === new Date().toDateString()) return time;
  return `${date.toLocaleDateString(undefined, { month: "short", day: "numeric" })} ${time}`;
}

function duration(row) {
  const start = Date.parse(row.createdAt);
  if (Number.isNaN(start)) return "";
  const finished = FINISHED.has(row.status);
  const end = finished ? Date.parse(row.updatedAt) : Date.now();
  return formatDuration(end - start, !finished);
}

// ---------------------------------------------------------------- rendering

function ordered() {
  return [...list.rows.values()]
    .sort((a, b) => (a.createdAt < b.createdAt ? 1 : a.createdAt > b.createdAt ? -1 : 0))
    .slice(0, LIMIT);
}

function cell(text, className) {
  const node = document.createElement("td");
  if (className) node.className = className;
  node.textContent = text;
  return node;
}

function rowNode(row) {
  const tr = document.createElement("tr");
  tr.dataset.executionId = row.id;
  tr.dataset.status = row.status;
  const badge = document.createElement("span");
  badge.className = "status";
  badge.dataset.status = row.status;
  // A queued run says its place in line when the list knows it.
  badge.textContent = row.status === "queued" ? queuedLabel(row.ahead) : row.status;
  const status = cell("");
  status.append(badge);
  if (row.decision === "rejected") {
    // An approval answered no: the run may still complete, as its workflow says.
    badge.dataset.decision = "rejected";
    badge.textContent = `${row.status} · rejected`;
    badge.title = "a person rejected an approval of this run";
  }
  if (row.errorCode) {
    // Why it failed (quarantined, worker_lost, a block's code), beside the status.
    const why = document.createElement("span");
    why.className = "why";
    why.textContent = row.errorCode;
    badge.title = `failed: ${row.errorCode}`;
    status.append(" ", why);
  }
  const link = document.createElement("a");
  link.href = `#${hashOf(row.id, row.streamToken || null)}`;
  link.textContent = row.id;
  link.title = `Watch ${row.id}`;
  const id = cell("", "id");
  id.append(link);
  const started = cell(formatStart(row.createdAt), "at");
  started.title = row.createdAt;
  tr.append(status, cell(row.workflowId, "workflow"), id, started, cell(duration(row), "num duration"));
  link.addEventListener("click", () => {
    list.scrollToRun = true;
  });
  // The whole row answers a click; the link is what the keyboard reaches.
  tr.addEventListener("click", (event) => {
    if (!event.target.closest("a")) link.click();
  });
  return tr;
}

function render() {
  const rows = ordered();
  list.rows = new Map(rows.map((row) => [row.id, row]));
  $("list-rows").replaceChildren(...rows.map(rowNode));
  $("list-empty").hidden = rows.length > 0;
  markCurrent();
  tick();
}

function markCurrent() {
  const current = location.hash.slice(1).split("&")[0];
  for (const tr of $("list-rows").children) {
    if (tr.dataset.executionId === current) tr.setAttribute("aria-current", "true");
    else tr.removeAttribute("aria-current");
  }
}

// Durations of unfinished runs grow on screen: a local timer, only while there are any.
function tick() {
  const live = [...list.rows.values()].some((row) => !FINISHED.has(row.status));
  if (live && list.ticker === null) {
    list.ticker = setInterval(() => {
      for (const tr of $("list-rows").children) {
        const row = list.rows.get(tr.dataset.executionId);
        if (row && !FINISHED.has(row.status)) tr.querySelector(".duration").textContent = duration(row);
      }
    }, 1000);
  } else if (!live && list.ticker !== null) {
    clearInterval(list.ticker);
    list.ticker = null;
  }
}

// ---------------------------------------------------------------- the stream

function setConnection(text) {
  $("list-connection").textContent = text;
}

function showError(text) {
  $("list-error").textContent = text || "";
  $("list-error").hidden = !text;
}

function stop() {
  if (list.source) list.source.close();
  list.source = null;
  clearTimeout(list.retry);
  list.retry = null;
}

function retryLater(generation, why) {
  if (generation !== list.generation) return;
  stop();
  const delay = RETRY_MS[Math.min(list.attempt, RETRY_MS.length - 1)];
  list.attempt += 1;
  setConnection(why ? `${why}; retrying in ${Math.round(delay / 1000)} s` : "reconnecting…");
  list.retry = setTimeout(() => connect(), delay);
}

async function loadWorkflows() {
  const select = $("list-workflow");
  const response = await fetch("/api/workflows", { headers: headers() }).catch(() => null);
  if (!response || !response.ok) return;
  const { workflows } = await response.json();
  const chosen = select.value;
  const ids = workflows.map((wf) => wf.id);
  if (chosen && !ids.includes(chosen)) ids.push(chosen);
  select.replaceChildren(
    new Option("all", ""),
    ...ids.sort().map((id) => new Option(id, id)),
  );
  select.value = chosen;
}

async function connect() {
  const generation = ++list.generation;
  stop();
  setConnection("connecting…");
  let token = null;
  try {
    // With an API key, a list token (EventSource cannot send the header); without
    // one, this answers 401 if the server needs a key.
    const response = await fetch("/api/executions/live/token", {
      method: "POST",
      headers: headers(),
    });
    if (generation !== list.generation) return;
    if (response.status === 401) {
      setConnection("");
      showError("Enter the server's API key above to see its executions.");
      list.rows.clear();
      render();
      return; // until the key changes
    }
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    if (apiKey()) token = (await response.json()).streamToken;
  } catch (error) {
    retryLater(generation, `cannot reach the server (${error.message})`);
    return;
  }
  if (generation !== list.generation) return;
  showError("");
  subscribe(generation, token);
}

// The list stream, with the filters chosen and (with an API key) a list token.
function subscribe(generation, token) {
  const params = new URLSearchParams({ limit: String(LIMIT) });
  if ($("list-status").value) params.set("status", $("list-status").value);
  if ($("list-workflow").value) params.set("workflowId", $("list-workflow").value);
  if (token) params.set("token", token);
  const source = new EventSource(`/api/executions/live?${params}`);
  list.source = source;
  source.addEventListener("executions", (message) => {
    list.rows = new Map(JSON.parse(message.data).executions.map((row) => [row.id, row]));
    render();
  });
  source.addEventListener("execution", (message) => {
    const row = JSON.parse(message.data);
    list.rows.set(row.id, row);
    render();
  });
  source.addEventListener("execution:unlisted", (message) => {
    list.rows.delete(JSON.parse(message.data).id);
    render();
  });
  source.onopen = () => {
    if (list.source !== source) return;
    list.attempt = 0;
    setConnection("live");
  };
  source.onerror = () => {
    if (list.source !== source) return;
    // EventSource reconnects by itself after the server ends a stream (its time cap);
    // a refusal (an expired token, too many streams, a server down) closes it for
    // good: then a new token, later.
    if (source.readyState === EventSource.CONNECTING) setConnection("reconnecting…");
    else retryLater(generation, "the list stream closed");
  };
}

document.addEventListener("DOMContentLoaded", () => {
  $("list-status").addEventListener("change", connect);
  $("list-workflow").addEventListener("change", connect);
  document.addEventListener("flowcast:key", () => {
    loadWorkflows();
    connect();
  });
  window.addEventListener("hashchange", () => {
    markCurrent();
    if (list.scrollToRun) $("run").scrollIntoView({ block: "start" });
    list.scrollToRun = false;
  });
  loadWorkflows();
  connect();
});
