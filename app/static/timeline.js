// The run's timeline, a row per block, and its log of every event received.

import { $, el, show } from "./dom.js";
import { formatDuration, formatMs } from "./format.js";

/** One event in the run's history: its id, time, type and block, and its payload as
JSON, collapsed to a line until clicked. */
export function logEvent(event) {
  const data = event.data || {};
  let detail = data.blockId ? data.blockId : "";
  if (event.type === "execution:recovered") detail = data.reason || "";
  if (event.type === "block:started" && data.attempt > 1) detail += ` (attempt ${data.attempt})`;
  const payload = JSON.stringify(data);
  const at = el("time", { class: "ts", text: clockOf(event.ts), dateTime: event.ts || "" });
  at.title = event.ts || "";
  $("events").append(
    el("li", { "data-event-id": String(event.id), "data-type": event.type },
      el("div", { class: "line" },
        el("span", { class: "id", text: `#${event.id}` }),
        at,
        el("span", { class: "type", text: event.type }),
        el("span", { class: "detail", text: detail })),
      payloadOf(data, payload)),
  );
  $("log-count").textContent = String($("events").childElementCount);
}

// The payload as one line, laid out in full on the first click only: a run of thousands
// of chunks keeps one element per event until someone looks.
function payloadOf(data, compact) {
  const details = el("details", { class: "payload" },
    el("summary", { text: compact.length > 160 ? `${compact.slice(0, 160)}…` : compact }));
  details.addEventListener("toggle", () => {
    if (details.open && !details.querySelector("pre")) {
      details.append(el("pre", { class: "json", text: JSON.stringify(data, null, 2) }));
    }
  });
  return details;
}

const pad = (number, size = 2) => String(number).padStart(size, "0");

// "21:35:15.123", local time (the whole timestamp is the element's title).
function clockOf(ts) {
  const date = new Date(ts);
  if (Number.isNaN(date.getTime())) return "";
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}.${pad(date.getMilliseconds(), 3)}`;
}

function offsetOf(run, ts) {
  if (run.startedAt === null) return "";
  return `+${formatMs(Date.parse(ts) - run.startedAt)}`;
}

/** The block's row, added to the timeline the first time the block is named. */
export function blockRow(run, blockId, ts) {
  let row = run.blocks.get(blockId);
  if (row) return row;
  const node = el("li", { class: "block", "data-block-id": blockId });
  const status = el("span", { class: "status", "data-status": "pending", text: "pending" });
  const name = el("span", { class: "name", text: blockId });
  const kind = el("span", { class: "kind" });
  const at = el("span", { class: "at", text: offsetOf(run, ts) });
  const attempt = el("span", { class: "attempt" });
  const duration = el("span", { class: "duration" });
  // A pause's answer: "approved", "rejected: “note”" (with the person's wait in duration).
  const decision = el("span", { class: "decision", hidden: true });
  const chunks = el("pre", { class: "chunks", hidden: true });
  const output = el("div", { class: "output", hidden: true });
  const error = el("p", { class: "error", hidden: true });
  // Every failed attempt of a retried block, with its error: a retry starts the row
  // afresh, and the earlier attempts' errors stay listed here.
  const tries = el("ol", { class: "tries", hidden: true });
  node.append(
    el("div", { class: "row-head" }, status, name, kind, attempt, decision,
      el("span", { class: "spacer" }), at, duration),
    tries, chunks, output, error,
  );
  row = {
    node, status, kind, attempt, duration, decision, chunks, output, error, tries,
    startedTs: null,
    pausedTs: null, // when it paused for a person, until answered
    waitedMs: null, // how long it waited for a person, once answered (or the run ended)
  };
  run.blocks.set(blockId, row);
  $("timeline").append(node);
  return row;
}

// Row states of a block still under way; when the run ends, such a block was stopped
// with it (no event of its own says so), as the graph shows it too.
const UNDER_WAY = new Set(["started", "running", "retrying", "waiting", "resumed", "re-run"]);

/** The run ended (failed or cancelled): blocks still under way read "cancelled". */
export function stopBlocks(run, ts) {
  for (const row of run.blocks.values()) {
    if (!UNDER_WAY.has(row.status.dataset.status)) continue;
    if (row.pausedTs !== null && row.waitedMs === null) {
      row.waitedMs = Math.max(0, Date.parse(ts) - row.pausedTs);
      row.duration.textContent = `waited ${formatDuration(row.waitedMs)}, no answer`;
    } else if (row.startedTs !== null && row.waitedMs === null) {
      row.duration.textContent = formatMs(Date.parse(ts) - row.startedTs);
    }
    setBlockStatus(row, "cancelled");
  }
}

export function setBlockStatus(row, status) {
  row.status.textContent = status;
  row.status.dataset.status = status;
  row.node.dataset.status = status;
}

/** Highlight the block's row and scroll to it (the graph's `select`); false if it has none. */
export function highlightRow(run, blockId) {
  const row = run && run.blocks.get(blockId);
  if (!row) return false;
  for (const other of $("timeline").querySelectorAll(".block.highlighted")) other.classList.remove("highlighted");
  row.node.classList.add("highlighted");
  row.node.scrollIntoView({ behavior: "smooth", block: "center" });
  return true;
}

/** A failed attempt of the block, kept in its row ("attempt 1 failed after 40 ms: code:
message") while the next attempt runs. */
export function addFailedTry(row, attempt, took, error) {
  const what = `${error.code || "error"}: ${error.message || ""}`;
  row.tries.append(
    el("li", { class: "try", "data-attempt": String(attempt) },
      el("span", { class: "try-head", text: `attempt ${attempt} failed${took ? ` after ${took}` : ""}` }),
      el("span", { class: "try-error", text: what })),
  );
  show(row.tries, true);
}
