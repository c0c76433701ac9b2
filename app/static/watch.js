// The execution being watched: one EventSource on its stream, fed to the timeline, the
// panel and the graph. Attaching starts from cursor 0 and rebuilds the page from the
// replayed events; EventSource's own reconnects send Last-Event-ID.

import { api, errorText, withToken } from "./api.js";
import { $, show } from "./dom.js";
import { apply, EVENT_TYPES, showDuration, TERMINAL } from "./events.js";
import { formatDateTime, queuedLabel } from "./format.js";
import { notice, setDuplicates, setStatus, showInput, showResult } from "./panel.js";
import { hidePause } from "./pause.js";
import { highlightRow, logEvent } from "./timeline.js";

let watching = null; // the run: see attach()
let graph = null; // the workflow drawn as a graph (graph.js), fed every event of the run

/** The run being watched, or null. */
export function watched() {
  return watching;
}

/** Draw the runs on `flowGraph` from now on. */
export function drawOn(flowGraph) {
  graph = flowGraph;
}

export function attach(executionId, token) {
  if (watching && watching.source) watching.source.close();
  const run = {
    id: executionId,
    token,
    source: null,
    seen: new Set(),
    duplicates: 0,
    blocks: new Map(),
    startedAt: null,
    createdAt: null, // ms: its snapshot's createdAt, or else execution:started's ts less queuedMs
    createdExact: false, // createdAt is the snapshot's
    ending: null, // once ended: {what, ts} of its duration ("cancelled after", the event's ts)
    rejections: [], // {blockId, decision, note} of the approvals answered no
    status: "connecting",
    finished: false,
    workflowId: null,
    pause: null,
    place: "", // while queued: "queued, 3 ahead"
    askedSnapshot: false, // while queued: its snapshot was asked (workflow, answer waiting)
    answerWaits: false, // its pause was answered and the answer waits in line
    input: null, // its input, once execution:started (or its snapshot) told it
    inputKnown: false,
  };
  watching = run;
  clearPanel(run);
  run.source = listen(run);
  readCreated(run);
}

// The run's createdAt, which every view's duration counts from (SPEC §9): its first
// event tells it only to within the moments its start took, so the snapshot says it.
// Unreadable with a stream token alone: the first event's estimate stays.
async function readCreated(run) {
  const response = await api(`/api/executions/${run.id}`).catch(() => null);
  const snapshot = response && response.ok ? await response.json().catch(() => null) : null;
  const created = snapshot ? Date.parse(snapshot.createdAt) : NaN;
  if (watching !== run || Number.isNaN(created)) return;
  $("run-started").textContent = `· started ${formatDateTime(snapshot.createdAt)}`;
  $("run-started").title = snapshot.createdAt;
  // Its first event, which carries the input, may be gone from the ring; a snapshot
  // that keeps the input says it.
  if (!run.inputKnown && snapshot.input !== undefined) showInput(run, snapshot.input);
  run.workflowId = run.workflowId || snapshot.workflowId;
  run.createdAt = created;
  run.createdExact = true;
  if (run.ending) showDuration(run.ending.what, Math.max(0, run.ending.ts - created));
}

function clearPanel(run) {
  $("run-id").textContent = run.id;
  $("run-workflow").textContent = "";
  $("run-duration").textContent = "";
  $("run-started").textContent = "";
  show($("run-input-box"), false);
  $("run-input-box").open = false;
  show($("run-again-box"), false);
  $("timeline").replaceChildren();
  $("notices").replaceChildren();
  $("events").replaceChildren();
  $("log-count").textContent = "0";
  $("result-body").replaceChildren();
  show($("result"), false);
  graph.reset();
  hidePause(run);
  setStatus(run, "connecting");
  setDuplicates(run);
  show($("run-none"), false);
  show($("run"), true);
}

/** Bring the run panel into view at its top (a run just started, or a row clicked). */
export function reveal() {
  const panel = $("run");
  panel.scrollTop = 0;
  const box = panel.getBoundingClientRect();
  // Beside the list it is in view already; below it (a narrow screen) its head comes up.
  if (box.top < 0 || box.top > window.innerHeight / 4) panel.scrollIntoView({ block: "start" });
}

function listen(run) {
  const source = new EventSource(withToken(`/api/executions/${run.id}/stream`, run.token));
  for (const type of EVENT_TYPES) {
    source.addEventListener(type, (message) => onEvent(run, message));
  }
  source.addEventListener("replay:gap", (message) => onGap(run, JSON.parse(message.data)));
  // A queued run's place in line, sent (with no id) until it starts.
  source.addEventListener("queue", (message) => onQueue(run, JSON.parse(message.data)));
  source.onopen = () => {
    if (watching === run) $("run-connection").textContent = "live";
  };
  source.onerror = () => {
    if (watching !== run || run.finished) return;
    if (source.readyState === EventSource.CONNECTING) {
      $("run-connection").textContent = "reconnecting…";
      return;
    }
    // CLOSED: a 204 (nothing more to send), a 401/404, or the server went away for good.
    $("run-connection").textContent = "stream closed";
    explainClosed(run);
  };
  return source;
}

function detach(run) {
  run.finished = true;
  if (run.source) run.source.close();
  if (watching === run) $("run-connection").textContent = "";
}

async function explainClosed(run) {
  const response = await api(`/api/executions/${run.id}`).catch(() => null);
  if (watching !== run) return;
  if (!response || !response.ok) {
    const why = response ? await errorText(response) : "the server cannot be reached";
    notice(`The stream closed and the execution cannot be read: ${why}`, "error");
    return;
  }
  const snapshot = await response.json();
  if (snapshot.status === "queued") setStatus(run, "queued", queuedLabel(snapshot.ahead));
  else setStatus(run, snapshot.status);
  if (["completed", "failed", "cancelled"].includes(snapshot.status)) {
    showResult(run, snapshot.status, snapshot.output, snapshot.error);
    // Its one duration, createdAt to its end (updatedAt is its terminal event's time).
    const ms = Date.parse(snapshot.updatedAt) - Date.parse(snapshot.createdAt);
    if (!Number.isNaN(ms)) showDuration(snapshot.status === "completed" ? "finished in" : `${snapshot.status} after`, ms);
    if (snapshot.decision === "rejected") {
      $("run-status").textContent = `${snapshot.status} · rejected`;
      $("run-status").dataset.decision = "rejected";
    }
    detach(run);
  }
}

async function onQueue(run, place) {
  // Before its first event, or while it is shown queued (a resume's answer waiting in
  // line): otherwise the events say where it is.
  const waiting = () =>
    watching === run && !run.finished && (run.seen.size === 0 || run.status === "queued");
  if (!waiting()) return;
  run.place = queuedLabel(place.ahead);
  setStatus(run, "queued", run.place);
  if (!run.askedSnapshot) {
    // The snapshot says which workflow (no event may have named it yet) and whether
    // this is a start or a paused run's answer waiting (its replayed pause is then not
    // offered again). Unreadable with a stream token alone: the events tell, later.
    run.askedSnapshot = true;
    const response = await api(`/api/executions/${run.id}`).catch(() => null);
    const snapshot = response && response.ok ? await response.json() : null;
    if (watching !== run || run.finished || !snapshot) return;
    run.workflowId = run.workflowId || snapshot.workflowId;
    $("run-workflow").textContent = `workflow ${run.workflowId}`;
    // Its replay may have shown the pause meanwhile; a later event (the resume itself)
    // makes the snapshot old news.
    let newest = 0;
    for (const id of run.seen) if (id > newest) newest = id;
    if (snapshot.status === "queued" && snapshot.pause && newest <= snapshot.lastEventId) {
      run.answerWaits = true;
      hidePause(run);
      setStatus(run, "queued", run.place);
    }
  }
  // The latest place, if another came meanwhile.
  if (run.status === "queued") graph.queued(run.workflowId, run.place);
}

function onGap(run, gap) {
  if (watching !== run) return;
  const missing = Math.max(0, gap.resumeAt - gap.after - 1);
  const what = missing === 1 ? "1 event was" : `${missing} events were`;
  notice(
    `${what} not retained (${gap.reason}): events ${gap.after + 1} to ${gap.resumeAt - 1} ` +
      "cannot be shown; what follows starts at event " + gap.resumeAt + ".",
  );
}

function onEvent(run, message) {
  if (watching !== run) return;
  const event = JSON.parse(message.data);
  // The server sends every event once; this is only a safety net.
  if (run.seen.has(event.id)) {
    run.duplicates += 1;
    setDuplicates(run);
    return;
  }
  run.seen.add(event.id);
  logEvent(event);
  apply(run, event);
  graph.apply(event);
  if (TERMINAL.has(event.type)) detach(run);
}

export async function cancel() {
  const run = watching;
  if (!run) return;
  $("cancel").disabled = true;
  const response = await api(`/api/executions/${run.id}/cancel`, { method: "POST" }).catch((error) => {
    notice(`Cannot cancel: ${error.message}`, "error");
    return null;
  });
  if (response && response.status !== 202) notice(await errorText(response), "error");
  // The stream brings execution:cancelled, which settles the status.
}

/** The graph's `select`: the block's row in the watched run's timeline. */
export function showBlockRow(blockId) {
  return highlightRow(watching, blockId);
}
