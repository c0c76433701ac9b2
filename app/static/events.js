// What each event of a run does to the page (the timeline, the status, the pause panel);
// the graph follows the same events by itself (graph.js).

import { $, el, show } from "./dom.js";
import { decisionOf, decisionText, formatDuration, formatMs } from "./format.js";
import { chooseWorkflow } from "./launch.js";
import { notice, setStatus, showInput, showResult } from "./panel.js";
import { hidePause, showPause } from "./pause.js";
import { addFailedTry, blockRow, setBlockStatus, stopBlocks } from "./timeline.js";
import { renderValue } from "./values.js";

export const TERMINAL = new Set(["execution:completed", "execution:failed", "execution:cancelled"]);

/** Show `event` on the page of `run`, the run being watched. */
export function apply(run, event) {
  const handle = HANDLERS[event.type];
  if (handle) handle(run, event, event.data || {});
}

const HANDLERS = {
  "execution:started": (run, event, data) => {
    run.startedAt = Date.parse(event.ts);
    showInput(run, data.input);
    // Its creation: every view's duration counts from there (SPEC §9), time in line too.
    if (!run.createdExact) run.createdAt = run.startedAt - (Number(data.queuedMs) || 0);
    run.workflowId = event.workflowId;
    $("run-workflow").textContent = `workflow ${event.workflowId}`;
    chooseWorkflow(event.workflowId);
    if (!run.answerWaits) setStatus(run, "running");
  },
  "block:started": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    row.startedTs = Date.parse(event.ts);
    row.kind.textContent = data.blockType || "";
    row.attempt.textContent = data.attempt > 1 ? `attempt ${data.attempt}` : "";
    // A block that runs again (a retry, a re-run after execution:recovered) streams
    // from the start: show this run's text, not the runs' texts joined.
    row.chunks.textContent = "";
    show(row.chunks, false);
    show(row.error, false);
    row.duration.textContent = "";
    setBlockStatus(row, "started");
  },
  "block:chunk": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    row.chunks.textContent += data.text;
    show(row.chunks, true);
    setBlockStatus(row, "running");
  },
  "block:completed": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "completed");
    // A block that waited for a person says how long; its own durationMs is only the
    // work after the answer.
    row.duration.textContent =
      row.waitedMs !== null ? waitedText(row.waitedMs) : formatMs(data.durationMs);
    row.output.replaceChildren(renderValue(run, data.output));
    show(row.output, true);
  },
  "block:failed": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, data.willRetry ? "retrying" : "failed");
    row.attempt.textContent = `attempt ${data.attempt}`;
    const took = row.startedTs !== null ? formatMs(Date.parse(event.ts) - row.startedTs) : "";
    if (took) row.duration.textContent = took;
    const error = data.error || {};
    if (data.willRetry) {
      // An attempt that will be retried keeps its error in the row's list of failed
      // attempts: the retry starts the row's text afresh, not its history.
      addFailedTry(row, data.attempt, took, error);
    } else {
      row.error.textContent = `${error.code || "error"}: ${error.message || ""}`;
      show(row.error, true);
    }
  },
  "block:skipped": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "skipped");
    row.error.textContent = data.reason || "";
    row.error.className = "hint";
    show(row.error, Boolean(data.reason));
  },
  "execution:paused": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "waiting");
    row.pausedTs = Date.parse(event.ts);
    row.waitedMs = null;
    row.duration.textContent = "waiting for a person";
    if (run.answerWaits) {
      // Replayed, but answered already: the answer waits in line for a worker (the
      // resume follows once one takes it), so the form is not offered again.
      setStatus(run, "queued", run.place);
      return;
    }
    setStatus(run, "paused");
    showPause(run, data);
  },
  "execution:resumed": (run, event, data) => {
    const row = run.blocks.get(data.blockId);
    const answer = decisionOf(data.input);
    if (answer.decision === "rejected") run.rejections.push({ blockId: data.blockId, ...answer });
    if (row) {
      setBlockStatus(row, "resumed");
      if (row.pausedTs !== null) {
        row.waitedMs = Math.max(0, Date.parse(event.ts) - row.pausedTs);
        row.duration.textContent = waitedText(row.waitedMs);
      }
      row.decision.textContent = decisionText(answer);
      row.decision.dataset.decision = answer.decision;
      show(row.decision, true);
    }
    hidePause(run);
    run.answerWaits = false;
    setStatus(run, "running");
  },
  "execution:recovered": (run, event, data) => {
    // Not an ending: another process carries the execution on from its checkpoint.
    for (const blockId of data.rerun || []) {
      const row = run.blocks.get(blockId);
      if (row) setBlockStatus(row, "re-run");
    }
    const rerun = (data.rerun || []).length;
    const kept = (data.completed || []).length;
    notice(
      `Recovered (${data.reason}): ${rerun === 1 ? "1 block" : `${rerun} blocks`} re-run, ` +
        `${kept} kept from the checkpoint.`,
      "info",
    );
    setStatus(run, "running");
  },
  "execution:completed": (run, event, data) => {
    ended(run, event, "finished in");
    setStatus(run, "completed");
    showResult(run, "completed", data.output, null);
    if (run.rejections.length) showRejected(run);
  },
  "execution:failed": (run, event, data) => {
    stopBlocks(run, event.ts);
    ended(run, event, "failed after");
    setStatus(run, "failed");
    showResult(run, "failed", null, data.error);
  },
  "execution:cancelled": (run, event, data) => {
    stopBlocks(run, event.ts);
    ended(run, event, "cancelled after");
    setStatus(run, "cancelled");
    hidePause(run);
    showResult(run, "cancelled", null, { message: data.reason || "cancelled" });
  },
};

function waitedText(ms) {
  return `waited ${formatDuration(ms)} for a person`;
}

// The run's one duration: from its createdAt to `event`, its terminal event (as the
// list counts it, and execution:completed's durationMs); none while createdAt is unknown
// (watch.js shows it once the snapshot tells).
function ended(run, event, what) {
  run.ending = { what, ts: Date.parse(event.ts) };
  if (run.createdAt !== null) showDuration(what, Math.max(0, run.ending.ts - run.createdAt));
}

/** "· finished in 7.6 s" beside the run's workflow. */
export function showDuration(what, ms) {
  $("run-duration").textContent = `· ${what} ${formatDuration(ms)}`;
}

// A run that completed after a person said no: the badge and the outcome say so first.
function showRejected(run) {
  const badge = $("run-status");
  badge.textContent = "completed · rejected";
  badge.dataset.decision = "rejected";
  $("result-title").textContent = "Rejected";
  // "Rejected at review: “too much”."
  const said = run.rejections.map((r) => (r.note ? `${r.blockId}: “${r.note}”` : r.blockId)).join("; ");
  $("result-body").prepend(el("p", { class: "rejected", text: `Rejected at ${said}.` }));
}

/** Every event type the stream sends for a run (EventSource listens by name). */
export const EVENT_TYPES = Object.keys(HANDLERS);
