// The page's list of recent executions, kept live by one EventSource on
// GET /api/executions/live: the server sends the list, then a frame for each execution
// whose status changes (on any replica), so nothing here polls. Each row links to the
// execution's hash (`#ex_…`), which page.js attaches to, and a reload re-attaches.
//
// Frames: `executions` (the whole list: replace), `execution` (one row: insert or
// update), `execution:unlisted` (a row left the status filter: drop it). With an API
// key, the stream is opened with a list token (EventSource cannot send headers), and
// each row carries a token for its own execution's stream.
//
// The live list is the newest LIMIT rows; "Load older" pages further back with
// GET /api/executions?before= (its nextBefore), rows shown as they were read. Searching
// an execution id reads its snapshot and attaches to it.

import { api, errorText, headers } from "./api.js";
import { $, el, show } from "./dom.js";
import { formatDateTime, formatDuration, queuedLabel } from "./format.js";
import { apiKey } from "./keys.js";
import { hashOf, parseHash } from "./routing.js";
import { reveal } from "./watch.js";

const LIMIT = 20;
const FINISHED = new Set(["completed", "failed", "cancelled"]);
const RETRY_MS = [1000, 2000, 5000, 10000, 30000];

const list = {
  rows: new Map(), // id -> row as the server sent it: the live list
  older: new Map(), // id -> row of the pages read further back (not live)
  paged: false, // "Load older" was pressed (for these filters)
  nextBefore: null, // the cursor of the next older page, once a page said it
  exhausted: false, // the last older page said there is none after it
  loaded: false, // the live list's first frame arrived (for these filters)
  source: null,
  attempt: 0, // connections that failed in a row, for the retry delay
  retry: null,
  generation: 0, // bumped by every connect(), so a stale one gives up
  ticker: null,
  scrollToRun: false, // a row was clicked: show the run it attached to
};

function duration(row) {
  const start = Date.parse(row.createdAt);
  if (Number.isNaN(start)) return "";
  const finished = FINISHED.has(row.status);
  const end = finished ? Date.parse(row.updatedAt) : Date.now();
  return formatDuration(end - start, !finished);
}

// ---------------------------------------------------------------- rendering

// Newest first, as the server lists them (ties in one ms by id, the larger first).
function newestFirst(a, b) {
  if (a.createdAt !== b.createdAt) return a.createdAt < b.createdAt ? 1 : -1;
  return a.id < b.id ? 1 : a.id > b.id ? -1 : 0;
}

// The live rows, at most LIMIT: a row that leaves the live window, once older pages
// are shown, stays among them (it is still the next one back in time).
function ordered() {
  const live = [...list.rows.values()].sort(newestFirst);
  if (list.paged) for (const row of live.slice(LIMIT)) list.older.set(row.id, row);
  const shown = live.slice(0, LIMIT);
  const ids = new Set(shown.map((row) => row.id));
  const older = [...list.older.values()].filter((row) => !ids.has(row.id)).sort(newestFirst);
  return { live: shown, all: [...shown, ...older] };
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
  // The workflow, and the execution's id under it: the table fits a side column.
  const which = cell("", "which");
  which.append(
    el("div", { class: "workflow", text: row.workflowId, title: row.workflowId }),
    el("div", { class: "id" }, link),
  );
  const started = cell(formatDateTime(row.createdAt), "at");
  started.title = row.createdAt;
  tr.append(status, which, started, cell(duration(row), "num duration"));
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
  const { live, all } = ordered();
  list.rows = new Map(live.map((row) => [row.id, row]));
  $("list-rows").replaceChildren(...all.map(rowNode));
  // Before the first frame the list is not known to be empty: it is loading.
  $("list-empty").textContent = list.loaded ? "No executions yet." : "Loading…";
  show($("list-empty"), all.length === 0);
  // Older pages: once the live list is full (there may be more), until none is left.
  show($("list-older"), list.loaded && !list.exhausted && (list.paged || live.length >= LIMIT));
  show($("list-end"), list.paged && list.exhausted);
  markCurrent();
  tick();
}

// ---------------------------------------------------------------- older pages

function filters() {
  const params = new URLSearchParams({ limit: String(LIMIT) });
  if ($("list-status").value) params.set("status", $("list-status").value);
  if ($("list-workflow").value) params.set("workflowId", $("list-workflow").value);
  return params;
}

// The page after the oldest row shown: the server's cursor, or the row's own.
function olderCursor() {
  if (list.nextBefore) return list.nextBefore;
  const { all } = ordered();
  const oldest = all[all.length - 1];
  return oldest ? `${Date.parse(oldest.createdAt)}:${oldest.id}` : null;
}

async function loadOlder() {
  const generation = list.generation;
  const cursor = olderCursor();
  if (!cursor) return;
  const button = $("list-older");
  button.disabled = true;
  button.textContent = "Loading…";
  const params = filters();
  params.set("before", cursor);
  try {
    const response = await api(`/api/executions?${params}`);
    if (generation !== list.generation) return;
    if (!response.ok) throw new Error(await errorText(response));
    const page = await response.json();
    list.paged = true;
    for (const row of page.executions) if (!list.rows.has(row.id)) list.older.set(row.id, row);
    list.nextBefore = page.nextBefore;
    list.exhausted = !page.nextBefore;
    showError("");
  } catch (error) {
    if (generation === list.generation) showError(`Cannot read older executions: ${error.message}`);
  } finally {
    button.disabled = false;
    button.textContent = "Load older";
  }
  if (generation === list.generation) render();
}

// ---------------------------------------------------------------- search by id

async function search(event) {
  event.preventDefault();
  // An id, or a page link with one in it (".../#ex_…&token=…").
  const typed = $("search-id").value.trim();
  const found = typed.match(/ex_[A-Za-z0-9_-]+/);
  const wanted = found ? found[0] : typed;
  const problem = $("search-error");
  show(problem, false);
  if (!wanted) return;
  const response = await api(`/api/executions/${encodeURIComponent(wanted)}`).catch((error) => {
    problem.textContent = `Cannot reach the server: ${error.message}`;
    show(problem, true);
    return null;
  });
  if (!response) return;
  if (response.status === 404) {
    problem.textContent = `No execution ${wanted} here: it may have expired, or belong to another API key.`;
    show(problem, true);
    return;
  }
  if (!response.ok) {
    problem.textContent = await errorText(response);
    show(problem, true);
    return;
  }
  const snapshot = await response.json();
  const current = parseHash();
  if (current && current.executionId === snapshot.id) {
    reveal();
    return;
  }
  list.scrollToRun = true;
  location.hash = hashOf(snapshot.id, apiKey() ? snapshot.streamToken || null : null);
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

// A new list: new filters (or a new key) start from the newest rows again.
function restart() {
  list.rows.clear();
  list.older.clear();
  list.paged = false;
  list.nextBefore = null;
  list.exhausted = false;
  list.loaded = false;
  render();
  connect();
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
      show($("list-empty"), false);
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
  const params = filters();
  if (token) params.set("token", token);
  const source = new EventSource(`/api/executions/live?${params}`);
  list.source = source;
  source.addEventListener("executions", (message) => {
    list.rows = new Map(JSON.parse(message.data).executions.map((row) => [row.id, row]));
    list.loaded = true;
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
  $("list-status").addEventListener("change", restart);
  $("list-workflow").addEventListener("change", restart);
  $("list-older").addEventListener("click", loadOlder);
  $("list-search").addEventListener("submit", search);
  document.addEventListener("flowcast:key", () => {
    loadWorkflows();
    restart();
  });
  window.addEventListener("hashchange", () => {
    markCurrent();
    if (list.scrollToRun) reveal();
    list.scrollToRun = false;
  });
  loadWorkflows();
  connect();
});
