// The run's timeline, a row per block, and its log of every event received.

import { $, el } from "./dom.js";
import { formatDuration, formatMs } from "./format.js";

export function logEvent(event) {
  const data = event.data || {};
  let detail = data.blockId ? ` ${data.blockId}` : "";
  if (event.type === "execution:recovered") detail = ` ${data.reason}`;
  $("events").append(
    el("li", { "data-event-id": String(event.id), "data-type": event.type },
      el("span", { class: "id", text: `#${event.id}` }),
      el("span", { class: "type", text: event.type }),
      el("span", { class: "detail", text: detail })),
  );
  $("log-count").textContent = String($("events").childElementCount);
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
  node.append(
    el("div", { class: "row-head" }, status, name, kind, attempt, decision,
      el("span", { class: "spacer" }), at, duration),
    chunks, output, error,
  );
  row = {
    node, status, kind, attempt, duration, decision, chunks, output, error,
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
